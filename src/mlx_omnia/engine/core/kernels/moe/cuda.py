"""Mixture-of-experts launches on MLX's CUDA backend for one token: routing, the selected
experts' gate/up, their down projections combined, and the chained launches of them (device
code in moe.cuh, which reuses qmv.cuh's chunk arithmetic; docs/kernels.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.kernels import cuda_kernel, own_scratch
from mlx_omnia.engine.core.kernels.cuda_common import (
    CUDA_TYPES,
    STATIC_SMEM,
    flag,
    header,
    render,
    trailing,
)
from mlx_omnia.engine.core.kernels.qmv.cuda import (
    MAX_ROWS_STAGED,
    QMV_HEADER,
    Launch,
    QmvSpec,
    blocks_of,
    chain_source,
    chain_wait,
    spec_fits,
    staging,
    staging_bytes,
)

MAX_EXPERTS = 512  # router width one warp holds in registers (16 logits per lane)
MAX_TOP_K = 32     # selected experts: one lane group each in the combine

MOE_HEADER = QMV_HEADER + header(render("moe/moe.cuh"))


@dataclass(frozen=True)
class RouteSpec:
    dtype: mx.Dtype
    n_experts: int
    top_k: int
    topk_first: bool   # order "topk_softmax"
    normalize: bool

    def values(self) -> dict[str, str | int]:
        """The route device call's template arguments."""
        return {"T": CUDA_TYPES[self.dtype], "E": self.n_experts, "TOPK": self.top_k,
                "ORDER": int(self.topk_first), "NORMALIZE": flag(self.normalize)}

    def name(self) -> str:
        return (f"omnia_route_{str(self.dtype).split('.')[-1]}_e{self.n_experts}_k{self.top_k}"
                f"_{'ts' if self.topk_first else 'st'}{'_norm' if self.normalize else ''}")


def route_fits(spec: RouteSpec) -> bool:
    return (
        spec.dtype in CUDA_TYPES
        and 0 < spec.top_k <= min(spec.n_experts, MAX_TOP_K)
        and spec.n_experts <= MAX_EXPERTS
    )


@cache
def route_launcher(
    spec: RouteSpec, lead: tuple[int, ...] = ()
) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """logits [*lead, E] (one row) -> (weights [*lead, k] in the logits' dtype, ids [*lead, k]
    uint32): the outputs come in the caller's shape, so no reshape follows the launch."""
    kernel = cuda_kernel(spec.name(), ("logits",), ("weights", "ids"),
                         render("moe/route.cu", **spec.values()), MOE_HEADER)
    shapes = [(*lead, spec.top_k), (*lead, spec.top_k)]
    dtypes = [spec.dtype, mx.uint32]

    def call(logits: mx.array) -> tuple[mx.array, mx.array]:
        out: Any = kernel(inputs=[logits], output_shapes=shapes, output_dtypes=dtypes,
                          grid=(32, 1, 1), threadgroup=(32, 1, 1))
        return out[0], out[1]

    return call


ROUTED_WARPS = 16  # 512 threads: up to 128 registers a thread still launch
ROUTED_MAX_EXPERTS = 128  # router rows one block computes (16 warps of 8 groups of 4 lanes)


def routed_qmv(router: QmvSpec, n_experts: int) -> QmvSpec:
    """The router GEMV as one block: the most lanes a row (32, 16, 8, 4) that cover n_experts
    rows in at most ROUTED_WARPS warps, 8 chunks a row requested before the input is staged."""
    lanes = next((n for n in (32, 16, 8, 4) if -(-n_experts // (32 // n)) <= ROUTED_WARPS), 4)
    warps = -(-n_experts // (32 // lanes))
    return replace(router, launch=Launch(lanes=lanes, rows=1, warps=warps, unroll=2, prefetch=8))


def routed_fits(route: RouteSpec, router: QmvSpec) -> bool:
    """The router (one bias-free projection, optionally after an RMS norm) and the routing in
    one block: the qmv kernel computes the logits, then one warp routes them."""
    one = routed_qmv(router, route.n_experts)
    return (
        route_fits(route)
        and route.n_experts <= ROUTED_MAX_EXPERTS
        and router.rows == (route.n_experts,)
        and router.gate is None
        and not router.residual
        and router.dtype == route.dtype
        and spec_fits(one)
    )


@cache
def routed_launcher(
    route: RouteSpec, router: QmvSpec, lead: tuple[int, ...] = ()
) -> Callable[[Sequence[mx.array]], tuple[mx.array, mx.array]]:
    """(h [*lead, in] (one row), the router's weights..., norm weight?) -> (weights [*lead, k],
    ids [*lead, k] uint32): one block computes the router logits (qmv, y0, also an output of
    the launch) and, after a barrier, its first warp routes them."""
    one = routed_qmv(router, route.n_experts)
    source = render("moe/routed.cu", ROUTER=one.source(), **route.values())
    kernel = cuda_kernel(f"{route.name()}__{one.name()}", one.input_names(),
                         ("y0", "weights", "ids"), source, MOE_HEADER)
    shapes = [(*lead, route.n_experts), (*lead, route.top_k), (*lead, route.top_k)]
    dtypes = [route.dtype, route.dtype, mx.uint32]
    threads = one.config.warps * 32

    def call(inputs: Sequence[mx.array]) -> tuple[mx.array, mx.array]:
        out: Any = kernel(inputs=list(inputs), output_shapes=shapes, output_dtypes=dtypes,
                          grid=(threads, 1, 1), threadgroup=(threads, 1, 1))
        return out[1], out[2]

    return call


@dataclass(frozen=True)
class ExpertsSpec:
    """One expert matmul kernel: `gate_up` (rows = hidden, 2 * hidden stacked per expert) or the
    down projections combined (rows = output features)."""

    dtype: mx.Dtype
    k: int                    # input features
    rows: int                 # hidden (gate_up) or output rows (down)
    top_k: int
    bits: int | None = None   # None: dense weights in `dtype`
    group_size: int | None = None
    gate_up: bool = True
    residual: bool = False    # down only
    norm_eps: float | None = None  # gate_up only: RMS-normalize the input first (weight input `g`)

    @property
    def values_per_chunk(self) -> int:
        return 8 if self.bits is None else 128 // self.bits

    @property
    def lanes(self) -> int:
        """gate_up: lanes per (expert, row) pair, leaving each lane about 4 chunks; down: lanes
        per selected expert (32 over k rounded up to a power of two)."""
        if self.gate_up:
            chunks = self.k // self.values_per_chunk
            return next((n for n in (32, 16, 8) if chunks >= 4 * n), 4)
        p = 1
        while p < self.top_k:
            p *= 2
        return 32 // p

    def name(self) -> str:
        fmt = "dense" if self.bits is None else f"q{self.bits}g{self.group_size}"
        kind = "gate_up" if self.gate_up else "down" + ("_res" if self.residual else "")
        norm = ("_norm" + hashlib.sha1(repr(self.norm_eps).encode()).hexdigest()[:8]
                if self.norm_eps is not None else "")
        return (f"omnia_experts_{kind}_{str(self.dtype).split('.')[-1]}_{fmt}_k{self.k}"
                f"_n{self.rows}_top{self.top_k}{norm}")


WARPS = 8
NO_WAIT = "nullptr, 0"  # a call's wait arguments when it does not wait


def experts_fits(spec: ExpertsSpec) -> bool:
    """Formats and geometry the kernels compute: dense bf16/fp16 or affine 4/8-bit in groups of
    32/64/128, whole 16-byte chunks, at most MAX_TOP_K experts, the staged input in shared
    memory."""
    if spec.dtype not in CUDA_TYPES or not 0 < spec.top_k <= MAX_TOP_K or spec.rows <= 0:
        return False
    if (spec.residual and spec.gate_up) or (spec.norm_eps is not None and not spec.gate_up):
        return False
    if spec.bits is None:
        fmt_ok = spec.group_size is None
    else:
        fmt_ok = (
            spec.bits in (4, 8) and spec.group_size in (32, 64, 128)
            and spec.k % spec.group_size == 0
        )
    staged = spec.k * (1 if spec.gate_up else spec.top_k)
    return (
        fmt_ok
        and spec.k % spec.values_per_chunk == 0
        and spec.k % 8 == 0
        and staged <= MAX_ROWS_STAGED
    )


def experts_input_names(spec: ExpertsSpec) -> tuple[str, ...]:
    """The launch's inputs: gate_up (x, ids, weights..., g?); down (h, ids, wts, weights...,
    res?)."""
    mats = ("w", "s", "b") if spec.bits is not None else ("w",)
    if spec.gate_up:
        return ("x", "ids", *mats, *(("g",) if spec.norm_eps is not None else ()))
    return ("h", "ids", "wts", *mats, *(("res",) if spec.residual else ()))


def experts_blocks(spec: ExpertsSpec, rows: int = 1) -> int:
    """Blocks of spec's own launch (WARPS warps each; down: `rows` output rows a warp)."""
    if spec.gate_up:
        return -(-(spec.top_k * spec.rows) // (WARPS * 32 // spec.lanes))
    return -(-spec.rows // (WARPS * rows))


# Output rows a warp of RouteExperts' down phase. 1: its 256 down blocks (Qwen3-30B-A3B) do not
# fit beside the gate/up blocks (4 blocks an SM), and the last start only as gate/up blocks
# end; 2 halves them (the same sums; scripts/device/kernel_ab.py `down_two_rows` measures it).
ROUTE_EXPERTS_DOWN_ROWS = 1


def experts_call(spec: ExpertsSpec, *, block: str = "blockIdx.x", coherent: bool = False,
                 names: Mapping[str, str] | None = None, wait: str | None = None,
                 here: bool = False, wait_ids: str | None = None, ext: str | None = None,
                 down: ExpertsSpec | None = None, ids_shared: bool = False,
                 rows: int = 1) -> str:
    """The expert_gate_up / expert_down device call, flags as the device function's (moe.cuh):
    `coherent` CG, `here` HERE, `ext` EXT, `down` DOWN_ROWS (its weights into L2), `ids_shared`
    IDS_SHARED, `rows` expert_down_rows; `wait`/`wait_ids` as chain_wait; `names` renames."""
    rename = dict(names or {})

    def n(name: str) -> str:
        return rename.get(name, name)

    values: dict[str, str | int] = {
        "T": CUDA_TYPES[spec.dtype], "BITS": spec.bits or 0, "GROUP": spec.group_size or 1,
        "K": spec.k, "TOPK": spec.top_k, "NWARPS": WARPS, "block": block,
        "w": n("w"), "s": n("s") if spec.bits is not None else "nullptr",
        "b": n("b") if spec.bits is not None else "nullptr", "ids": n("ids"), "out": n("out"),
    }
    # the optional template arguments (flags) and trailing arguments (more), in order
    flags: list[str] = []
    more: list[str] = []
    if spec.gate_up:
        assert not here and wait_ids is None, "gate/up reads its ids after `wait`"
        norm = spec.norm_eps is not None
        if coherent or wait is not None or ext is not None or down is not None:
            flags += [flag(coherent), flag(ext is not None)]
            more += [wait or NO_WAIT, ext or "nullptr"]
        if down is not None:
            flags.append(str(down.rows))
            more += ["w2, s2, b2" if down.bits is not None else "w2, nullptr, nullptr",
                     str(experts_blocks(spec))]
            if ids_shared:
                flags.append("true")
        else:
            assert not ids_shared, "a gate/up call with shared ids names its down"
        return render(
            "moe/gate_up_call.cu", **values, HID=spec.rows, LPR=spec.lanes, NORM=flag(norm),
            FLAGS=trailing(flags), x=n("x"), g=n("g") if norm else "nullptr",
            eps=repr(float(spec.norm_eps)) + "f" if spec.norm_eps is not None else "0.f",
            more=trailing(more),
        )
    if here or wait_ids is not None or ext is not None:
        flags += [flag(here), flag(ext is not None)]
        more += [wait or NO_WAIT, wait_ids or NO_WAIT, ext or "nullptr"]
    elif wait:
        more.append(wait)
    if ids_shared:
        assert here, "shared ids come with `here`"
        flags.append("true")
    if rows != 1:
        assert here and ext is not None, "rows a warp come with `here` and `ext`"
        flags += ([] if ids_shared else ["false"]) + [str(rows)]
    return render(
        "moe/down_call.cu", **values, CALL="expert_down" if rows == 1 else "expert_down_rows",
        OUT=spec.rows, LPE=spec.lanes, RESID=flag(spec.residual), CG=flag(coherent),
        FLAGS=trailing(flags), h=n("h"), wts=n("wts"),
        res=n("res") if spec.residual else "nullptr", more=trailing(more),
    )


def experts_staging_bytes(spec: ExpertsSpec) -> int:
    """Shared bytes the expert call stages its input in (`ext`): one row (gate/up) or top_k."""
    values = spec.k * (1 if spec.gate_up else spec.top_k)
    if spec.bits is None:
        return staging(spec.dtype.size, 4, 1, values)
    return staging(spec.dtype.size, values, values // spec.values_per_chunk, 8)


@cache
def experts_launcher(
    spec: ExpertsSpec, lead: tuple[int, ...] = ()
) -> Callable[[Sequence[mx.array]], mx.array]:
    """gate_up: (x [in], ids [k], weights..., norm weight [in]?) -> [*lead, k, hidden]; down: (h [k, in], ids [k],
    routing weights [k], weights..., residual [out]?) -> [*lead, out] (one token: `lead` only
    shapes the output as the caller wants it, so no reshape follows the launch)."""
    kernel = cuda_kernel(spec.name(), experts_input_names(spec), ("out",), experts_call(spec),
                         MOE_HEADER)
    shape = (*lead, spec.top_k, spec.rows) if spec.gate_up else (*lead, spec.rows)
    grid, threads = (experts_blocks(spec) * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)

    def call(inputs: Sequence[mx.array]) -> mx.array:
        out: Any = kernel(inputs=list(inputs), output_shapes=[shape], output_dtypes=[spec.dtype],
                          grid=grid, threadgroup=threads)
        return out[0]

    return call


def chain_fits(up: ExpertsSpec, down: ExpertsSpec) -> bool:
    """Gate/up then down in one launch (chain_launcher): each fits alone, they take the same
    format and selected experts, the down reads the gate/up's hidden rows, and both staged
    inputs fit one block's static shared memory together."""
    return (
        up.gate_up and not down.gate_up
        and experts_fits(up) and experts_fits(down)
        and (up.dtype, up.bits, up.group_size, up.top_k)
        == (down.dtype, down.bits, down.group_size, down.top_k)
        and down.k == up.rows
        and up.k + up.top_k * up.rows <= MAX_ROWS_STAGED
    )


@cache
def chain_launcher(
    up: ExpertsSpec, down: ExpertsSpec, lead: tuple[int, ...] = ()
) -> Callable[..., mx.array]:
    """(x, ids, routing weights, gate/up weights..., down weights..., norm weight?, residual?,
    counters [3]) -> [*lead, out]: gate/up into the launch scratch (`mid`), then down, one
    chained launch; the counters are left zero (the caller's)."""
    quant = up.bits is not None
    m1 = ("w1", "s1", "b1") if quant else ("w1",)
    m2 = ("w2", "s2", "b2") if quant else ("w2",)
    names = ("x", "ids", "wts", *m1, *m2, *(("g",) if up.norm_eps is not None else ()),
             *(("res",) if down.residual else ()), "counters", "scratch")
    nb1, nb2 = experts_blocks(up), experts_blocks(down)
    source = render("moe/experts_chain.cu", T=CUDA_TYPES[up.dtype], CHAIN=chain_source(
        nb1,
        experts_call(up, block="t", names={"w": "w1", "s": "s1", "b": "b1", "out": "mid"},
                     down=down),
        experts_call(down, block=f"t - {nb1}", coherent=True,
                     names={"h": "mid", "w": "w2", "s": "s2", "b": "b2"}, wait=chain_wait(nb1)),
        nb2,
    ))
    prefix = len("omnia_experts_")
    kernel = cuda_kernel(f"omnia_experts_chain_{up.name()[prefix:]}__{down.name()[prefix:]}",
                         names, ("out",), source, MOE_HEADER)
    shapes = [(*lead, down.rows)]
    grid, threads = ((nb1 + nb2) * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)
    own = own_scratch(up.top_k * up.rows * up.dtype.size)

    def call(inputs: Sequence[mx.array], scratch: mx.array | None = None) -> mx.array:
        out: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                          output_shapes=shapes, output_dtypes=[up.dtype], grid=grid,
                          threadgroup=threads)
        return out[0]

    return call


def chained_router(router: QmvSpec, n_experts: int, warps: int) -> QmvSpec:
    """The router GEMV as a chained launch's second phase of `warps` warps: the most lanes a row
    that leave no lane without a chunk, all of a lane's chunks (at most 16) requested before the
    wait, so its rows spread over several blocks (docs/kernels.md, "Measurement notes")."""
    chunks = router.k // (8 if router.bits is None else 128 // router.bits)
    lanes = next((n for n in (32, 16, 8) if chunks >= n), 4)
    return replace(router, launch=Launch(lanes=lanes, rows=1, warps=warps, unroll=2,
                                         prefetch=min(16, -(-chunks // lanes)), loop=1))


def project_route_fits(project: QmvSpec, route: RouteSpec, router: QmvSpec) -> bool:
    """A projection with its residual, then the router and routing of its output, in one launch:
    each fits alone, in one dtype, the router reads the projection's rows, and both staged
    inputs fit one block's static shared memory."""
    chained = chained_router(router, route.n_experts, project.config.warps)
    return (
        spec_fits(project) and project.residual and project.norm_eps is None
        and project.gate is None and len(project.rows) == 1
        and routed_fits(route, router)
        and spec_fits(chained)
        and project.dtype == router.dtype == route.dtype
        and project.rows[0] == router.k
        and project.k + router.k <= MAX_ROWS_STAGED
    )


@cache
def project_route_launcher(
    project: QmvSpec, route: RouteSpec, router: QmvSpec, lead: tuple[int, ...] = ()
) -> Callable[..., tuple[mx.array, mx.array, mx.array]]:
    """(a, the projection's weights..., residual, the router's weights..., norm weight?, counters
    [4]) -> (h = residual + a @ P.T, routing weights, ids): the projection, then the router into
    the launch scratch, whose last block routes; one chained launch, counters left zero."""
    cfg = project.config
    chained = chained_router(router, route.n_experts, cfg.warps)
    nb1, nb2 = blocks_of(project), blocks_of(chained)
    quant_p, quant_r = project.bits is not None, router.bits is not None
    norm = router.norm_eps is not None
    names = ("a", "pw", *(("ps", "pb") if quant_p else ()), "res", "rw",
             *(("rs", "rb") if quant_r else ()), *(("g",) if norm else ()), "counters", "scratch")
    router_phase = render(
        "moe/project_route_router.cu", **route.values(), LAST=nb2 - 1,
        ROUTER=chained.source(block=f"t - {nb1}", coherent=True,
                              names={"x": "h", "w0": "rw", "s0": "rs", "b0": "rb", "y0": "logits"},
                              wait=chain_wait(nb1)),
    )
    source = render("moe/project_route.cu", T=CUDA_TYPES[route.dtype], CHAIN=chain_source(
        nb1,
        project.source(block="t", names={"x": "a", "w0": "pw", "s0": "ps", "b0": "pb",
                                         "y0": "h"}),
        router_phase,
        nb2,
    ))
    kernel = cuda_kernel(f"omnia_project_route__{project.name()}__{route.name()}__{chained.name()}",
                         names, ("h", "weights", "ids"), source, MOE_HEADER)
    shapes = [(*lead, project.rows[0]), (*lead, route.top_k), (*lead, route.top_k)]
    dtypes = [route.dtype, route.dtype, mx.uint32]
    grid, threads = ((nb1 + nb2) * cfg.warps * 32, 1, 1), (cfg.warps * 32, 1, 1)
    own = own_scratch(route.n_experts * route.dtype.size)

    def call(
        inputs: Sequence[mx.array], scratch: mx.array | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        out: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                          output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                          threadgroup=threads)
        return out[0], out[1], out[2]

    return call


# -- o_proj + residual -> router -> routing -> expert gate/up -> expert down, one launch --------
def route_experts_ext(project: QmvSpec, router: QmvSpec, up: ExpertsSpec,
                      down: ExpertsSpec) -> int:
    """Bytes of the launch's one staging buffer: the largest of its four phases' (a block runs
    one phase, so they share it)."""
    return max(staging_bytes(project), staging_bytes(router), experts_staging_bytes(up),
               experts_staging_bytes(down))


def route_experts_project(project: QmvSpec) -> QmvSpec:
    """The projection as RouteExperts runs it: the four phases share one block size, the
    experts' WARPS (a launch's warps do not change its sums, only how many rows a block
    computes)."""
    if project.config.warps == WARPS:
        return project
    return replace(project, launch=replace(project.config, warps=WARPS))


def route_experts_fits(project: QmvSpec, route: RouteSpec, router: QmvSpec, up: ExpertsSpec,
                       down: ExpertsSpec) -> bool:
    """project_route then the experts chain in one launch: each pair fits alone, one block size,
    the experts read the projection's rows and add them back, router and gate/up share one eps,
    and the shared staging fits the block's static shared memory."""
    chained = chained_router(router, route.n_experts, project.config.warps)
    return (
        project_route_fits(project, route, router) and chain_fits(up, down)
        and project.config.warps == WARPS
        and up.dtype == project.dtype and up.k == down.rows == project.rows[0]
        and down.residual and up.top_k == down.top_k == route.top_k
        and router.norm_eps is not None and up.norm_eps == router.norm_eps
        and route_experts_ext(project, chained, up, down) + 1024 <= STATIC_SMEM
    )


def route_experts_scratch(route: RouteSpec, up: ExpertsSpec, down: ExpertsSpec
                          ) -> tuple[int, int, int, int, int]:
    """Byte offsets in the launch scratch of h, the logits, the routing weights, the ids and the
    experts' intermediate rows, then its size."""
    size = up.dtype.size

    def r16(n: int) -> int:
        return -(-n // 16) * 16

    logits = r16(down.rows * size)
    weights = logits + r16(route.n_experts * size)
    ids = weights + r16(route.top_k * size)
    mid = ids + r16(route.top_k * 4)
    return logits, weights, ids, mid, mid + r16(up.top_k * up.rows * size)


@cache
def route_experts_launcher(
    project: QmvSpec, route: RouteSpec, router: QmvSpec, up: ExpertsSpec, down: ExpertsSpec,
    lead: tuple[int, ...] = (), local_route: bool = True,
) -> Callable[..., mx.array]:
    """(a, projection, router, norm, gate/up and down weights..., counters [6]) -> residual + o +
    experts(norm(residual + o)), o = a @ P.T: four phases in one launch (docs/kernels.md).
    `local_route`: every expert block routes itself; False: the last router block does."""
    chained = chained_router(router, route.n_experts, WARPS)
    na, nb = blocks_of(project), blocks_of(chained)
    nc, nd = experts_blocks(up), experts_blocks(down, ROUTE_EXPERTS_DOWN_ROWS)
    quant = project.bits is not None
    r_quant, e_quant = router.bits is not None, up.bits is not None
    names = ("a", "pw", *(("ps", "pb") if quant else ()), "res", "rw",
             *(("rs", "rb") if r_quant else ()), "g", "w1", *(("s1", "b1") if e_quant else ()),
             "w2", *(("s2", "b2") if e_quant else ()), "counters", "scratch")
    logits, weights, ids, mid, _ = route_experts_scratch(route, up, down)
    # local_route: every expert block routes the logits itself into its shared memory, once all
    # the router blocks have written them; the expert calls then read the ids from there
    if local_route:
        router_done = render("moe/route_experts_router_counts.cu")
        experts_route = render("moe/route_experts_local_route.cu", **route.values(), ROUTERS=nb)
        routed, ids_wait = {"ids": "l_ids", "wts": "l_wts"}, None
    else:
        router_done = render("moe/route_experts_router_routes.cu", **route.values(),
                             LAST_ROUTER=nb - 1)
        experts_route, routed, ids_wait = "", {}, "count + 4, 1"
    source = render(
        "moe/route_experts.cu", T=CUDA_TYPES[route.dtype],
        EXT=route_experts_ext(project, chained, up, down),
        LOGITS=logits, WEIGHTS=weights, IDS=ids, MID=mid,
        PROJECT_END=na, ROUTER_END=na + nb, GATE_UP_END=na + nb + nc, LAST=nd - 1,
        PROJECT=project.source(block="t", names={"x": "a", "w0": "pw", "s0": "ps", "b0": "pb",
                                                 "y0": "h"}, ext="ext"),
        ROUTER=chained.source(block=f"t - {na}", coherent=True,
                              names={"x": "h", "w0": "rw", "s0": "rs", "b0": "rb", "y0": "logits"},
                              wait=chain_wait(na), ext="ext"),
        ROUTER_DONE=router_done, EXPERTS_ROUTE=experts_route,
        GATE_UP=experts_call(up, block=f"t - {na + nb}", coherent=True, wait=ids_wait,
                             names={"x": "h", "w": "w1", "s": "s1", "b": "b1", "out": "mid",
                                    **routed},
                             ext="ext", down=down, ids_shared=local_route),
        DOWN=experts_call(down, block=f"t - {na + nb + nc}", coherent=True, here=True,
                          wait=f"count + 5, {nc}", wait_ids=ids_wait,
                          names={"h": "mid", "w": "w2", "s": "s2", "b": "b2", "res": "h",
                                 **routed},
                          ext="ext", ids_shared=local_route, rows=ROUTE_EXPERTS_DOWN_ROWS),
    )
    # the four calls' names would pass 255 characters (MLX names its cached module files by
    # the kernel's name): the route's and down's names, and a digest of all four
    full = f"{project.name()}|{route.name()}|{chained.name()}|{up.name()}|{down.name()}"
    digest = hashlib.sha1(full.encode()).hexdigest()[:16]
    kernel = cuda_kernel(
        f"omnia_route_experts__{route.name()}__{down.name()[len('omnia_experts_'):]}_{digest}"
        + ("_lr" if local_route else "")
        + (f"_r{ROUTE_EXPERTS_DOWN_ROWS}" if ROUTE_EXPERTS_DOWN_ROWS != 1 else ""),
        names, ("out",), source, MOE_HEADER)
    shapes = [(*lead, down.rows)]
    grid, threads = ((na + nb + nc + nd) * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)
    own = own_scratch(route_experts_scratch(route, up, down)[-1])

    def call(inputs: Sequence[mx.array], scratch: mx.array | None = None) -> mx.array:
        out: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                          output_shapes=shapes, output_dtypes=[up.dtype], grid=grid,
                          threadgroup=threads)
        return out[0]

    return call


# -- a batch's rows: every row its own token, one launch ----------------------------------------
MAX_BATCH_ROWS = 64  # rows one launch takes


@cache
def route_rows_launcher(
    spec: RouteSpec, rows: int, lead: tuple[int, ...]
) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """logits [*lead, E] (`rows` rows) -> (weights, ids) [*lead, k]: a warp a row, each the
    single-row routing."""
    kernel = cuda_kernel(spec.name() + "_rows", ("logits",), ("weights", "ids"),
                         render("moe/route_rows.cu", **spec.values()), MOE_HEADER)
    shapes = [(*lead, spec.top_k), (*lead, spec.top_k)]
    dtypes = [spec.dtype, mx.uint32]

    def call(logits: mx.array) -> tuple[mx.array, mx.array]:
        out: Any = kernel(inputs=[logits], output_shapes=shapes, output_dtypes=dtypes,
                          grid=(32 * rows, 1, 1), threadgroup=(32, 1, 1))
        return out[0], out[1]

    return call


@cache
def experts_rows_launcher(
    spec: ExpertsSpec, rows: int, lead: tuple[int, ...]
) -> Callable[[Sequence[mx.array]], mx.array]:
    """The experts launch for `rows` tokens (inputs as experts_launcher's, each with a leading
    row axis; gate/up -> [*lead, k, hidden], down -> [*lead, out]): each row's blocks run the
    single-row device call on that row's input, ids, routing weights, residual and output."""
    per_row = experts_blocks(spec)
    k, top_k = spec.k, spec.top_k
    if spec.gate_up:
        names = {"x": f"x + (size_t)row * {k}", "ids": f"ids + (size_t)row * {top_k}",
                 "out": f"out + (size_t)row * {top_k * spec.rows}"}
        shape = (*lead, top_k, spec.rows)
    else:
        names = {"h": f"h + (size_t)row * {top_k * k}", "ids": f"ids + (size_t)row * {top_k}",
                 "wts": f"wts + (size_t)row * {top_k}", "out": f"out + (size_t)row * {spec.rows}",
                 "res": f"res + (size_t)row * {spec.rows}"}
        shape = (*lead, spec.rows)
    source = (f"const int row = blockIdx.x / {per_row};\n"
              + experts_call(spec, block=f"blockIdx.x % {per_row}", names=names))
    kernel = cuda_kernel(spec.name() + "_rows", experts_input_names(spec), ("out",), source,
                         MOE_HEADER)
    grid, threads = (rows * per_row * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)

    def call(inputs: Sequence[mx.array]) -> mx.array:
        out: Any = kernel(inputs=list(inputs), output_shapes=[shape], output_dtypes=[spec.dtype],
                          grid=grid, threadgroup=threads)
        return out[0]

    return call
