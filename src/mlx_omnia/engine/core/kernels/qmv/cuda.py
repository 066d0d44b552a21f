"""Qmv launches on MLX's CUDA backend: y = W x for one activation row, dense or affine 4/8-bit,
up to three projections or a gated pair, an RMS norm first, a residual after (device code in
qmv.cuh, the calls in qmv_call.cu and chain.cu; docs/kernels.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import mlx.core as mx

from mlx_omnia.engine.core.kernels import cuda_kernel
from mlx_omnia.engine.core.kernels.cuda_common import (
    CUDA_TYPES,
    HEADER,
    flag,
    header,
    render,
    trailing,
)
from mlx_omnia.engine.core.mxcompat import reshape

Gate = Literal["silu", "gelu_tanh"]
WARPS = 8

QMV_HEADER = HEADER + header(render("qmv/qmv.cuh"))


@dataclass(frozen=True)
class Launch:
    """How the rows are spread over the GPU: LPR lanes per row group, R rows per group, warps per
    block, and the unroll of the chunk loop. Any value computes the same sums in the same order
    per lane (only the lane count changes the split of a row); the default follows the shape."""

    lanes: int = 32
    rows: int = 1
    warps: int = 8
    unroll: int = 2
    prefetch: int = 0   # chunks per row loaded before the input is staged (0: 2 for one row, else 1)
    loop: int = 1       # sets of rows a block computes one after another, staging the input once


# Launches the H200 sweep (scripts/device/qmv_sweep.py) measures; tests/test_kernels_cuda.py checks
# every one against the core.
CANDIDATES: tuple[Launch, ...] = (
    Launch(32, 1, 4, 2), Launch(32, 2, 4, 2), Launch(32, 4, 8, 2), Launch(32, 1, 8, 2),
    Launch(32, 2, 8, 2), Launch(16, 1, 4, 2), Launch(16, 2, 4, 2), Launch(16, 1, 4, 4),
    Launch(16, 1, 8, 2), Launch(8, 1, 4, 2), Launch(8, 2, 4, 2), Launch(8, 1, 4, 4),
    Launch(4, 1, 4, 2),
    # all of a lane's chunks (up to 16) in flight before the input is staged
    Launch(16, 1, 8, 2, 16), Launch(32, 1, 8, 2, 16), Launch(16, 1, 4, 2, 16),
    Launch(8, 1, 4, 2, 16), Launch(16, 2, 8, 2, 16), Launch(32, 1, 4, 2, 16),
    # 2 or 4 sets of rows per block: the input staged (and normalized) once for all of them
    Launch(16, 1, 8, 2, 0, 2), Launch(16, 1, 8, 2, 0, 4), Launch(32, 1, 8, 2, 0, 2),
    Launch(8, 1, 4, 2, 0, 2), Launch(16, 1, 8, 2, 16, 2),
)


@dataclass(frozen=True)
class QmvSpec:
    """Everything baked into one kernel: formats, geometry, fusions."""

    dtype: mx.Dtype              # activations (and dense weights, scales, biases, norm weight)
    k: int                       # input features
    rows: tuple[int, ...]        # output rows of each segment (1 to 3; 2 equal when gated)
    bits: int | None = None      # None: dense weights in `dtype`
    group_size: int | None = None
    norm_eps: float | None = None  # RMS-normalize the input first (weight input `g`)
    gate: Gate | None = None
    residual: bool = False
    launch: Launch | None = None   # None: the default for the shape (`config`)

    @property
    def out_rows(self) -> int:
        return self.rows[0] if self.gate is not None else sum(self.rows)

    @property
    def output_rows(self) -> tuple[int, ...]:
        """Rows of each output (one, when gated)."""
        return (self.rows[0],) if self.gate is not None else self.rows

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("y0",) if self.gate is not None else tuple(f"y{i}" for i in range(len(self.rows)))

    @property
    def config(self) -> Launch:
        """The launch for this shape, from the H200 sweep (docs/kernels.md): a row gets the most
        lanes that still leave each lane 4 chunks (8 for vocabulary-sized outputs, whose grid is
        large anyway), so short quantized rows are split less and more rows run per block."""
        if self.launch is not None:
            return self.launch
        chunks = self.k // (8 if self.bits is None else 128 // self.bits)
        huge = self.out_rows >= 32768
        lanes = next((n for n in (32, 16) if chunks >= (8 if huge else 4) * n), 8)
        rows = 2 if huge and all(n % 2 == 0 for n in self.rows) else 1
        return Launch(lanes=lanes, rows=rows, warps=WARPS if lanes >= 16 else 4, unroll=2)

    def input_names(self) -> tuple[str, ...]:
        names = ["x"]
        for i in range(len(self.rows)):
            names.append(f"w{i}")
            if self.bits is not None:
                names += [f"s{i}", f"b{i}"]
        if self.norm_eps is not None:
            names.append("g")
        if self.residual:
            names.append("res")
        return tuple(names)

    def name(self) -> str:
        fmt = "dense" if self.bits is None else f"q{self.bits}g{self.group_size}"
        parts = [
            "omnia_qmv", str(self.dtype).split(".")[-1], fmt, f"k{self.k}",
            "n" + "_".join(map(str, self.rows)),
            f"l{self.config.lanes}r{self.config.rows}w{self.config.warps}u{self.config.unroll}"
            + (f"p{self.config.prefetch}" if self.config.prefetch else "")
            + (f"o{self.config.loop}" if self.config.loop > 1 else ""),
        ]
        if self.norm_eps is not None:
            parts.append("norm" + hashlib.sha1(repr(self.norm_eps).encode()).hexdigest()[:8])
        if self.gate is not None:
            parts.append(self.gate)
        if self.residual:
            parts.append("res")
        return "_".join(parts)

    def source(self, *, block: str = "blockIdx.x", coherent: bool = False,
               names: Mapping[str, str] | None = None, wait: str | None = None,
               ext: str | None = None) -> str:
        """The qmv device call: `block` indexes the qmv blocks, `coherent` x comes from this
        launch, `names` renames inputs/outputs, `wait` is chain_wait's, `ext` a shared staging
        buffer of the launch's (at least staging_bytes(self))."""
        inputs = set(self.input_names())
        rename = dict(names or {})

        def arg(name: str) -> str:
            return rename.get(name, name) if name in inputs else "nullptr"

        n = list(self.rows) + [0] * (3 - len(self.rows))
        outs = [*(rename.get(o, o) for o in self.outputs), "nullptr", "nullptr"][:3]
        # the optional trailing arguments: (wait, wait_for), then ext
        more = [wait] if wait else []
        if ext:
            more += [ext] if wait else ["nullptr, 0", ext]
        cfg = self.config
        return render(
            "qmv/qmv_call.cu", T=CUDA_TYPES[self.dtype], BITS=self.bits or 0,
            GROUP=self.group_size or 1, K=self.k, N0=n[0], N1=n[1], N2=n[2], R=cfg.rows,
            LPR=cfg.lanes, NWARPS=cfg.warps, UNROLL=cfg.unroll, PREF=cfg.prefetch, LOOP=cfg.loop,
            NORM=flag(self.norm_eps is not None), RESID=flag(self.residual),
            ACT={None: 0, "silu": 1, "gelu_tanh": 2}[self.gate], CG=flag(coherent),
            EXT=", true" if ext else "",
            **{name: arg(name) for name in ("x", "w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2",
                                            "b2", "g", "res")},
            y0=outs[0], y1=outs[1], y2=outs[2],
            eps=repr(float(self.norm_eps)) + "f" if self.norm_eps is not None else "0.f",
            block=block, more=trailing(more),
        )


@cache
def launcher(spec: QmvSpec, lead: tuple[int, ...]) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """The kernel call for `spec`, with everything but the inputs worked out once (a decode step
    calls it hundreds of times per token)."""
    kernel = cuda_kernel(spec.name(), spec.input_names(), spec.outputs, spec.source(), QMV_HEADER)
    cfg = spec.config
    shapes = [(*lead, n) for n in spec.output_rows]
    dtypes = [spec.dtype] * len(shapes)
    grid, threads = (blocks_of(spec) * cfg.warps * 32, 1, 1), (cfg.warps * 32, 1, 1)

    def call(inputs: Sequence[mx.array]) -> list[mx.array]:
        out: Any = kernel(
            inputs=list(inputs), output_shapes=shapes, output_dtypes=dtypes, grid=grid,
            threadgroup=threads,
        )
        return list(out)

    return call


def spec_fits(spec: QmvSpec) -> bool:
    """Geometry and formats this kernel computes exactly (the rest stays with the core)."""
    if spec.dtype not in CUDA_TYPES or spec.gate not in (None, "silu", "gelu_tanh"):
        return False
    if spec.k % 8 or spec.k * 2 > 40_000 or not 1 <= len(spec.rows) <= 3:
        return False
    if spec.gate is not None and (len(spec.rows) != 2 or spec.rows[0] != spec.rows[1]):
        return False
    if spec.residual and (len(spec.rows) != 1 or spec.gate is not None):
        return False
    cfg = spec.config
    if cfg.lanes not in (4, 8, 16, 32) or not 1 <= cfg.warps <= 32 or cfg.unroll < 1:
        return False
    if not 0 <= cfg.prefetch <= 16 or not 1 <= cfg.loop <= 8:
        return False
    if any(n % cfg.rows for n in spec.rows):
        return False
    if spec.bits is None:
        return spec.group_size is None
    if spec.bits not in (4, 8) or spec.group_size not in (32, 64, 128):
        return False
    values_per_chunk = 128 // spec.bits
    return spec.k % spec.group_size == 0 and spec.k % values_per_chunk == 0


# input values one block stages in static shared memory (40 KB as floats): the experts' staged
# rows, or the two inputs a chained launch's two calls stage together
MAX_ROWS_STAGED = 10240


def qmv_smem(spec: QmvSpec) -> int:
    """Bytes of the qmv device function's static shared memory: the input staged as floats with
    each chunk's sum (quantized weights up to MAX_ROWS_STAGED), else as T; the norm's
    per-warp partial sums."""
    size = spec.dtype.size
    chunks = spec.k // (8 if spec.bits is None else 128 // spec.bits)
    if spec.bits is not None and spec.k <= MAX_ROWS_STAGED:
        staged = 4 * spec.k + 8 * chunks + 8 * size
    else:
        staged = 16 + 8 + spec.k * size
    return staged + 4 * spec.config.warps


def staging(item: int, floats: int, sums: int, raw: int) -> int:
    """Bytes of a staged input in a caller's shared buffer (the header's StagingBytes): the
    floats, the chunk sums (float2), the raw values (`item` bytes each), each part 16-byte
    aligned."""
    return sum(-(-n // 16) * 16 for n in (4 * floats, 8 * sums, item * raw))


def staging_bytes(spec: QmvSpec) -> int:
    """Shared bytes the qmv call stages its input in (`ext`)."""
    floats = spec.bits is not None and spec.k <= MAX_ROWS_STAGED
    chunks = spec.k // (8 if spec.bits is None else 128 // spec.bits)
    return staging(spec.dtype.size, spec.k if floats else 4, chunks if floats else 1,
                   8 if floats else spec.k)


def blocks_of(spec: QmvSpec) -> int:
    """Blocks of spec's own launch."""
    cfg = spec.config
    rows_per_block = (32 // cfg.lanes) * cfg.rows * cfg.warps * cfg.loop
    return -(-spec.out_rows // rows_per_block)


def chain_wait(nb1: int) -> str:
    """The `wait` argument of a chained launch's second call: wait until the first phase's nb1
    blocks have published (chain_source's counters[1])."""
    return f"count + 1, {nb1}"


def chain_source(nb1: int, first: str, second: str, nb2: int) -> str:
    """The body of a chained launch (docs/kernels.md, "Chained launches"): blocks take tickets;
    the first nb1 run `first` and publish, the other nb2 run `second`, whose device call waits
    for them (chain_wait); the last to finish zeroes the counters."""
    assert chain_wait(nb1) in second, "the second phase must wait for the first"
    return render("qmv/chain.cu", NB1=nb1, FIRST=first, SECOND=second, LAST=nb2 - 1)


def chained_fits(project: QmvSpec, then: QmvSpec) -> bool:
    """A projection with its residual, then projections of its output, in one launch: each fits
    alone, with its own launch configuration, both with one block size and dtype, `then` reads
    the projection's rows, and both staged inputs fit one block's static shared memory."""
    return (
        spec_fits(project) and spec_fits(then)
        and project.residual and len(project.rows) == 1
        and project.norm_eps is None and project.gate is None
        and not then.residual
        and project.dtype == then.dtype
        and project.rows[0] == then.k
        and project.config.warps == then.config.warps
        and project.k + then.k <= MAX_ROWS_STAGED
    )


@cache
def chained_launcher(
    project: QmvSpec, then: QmvSpec, lead: tuple[int, ...]
) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """(a, the projection's weights..., residual, then's weights..., then's norm weight?,
    counters [3] int32 zeros) -> [h = residual + a @ P.T, then's outputs of h...], one chained
    launch (chain_source); the counters are left zero, and the caller owns them."""
    nb1, nb2 = blocks_of(project), blocks_of(then)
    pw = ("pw", "ps", "pb") if project.bits is not None else ("pw",)
    names = ("a", *pw, "res", *then.input_names()[1:], "counters")
    outs = tuple(f"t{o}" for o in then.outputs)
    source = chain_source(
        nb1,
        project.source(block="t", names={"x": "a", "w0": "pw", "s0": "ps", "b0": "pb",
                                         "y0": "h"}),
        then.source(block=f"t - {nb1}", coherent=True,
                    names={"x": "h", **{o: f"t{o}" for o in then.outputs}}, wait=chain_wait(nb1)),
        nb2,
    )
    kernel = cuda_kernel(f"omnia_chained__{project.name()}__{then.name()}", names,
                         ("h", *outs), source, QMV_HEADER)
    shapes = [(*lead, project.rows[0]), *((*lead, n) for n in then.output_rows)]
    cfg = project.config
    grid, threads = ((nb1 + nb2) * cfg.warps * 32, 1, 1), (cfg.warps * 32, 1, 1)

    def call(inputs: Sequence[mx.array]) -> list[mx.array]:
        out: Any = kernel(inputs=list(inputs), output_shapes=shapes,
                          output_dtypes=[project.dtype] * len(shapes), grid=grid,
                          threadgroup=threads)
        return list(out)

    return call


# -- a few rows at once (a batch's decode step): tensor-core tiles ----------------------------
MAX_ROWS = 16  # rows of x one launch takes (one m16n8k16 tile of rows)
ROWS_WARPS = 8  # a block's warps, which split the input's steps of 64 values
ROWS_HEADER = QMV_HEADER + header(render("qmv/qmv_rows.cuh"))


def rows_tiles(spec: QmvSpec) -> int:
    """Tiles of 8 weight rows a warp covers: the most (4, 2, 1; gated an even count, a gate and
    an up tile each) that still give every segment whole blocks and the launch ~2 blocks an SM
    of a 132-SM card."""
    gated = spec.gate is not None
    for tiles in (4, 2) if gated else (4, 2, 1):
        rows = 8 * (tiles // 2 if gated else tiles)
        if all(n % rows == 0 for n in spec.output_rows) and spec.out_rows // rows >= 256:
            return tiles
    fallback = [t for t in ((2,) if gated else (2, 1))
                if all(n % (8 * (t // 2 if gated else t)) == 0 for n in spec.output_rows)]
    return fallback[0] if fallback else 0


def rows_fits(spec: QmvSpec) -> bool:
    """What the rows kernel computes: 4-bit affine weights in groups of 64 or 128 in bfloat16 or
    float16, inputs a multiple of 64 wide, no norm (the caller normalizes first), segments in
    whole tiles."""
    return (
        spec.dtype in CUDA_TYPES and spec.bits == 4 and spec.group_size in (64, 128)
        and spec.k % 64 == 0 and spec.norm_eps is None
        and 1 <= len(spec.rows) <= 3
        and (spec.gate is None or (len(spec.rows) == 2 and spec.rows[0] == spec.rows[1]))
        and (not spec.residual or (len(spec.rows) == 1 and spec.gate is None))
        and rows_tiles(spec) > 0
    )


@cache
def rows_launcher(
    spec: QmvSpec, lead: tuple[int, ...]
) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """The rows kernel's call for x of shape (*lead, k), 2 to MAX_ROWS rows: inputs as
    spec.input_names() (no norm weight) -> outputs (*lead, n) each."""
    assert rows_fits(spec), spec
    tiles = rows_tiles(spec)
    n = list(spec.rows) + [0] * (3 - len(spec.rows))
    names = spec.input_names()
    present = set(names)

    def arg(name: str) -> str:
        return name if name in present else "nullptr"

    outs = [*spec.outputs, "nullptr", "nullptr"][:3]
    source = render(
        "qmv/qmv_rows_call.cu", T=CUDA_TYPES[spec.dtype], GROUP=spec.group_size or 0, K=spec.k,
        N0=n[0], N1=n[1], N2=n[2], NT=tiles, NWARPS=ROWS_WARPS,
        ACT={None: 0, "silu": 1, "gelu_tanh": 2}[spec.gate], RESID=flag(spec.residual),
        **{name: arg(name) for name in ("w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2", "b2")},
        res=arg("res"), y0=outs[0], y1=outs[1], y2=outs[2],
    )
    base = spec.name().replace("omnia_qmv_", "omnia_qmv_rows_", 1)
    kernel = cuda_kernel(f"{base}_t{tiles}w{ROWS_WARPS}", names, spec.outputs, source,
                         ROWS_HEADER)
    rows = 1
    for d in lead:
        rows *= d
    shapes = [(*lead, m) for m in spec.output_rows]
    dtypes = [spec.dtype] * len(shapes)
    out_tile = 8 * (tiles // 2 if spec.gate is not None else tiles)
    grid = (spec.out_rows // out_tile * ROWS_WARPS * 32, 1, 1)
    threads = (ROWS_WARPS * 32, 1, 1)

    def call(inputs: Sequence[mx.array]) -> list[mx.array]:
        flat = [reshape(inputs[0], rows, spec.k), *inputs[1:]]
        if spec.residual:
            flat[-1] = reshape(flat[-1], rows, spec.rows[0])
        out: Any = kernel(inputs=flat, output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                          threadgroup=threads)
        return list(out)

    return call
