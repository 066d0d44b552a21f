"""AttentionStep launches on MLX's CUDA backend: one new token's key/value appended to a static
cache in place, then grouped-query attention over every filled row, in one launch (device code
in attention_step.cuh; docs/kernels.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.cache import OFFSET_SLOTS
from mlx_omnia.engine.core.kernels import cuda_kernel, own_scratch
from mlx_omnia.engine.core.kernels.cuda_common import (
    CUDA_TYPES,
    HEADER,
    STATIC_SMEM,
    flag,
    header,
    render,
    trailing,
)
from mlx_omnia.engine.core.kernels.qmv.cuda import (
    QMV_HEADER,
    Launch,
    QmvSpec,
    blocks_of,
    chain_source,
    chain_wait,
    qmv_smem,
)
from mlx_omnia.engine.core.kernels.qmv.cuda import spec_fits as qmv_fits

MAX_SLICES = 640  # slices of a kv head at most (40,960 rows of 64): past that a slice walks chunks
MAX_HEAD_SPLIT = 2  # blocks a slice's query heads can be split over (counters per kv head)
THREADS = 128      # a block's threads (NT in the kernel)

ATTENTION_DEVICE = header(render("attention_step/attention_step.cuh", MAX_SLICES=MAX_SLICES,
                                 OFFSET_SLOTS=OFFSET_SLOTS))
ATTENTION_HEADER = HEADER + ATTENTION_DEVICE


def keys_per_block(capacity: int) -> int:
    """Rows per slice: 32 up to 2048 rows of capacity, then 64."""
    return 32 if capacity <= 2048 else 64


@dataclass(frozen=True)
class AttentionStepSpec:
    dtype: mx.Dtype
    n_heads: int
    n_kv_heads: int
    head_dim: int
    capacity: int            # cache rows; only the slice size it implies is baked in the source
    scale: float
    q_eps: float | None = None  # per-head RMS norm of the queries (weight input `qw`)
    k_eps: float | None = None
    traditional: bool = False   # rope pairs (2i, 2i+1) instead of (i, i + D/2)
    head_split: int = 1         # blocks a slice's query heads are split over (HS)

    @property
    def keys_per_block(self) -> int:
        return keys_per_block(self.capacity)

    @property
    def walks(self) -> bool:
        """Past MAX_SLICES chunks of rows a slice walks several (an online softmax)."""
        return self.capacity // self.keys_per_block > MAX_SLICES

    @property
    def slices(self) -> int:
        """Blocks of a kv head (and head split): a chunk of keys_per_block rows each, or
        MAX_SLICES walking every MAX_SLICES-th chunk."""
        return min(self.capacity // self.keys_per_block, MAX_SLICES)

    def tag(self) -> str:
        consts = hashlib.sha1(repr((self.scale, self.q_eps, self.k_eps)).encode()).hexdigest()[:8]
        return (
            f"{str(self.dtype).split('.')[-1]}_h{self.n_heads}_kv{self.n_kv_heads}"
            f"_d{self.head_dim}_s{self.keys_per_block}{'w' if self.walks else ''}"
            f"{'_trad' if self.traditional else ''}"
            f"{f'_hs{self.head_split}' if self.head_split != 1 else ''}_{consts}"
        )

    def input_names(self) -> tuple[str, ...]:
        names = ["q", "k_new", "v_new"]
        if self.q_eps is not None:
            names.append("qw")
        if self.k_eps is not None:
            names.append("kw")
        return (*names, "inv_freq", "k_cache", "v_cache", "pos", "counters")


def attention_call(spec: AttentionStepSpec, *, block: str = "blockIdx.x", coherent: bool = False,
                   wait: str | None = None, names: Mapping[str, str] | None = None) -> str:
    """The attention_step device call. `block`: this block's index among the attention's
    blocks; `coherent` / `wait`: q, k_new, v_new come from a chained launch's first phase
    (chain_wait); `names`: the launch's variable for an input or output where it differs."""
    qn, kn = spec.q_eps is not None, spec.k_eps is not None
    rename = dict(names or {})

    def n(name: str) -> str:
        return rename.get(name, name)

    return render(
        "attention_step/attention_call.cu", T=CUDA_TYPES[spec.dtype], H=spec.n_heads,
        HKV=spec.n_kv_heads, D=spec.head_dim, KPB=spec.keys_per_block, QN=flag(qn), KN=flag(kn),
        TRAD=flag(spec.traditional), WALK=flag(spec.walks), CG=flag(coherent),
        HS=trailing([str(spec.head_split)] if spec.head_split != 1 else []),
        **{name: n(name) for name in ("q", "k_new", "v_new", "inv_freq", "k_cache", "v_cache",
                                      "pos", "counters", "part_o", "part_ml", "out", "next_pos")},
        qw=n("qw") if qn else "nullptr", kw=n("kw") if kn else "nullptr",
        eps_q=f"{float(spec.q_eps or 0.0)!r}f", eps_k=f"{float(spec.k_eps or 0.0)!r}f",
        scale=f"{float(spec.scale)!r}f", block=block, more=trailing([wait] if wait else []),
    )


def output_shapes(spec: AttentionStepSpec, lead: tuple[int, ...]) -> list[tuple[int, ...]]:
    """out, next_pos. next_pos has the static cache offset's own shape (OFFSET_SLOTS copies): a
    reshape after the launch would be one more primitive per layer and token for MLX to
    dispatch. The slices' partial outputs live in the launch scratch (`partials_bytes`)."""
    return [(*lead, spec.n_heads * spec.head_dim), (OFFSET_SLOTS,)]


def output_dtypes(spec: AttentionStepSpec) -> list[mx.Dtype]:
    return [spec.dtype, mx.int32]


def partials_bytes(n_heads: int, head_dim: int) -> int:
    """Scratch bytes of the slices' partial outputs and (max, sum) pairs at any capacity (at
    most MAX_SLICES slices: the source does not depend on the capacity)."""
    return MAX_SLICES * n_heads * (head_dim + 2) * 4


def partials_ml(spec: AttentionStepSpec) -> int:
    """Where the slices' (max, sum) pairs start in the partials, in floats."""
    return MAX_SLICES * spec.n_heads * spec.head_dim


def blocks(spec: AttentionStepSpec) -> int:
    return spec.n_kv_heads * spec.head_split * spec.slices


@cache
def launcher(
    spec: AttentionStepSpec, lead: tuple[int, ...]
) -> Callable[..., tuple[mx.array, mx.array]]:
    """The launch for `spec`: inputs as `input_names` -> (attention output, next offset). The
    partial outputs go to the shared launch scratch (launch_scratch)."""
    source = render("attention_step/attention_step.cu", PART_ML=partials_ml(spec),
                    ATTENTION=attention_call(spec))
    kernel = cuda_kernel(f"omnia_attention_step_{spec.tag()}", (*spec.input_names(), "scratch"),
                         ("out", "next_pos"), source, ATTENTION_HEADER)
    shapes, dtypes = output_shapes(spec, lead), output_dtypes(spec)
    grid = (blocks(spec) * THREADS, 1, 1)
    own = own_scratch(partials_bytes(spec.n_heads, spec.head_dim))

    def call(inputs: list[mx.array], scratch: mx.array | None = None) -> tuple[mx.array, mx.array]:
        outs: Any = kernel(
            inputs=[*inputs, scratch if scratch is not None else own()], output_shapes=shapes,
            output_dtypes=dtypes, grid=grid, threadgroup=(THREADS, 1, 1),
        )
        return outs[0], outs[1]

    return call


def spec_fits(spec: AttentionStepSpec) -> bool:
    """Geometry this kernel computes: head_dim 32, 64 or 128 (a row is a power of two of 16-byte
    lane chunks), at most 8 query heads per kv head (shared memory), a capacity in whole chunks
    (any number of them)."""
    return (
        spec.dtype in CUDA_TYPES
        and spec.head_dim in (32, 64, 128)
        and spec.n_heads % spec.n_kv_heads == 0
        and spec.n_heads // spec.n_kv_heads <= 8
        and spec.head_split in range(1, MAX_HEAD_SPLIT + 1)
        and (spec.n_heads // spec.n_kv_heads) % spec.head_split == 0
        and spec.capacity % spec.keys_per_block == 0
    )


# -- q/k/v then attention, one launch -------------------------------------------------------
def attention_smem(spec: AttentionStepSpec) -> int:
    """Bytes of the attention device function's static shared memory (hs, p, stat, rescale,
    buf, last)."""
    g, d, kpb = spec.n_heads // spec.n_kv_heads // spec.head_split, spec.head_dim, spec.keys_per_block
    buf = max(THREADS // 32 * g * d, g * MAX_SLICES)
    return 4 * ((g + 1) * d + g * kpb + 3 * g + buf + 1)


def attend_qkv_spec(qkv: QmvSpec) -> QmvSpec:
    """The q/k/v projection as project_attend's first phase: the attention's THREADS / 32 warps,
    and two rows a lane group for quantized weights, so that both phases' blocks fit one wave
    (docs/kernels.md, "Measurement notes")."""
    cfg = qkv.config
    rows = cfg.rows
    if qkv.bits is not None and rows == 1 and all(n % 2 == 0 for n in qkv.rows):
        rows = 2
    return replace(qkv, launch=Launch(lanes=cfg.lanes, rows=rows, warps=THREADS // 32,
                                      unroll=cfg.unroll, prefetch=cfg.prefetch, loop=cfg.loop))


def project_attend_fits(qkv: QmvSpec, spec: AttentionStepSpec) -> bool:
    """q/k/v projections (three segments, no gate or residual) then the attention of them, in
    one launch: each fits alone, in one dtype, the segments are the attention's q, k and v
    widths, and the two phases' static shared memory fits one block."""
    first = attend_qkv_spec(qkv)
    h, kv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    return (
        qmv_fits(first) and spec_fits(spec)
        and qkv.rows == (h * d, kv * d, kv * d)
        and qkv.gate is None and not qkv.residual
        and qkv.dtype == spec.dtype
        and qmv_smem(first) + attention_smem(spec) + 256 <= STATIC_SMEM
    )


def project_attend_qkv_bytes(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Scratch bytes before the partials: q, k and v (at most 4 bytes a value, 16-byte
    aligned)."""
    return -(-(n_heads + 2 * n_kv_heads) * head_dim * 4 // 16) * 16


def project_attend_scratch_bytes(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Scratch bytes of project_attend at any capacity: q, k, v and the partials."""
    return (project_attend_qkv_bytes(n_heads, n_kv_heads, head_dim)
            + partials_bytes(n_heads, head_dim))


@cache
def project_attend_launcher(
    qkv: QmvSpec, spec: AttentionStepSpec, lead: tuple[int, ...]
) -> Callable[..., tuple[mx.array, mx.array]]:
    """(x, q/k/v weights..., norm weight?, qw?, kw?, inv_freq, k_cache, v_cache, pos, heads,
    counters [3]) -> (attention output, next offset): q/k/v into the launch scratch, then the
    attention of them, one chained launch; both counter arrays are left zero (the caller's)."""
    first = attend_qkv_spec(qkv)
    nb1, nb2 = blocks_of(first), blocks(spec)
    qkv_inputs = first.input_names()[1:]
    att_inputs = [n for n in spec.input_names() if n not in ("q", "k_new", "v_new", "counters")]
    names = ("x", *qkv_inputs, *att_inputs, "heads", "counters", "scratch")
    h, kv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    source = render(
        "attention_step/project_attend.cu", T=CUDA_TYPES[spec.dtype], K_AT=h * d, V_AT=kv * d,
        PART_O=project_attend_qkv_bytes(h, kv, d) // 4, PART_ML=partials_ml(spec),
        CHAIN=chain_source(
            nb1,
            first.source(block="t", names={"y0": "q", "y1": "k", "y2": "v"}),
            attention_call(spec, block=f"t - {nb1}", coherent=True, wait=chain_wait(nb1),
                           names={"k_new": "k", "v_new": "v", "counters": "heads"}),
            nb2,
        ),
    )
    kernel = cuda_kernel(f"omnia_project_attend__{first.name()}__{spec.tag()}", names,
                         ("out", "next_pos"), source, QMV_HEADER + ATTENTION_DEVICE)
    shapes, dtypes = output_shapes(spec, lead), output_dtypes(spec)
    grid = ((nb1 + nb2) * THREADS, 1, 1)
    own = own_scratch(project_attend_scratch_bytes(spec.n_heads, spec.n_kv_heads, spec.head_dim))

    def call(inputs: list[mx.array], scratch: mx.array | None = None) -> tuple[mx.array, mx.array]:
        outs: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                           output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                           threadgroup=(THREADS, 1, 1))
        return outs[0], outs[1]

    return call


# -- a batch's rows: each its own sequence, offset and cache row ------------------------------
MAX_BATCH_ROWS = 64  # rows one launch takes (the counters are per row, kv head and head split)


def rows_partials(spec: AttentionStepSpec, rows: int) -> int:
    """float32 words of the partial outputs and (max, sum) pairs of `rows` rows at spec's
    capacity (an output of the launch: its size follows the capacity)."""
    return rows * spec.slices * spec.n_heads * (spec.head_dim + 2)


@cache
def rows_launcher(
    spec: AttentionStepSpec, rows: int
) -> Callable[[list[mx.array]], mx.array]:
    """The launch for a batch's `rows` sequences, one new token each: inputs as `input_names`
    with q [rows, 1, H*D], k/v [rows, 1, Hkv*D], caches [rows, Hkv, capacity, D] and pos the rows'
    offsets [rows] -> the attention output [rows, 1, H*D]. Every row is the single-row kernel's
    launch at its own offset (the same arithmetic); the caches are written in place and no next
    offset is written (BatchRows keeps the offsets)."""
    qn, kn = spec.q_eps is not None, spec.k_eps is not None
    source = render(
        "attention_step/attention_rows.cu", T=CUDA_TYPES[spec.dtype], H=spec.n_heads,
        HKV=spec.n_kv_heads, D=spec.head_dim, KPB=spec.keys_per_block, QN=flag(qn), KN=flag(kn),
        TRAD=flag(spec.traditional), WALK=flag(spec.walks), HSN=spec.head_split,
        MAXHS=MAX_HEAD_SPLIT, MAX_SLICES=MAX_SLICES,
        HS=trailing([str(spec.head_split)] if spec.head_split != 1 else []),
        k_cache="k_cache", qw="qw" if qn else "nullptr", kw="kw" if kn else "nullptr",
        eps_q=f"{float(spec.q_eps or 0.0)!r}f", eps_k=f"{float(spec.k_eps or 0.0)!r}f",
        scale=f"{float(spec.scale)!r}f",
    )
    kernel = cuda_kernel(f"omnia_attention_rows_{spec.tag()}", spec.input_names(),
                         ("out", "partials"), source, ATTENTION_HEADER)
    shapes = [(rows, 1, spec.n_heads * spec.head_dim), (rows_partials(spec, rows),)]
    dtypes = [spec.dtype, mx.float32]
    grid = (rows * blocks(spec) * THREADS, 1, 1)

    def call(inputs: list[mx.array]) -> mx.array:
        outs: Any = kernel(inputs=inputs, output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                           threadgroup=(THREADS, 1, 1))
        return outs[0]

    return call


# -- a quantized cache: attention reading the codes -------------------------------------------
CODES_DEVICE = header(render("attention_step/attention_codes.cuh", MAX_SLICES=MAX_SLICES))
CODES_HEADER = HEADER + CODES_DEVICE
CODES_BITS = (4, 8)


@dataclass(frozen=True)
class CodesSpec:
    """Decode attention over an affine-quantized cache (KVFormat: `bits`, `group_size`)."""

    dtype: mx.Dtype
    n_heads: int
    n_kv_heads: int
    head_dim: int
    capacity: int
    scale: float
    bits: int
    group_size: int
    head_split: int = 1

    @property
    def lanes(self) -> int:
        """Lanes of a row: one 16-byte word of codes (128 / bits dimensions) each."""
        return self.head_dim * self.bits // 128

    @property
    def keys_per_block(self) -> int:
        """Rows a chunk: keys_per_block(capacity), at least a block's rows at once."""
        return max(keys_per_block(self.capacity), THREADS // max(self.lanes, 1))

    @property
    def walks(self) -> bool:
        return self.capacity // self.keys_per_block > MAX_SLICES

    @property
    def slices(self) -> int:
        return min(self.capacity // self.keys_per_block, MAX_SLICES)

    def tag(self) -> str:
        consts = hashlib.sha1(repr(self.scale).encode()).hexdigest()[:8]
        return (
            f"{str(self.dtype).split('.')[-1]}_h{self.n_heads}_kv{self.n_kv_heads}"
            f"_d{self.head_dim}_q{self.bits}g{self.group_size}_s{self.keys_per_block}"
            f"{'w' if self.walks else ''}_hs{self.head_split}_{consts}"
        )


def codes_fits(spec: CodesSpec) -> bool:
    """What attention_codes computes: 8 or 4 bits, a lane's 128 / bits dimensions inside one
    group, head_dim 64 or 128 (1 to 8 lanes a row), at most 8 query heads per kv head, a
    capacity in whole chunks."""
    lane_dims = 128 // spec.bits if spec.bits in CODES_BITS else 0
    return (
        spec.dtype in CUDA_TYPES
        and spec.bits in CODES_BITS
        and spec.head_dim in (64, 128)
        and spec.group_size % lane_dims == 0
        and spec.head_dim % spec.group_size == 0
        and spec.n_heads % spec.n_kv_heads == 0
        and spec.n_heads // spec.n_kv_heads <= 8
        and spec.head_split in range(1, MAX_HEAD_SPLIT + 1)
        and (spec.n_heads // spec.n_kv_heads) % spec.head_split == 0
        and spec.capacity % spec.keys_per_block == 0
    )


@cache
def codes_launcher(spec: CodesSpec) -> Callable[..., mx.array]:
    """(q [1, 1, H*D] after norms and rope, keys' codes, scales, biases, values' codes, scales,
    biases [1, Hkv, capacity, *], the filled rows' count [OFFSET_SLOTS], counters, scratch)
    -> the attention output [1, 1, H*D]; the partials go to the scratch."""
    source = render(
        "attention_step/attention_codes.cu", T=CUDA_TYPES[spec.dtype], H=spec.n_heads,
        HKV=spec.n_kv_heads, D=spec.head_dim, BITS=spec.bits, GS=spec.group_size,
        KPB=spec.keys_per_block, WALK=flag(spec.walks), HS=spec.head_split,
        PART_ML=MAX_SLICES * spec.n_heads * spec.head_dim, scale=f"{float(spec.scale)!r}f",
    )
    names = ("q", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", "pos",
             "counters", "scratch")
    kernel = cuda_kernel(f"omnia_attention_codes_{spec.tag()}", names, ("out",), source,
                         CODES_HEADER)
    shape = (1, 1, spec.n_heads * spec.head_dim)
    grid = (spec.n_kv_heads * spec.head_split * spec.slices * THREADS, 1, 1)

    def call(inputs: list[mx.array], scratch: mx.array) -> mx.array:
        outs: Any = kernel(inputs=[*inputs, scratch], output_shapes=[shape],
                           output_dtypes=[spec.dtype], grid=grid, threadgroup=(THREADS, 1, 1))
        return outs[0]

    return call
