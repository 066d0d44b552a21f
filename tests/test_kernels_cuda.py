"""Every CUDA kernel against its core module, on fresh random inputs over many shapes.

Marked `cuda`: deselected by default, run on the H200 with `pytest -m cuda` (MLX's CUDA build).
Tolerances: outputs are bf16/fp16, so the kernel and the core differ by the rounding of
differently ordered float32 sums (a few units in the last place of the largest output)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.core.cache import (
    PARTS,
    BatchRows,
    KVCache,
    KVFormat,
    StaticKVCache,
    StaticQuantizedKVCache,
)
from mlx_omnia.engine.core.kernels import cuda_backend
from mlx_omnia.engine.core.kernels.qmv import linear_spec, projections_spec
from mlx_omnia.engine.core.kernels.qmv.cuda import CANDIDATES, Launch, launcher
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    ChainedProjections,
    Embedding,
    Gate,
    Linear,
    ProjectAttend,
    Projections,
    RmsNorm,
    Rope,
)
from mlx_omnia.engine.core.moe import DownCombine, GateUp, ProjectRoute, Route, RouteOrder

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_backend(), reason="needs MLX's CUDA backend"),
]

FORMATS = [(None, None), (4, 32), (4, 64), (4, 128), (8, 64)]
ULP = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}


def rel_err(got: mx.array, want: mx.array) -> float:
    g = np.array(got.astype(mx.float32))
    w = np.array(want.astype(mx.float32))
    assert np.isfinite(g).all(), "kernel wrote a non-finite value"
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-6))


def make_linear(k: int, n: int, fmt: tuple[int | None, int | None], dtype: mx.Dtype) -> Linear:
    lin = Linear(k, n)
    lin.weight = (mx.random.normal((n, k)) * 0.05).astype(dtype)
    bits, group = fmt
    if bits is not None and group is not None:
        lin.quantize_weights(bits=bits, group_size=group)
    lin.bind(force_reference=True)  # the matrix's own call follows its final format
    return lin


def make_norm(dims: int, dtype: mx.Dtype, eps: float = 1e-6) -> RmsNorm:
    n = RmsNorm(dims, eps)
    n.weight = (1.0 + 0.2 * mx.random.normal((dims,))).astype(dtype)
    return n


SHAPES = [(256, 512), (576, 1536), (2560, 4096), (9728, 2560)]
LINEAR_CASES = [
    (k, n, f, d)
    for (k, n), f, d in [
        *itertools.product(SHAPES, FORMATS, [mx.bfloat16]),
        *itertools.product(SHAPES[:3], [(None, None), (4, 64)], [mx.float16]),
    ]
    if f[1] is None or k % f[1] == 0
]


@pytest.mark.parametrize(("k", "n", "fmt", "dtype"), LINEAR_CASES)
def test_qmv_linear_matches_core(k: int, n: int, fmt: tuple[int | None, int | None],
                                 dtype: mx.Dtype) -> None:
    lin = make_linear(k, n, fmt, dtype)
    assert lin.bind() == "qmv_cuda"
    core = lin.reference()
    for _ in range(2):
        x = mx.random.normal((1, 1, k)).astype(dtype)
        res = mx.random.normal((1, 1, n)).astype(dtype)
        assert rel_err(lin(x), core(x)) <= 4 * ULP[dtype]
        assert rel_err(lin(x, residual=res), core(x, res)) <= 4 * ULP[dtype]
    x = mx.random.normal((1, 5, k)).astype(dtype)  # several rows: the rows kernel, or the core
    if fmt[0] == 4 and fmt[1] in (64, 128):
        assert rel_err(lin(x), core(x)) <= 4 * ULP[dtype]
    else:
        assert rel_err(lin(x), core(x)) == 0.0


@pytest.mark.parametrize("launch", CANDIDATES, ids=str)
@pytest.mark.parametrize("fmt", [(None, None), (4, 64), (8, 32)])
def test_qmv_every_launch_candidate_matches_core(launch: Launch,
                                                 fmt: tuple[int | None, int | None]) -> None:
    """Gated (gate/up after a norm) and residual launches of each candidate configuration."""
    dtype = mx.bfloat16
    mats = [make_linear(1024, 2816, fmt, dtype) for _ in range(2)]
    proj = Projections(mats, norm=make_norm(1024, dtype, 1e-5), gate="silu")
    spec = projections_spec(proj)
    assert spec is not None
    x = (3 * mx.random.normal((1, 1, 1024))).astype(dtype)
    weights = [a for m in mats for a in ([m.weight] if m.bits is None else
                                         [m.weight, m.scales, m.biases])]
    run = launcher(replace(spec, launch=launch), (1, 1))
    (got,) = run([x, *weights, proj.norm.weight])  # type: ignore[union-attr]
    (want,) = proj.reference()(x)
    assert rel_err(got, want) <= 8 * ULP[dtype]
    # 1000 rows: the last block of most launches is partly past the end (a set of rows, with
    # Launch.loop, wholly past it)
    down = make_linear(2816, 1000, fmt, dtype)
    lin_spec = linear_spec(down, residual=True)
    assert lin_spec is not None
    h = mx.random.normal((1, 1, 2816)).astype(dtype)
    res = mx.random.normal((1, 1, 1000)).astype(dtype)
    inputs = [h, *([down.weight] if down.bits is None else [down.weight, down.scales, down.biases]), res]
    (got,) = launcher(replace(lin_spec, launch=launch), (1, 1))(inputs)
    assert rel_err(got, down.reference()(h, res)) <= 4 * ULP[dtype]


def make_projections(case: str, k: int, fmt: tuple[int | None, int | None],
                     dtype: mx.Dtype) -> Projections:
    """q/k/v after a norm ("qkv"), a gated pair after a norm ("silu", "gelu_tanh"), or two plain
    projections ("plain pair") of k inputs."""
    if case == "qkv":
        mats = [make_linear(k, n, fmt, dtype) for n in (2048, 512, 512)]
        return Projections(mats, norm=make_norm(k, dtype))
    if case == "plain pair":
        return Projections([make_linear(k, 768, fmt, dtype) for _ in range(2)])
    mats = [make_linear(k, 2816, fmt, dtype) for _ in range(2)]
    return Projections(mats, norm=make_norm(k, dtype, 1e-5), gate=case)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fmt", "dtype"), [(f, mx.bfloat16) for f in FORMATS] + [((4, 64), mx.float16)]
)
@pytest.mark.parametrize("case", ["qkv", "silu", "gelu_tanh", "plain pair"])
def test_qmv_projections_match_core(case: str, fmt: tuple[int | None, int | None],
                                    dtype: mx.Dtype) -> None:
    k = 1024
    proj = make_projections(case, k, fmt, dtype)
    for m in proj.matrices:  # as loading does: every declaration bound once formats are final
        m.bind(force_reference=True)
    assert proj.bind() == "qmv_cuda"
    core = proj.reference()
    tolerance = (8 if case in ("silu", "gelu_tanh") else 4) * ULP[dtype]
    for _ in range(3):
        x = (3 * mx.random.normal((1, 1, k))).astype(dtype)
        got, want = proj(x), core(x)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert rel_err(g, w) <= tolerance


@pytest.mark.parametrize("bits", [None, 4])
def test_qmv_tied_head_matches_core(bits: int | None) -> None:
    table = Embedding(8192, 512)
    table.weight = (mx.random.normal((8192, 512)) * 0.05).astype(mx.bfloat16)
    if bits is not None:
        table.quantize_weights(bits=bits, group_size=64)
    head = Projections([table], norm=make_norm(512, mx.bfloat16))
    table.bind(force_reference=True)
    assert head.bind() == "qmv_cuda"
    x = mx.random.normal((1, 1, 512)).astype(mx.bfloat16)
    assert rel_err(head(x)[0], head.reference()(x)[0]) <= 4 * ULP[mx.bfloat16]


ROWS_FORMATS = [((4, 64), mx.bfloat16), ((4, 128), mx.bfloat16), ((4, 64), mx.float16)]


@pytest.mark.parametrize(("fmt", "dtype"), ROWS_FORMATS)
@pytest.mark.parametrize(("k", "n"), [(2560, 4096), (9728, 2560), (1024, 768), (4096, 151936)])
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_qmv_rows_linear_matches_core(rows: int, k: int, n: int,
                                      fmt: tuple[int, int], dtype: mx.Dtype) -> None:
    """2 to 16 rows of x (a batch's decode step) on tensor cores, with and without the residual;
    17 rows go to the core."""
    lin = make_linear(k, n, fmt, dtype)
    assert lin.bind() == "qmv_cuda"
    core = lin.reference()
    x = (2 * mx.random.normal((rows, 1, k))).astype(dtype)
    res = mx.random.normal((rows, 1, n)).astype(dtype)
    got = lin(x)
    assert got.shape == (rows, 1, n)
    assert rel_err(got, core(x)) <= 4 * ULP[dtype]
    assert rel_err(lin(x, residual=res), core(x, res)) <= 4 * ULP[dtype]
    # each row is its own: a row alone (the qmv kernel) gives the same within rounding
    assert rel_err(got[1:2], lin(x[1:2])) <= 4 * ULP[dtype]
    x17 = mx.random.normal((17, 1, k)).astype(dtype)
    assert rel_err(lin(x17), core(x17)) == 0.0


@pytest.mark.parametrize(("fmt", "dtype"), ROWS_FORMATS)
@pytest.mark.parametrize("case", ["qkv", "silu", "gelu_tanh", "plain pair"])
@pytest.mark.parametrize("rows", [3, 16])
def test_qmv_rows_projections_match_core(rows: int, case: str, fmt: tuple[int, int],
                                         dtype: mx.Dtype) -> None:
    """q/k/v after a norm, gated pairs, a plain pair, for a batch's rows."""
    k = 1024
    proj = make_projections(case, k, fmt, dtype)
    for m in proj.matrices:
        m.bind(force_reference=True)
    assert proj.bind() == "qmv_cuda"
    tolerance = (8 if case in ("silu", "gelu_tanh") else 4) * ULP[dtype]
    x = (3 * mx.random.normal((rows, 1, k))).astype(dtype)
    got, want = proj(x), proj.reference()(x)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (rows, 1, w.shape[-1])
        assert rel_err(g, w) <= tolerance


ATTENTION_CASES = {
    "qwen3": dict(n_heads=32, n_kv_heads=8, head_dim=128, norms=True, rope=dict(base=1e6)),
    "llama": dict(n_heads=32, n_kv_heads=8, head_dim=64, norms=False, rope=dict(base=5e5)),
    "mha": dict(n_heads=8, n_kv_heads=8, head_dim=128, norms=False, rope=dict(base=1e4)),
    "gqa8 traditional": dict(n_heads=16, n_kv_heads=2, head_dim=64, norms=True,
                             rope=dict(base=1e4, traditional=True)),
    "head 32": dict(n_heads=8, n_kv_heads=4, head_dim=32, norms=True, rope=dict(base=1e4)),
    "scaled freqs": dict(n_heads=16, n_kv_heads=4, head_dim=128, norms=False,
                         rope=dict(base=1e4, scale=0.25)),
}


def prefilled_cache(core: Any, prefix: int, heads: int, kv_heads: int, d: int,
                    dtype: mx.Dtype) -> StaticKVCache:
    """A static cache holding `prefix` random rows, written by the core attention (seeded by
    `prefix`: two calls give equal caches)."""
    cache = KVCache()
    mx.random.seed(prefix)
    q = mx.random.normal((1, prefix, heads * d)).astype(dtype)
    k = mx.random.normal((1, prefix, kv_heads * d)).astype(dtype)
    v = mx.random.normal((1, prefix, kv_heads * d)).astype(dtype)
    mx.eval(core(q, k, v, cache), cache.state())
    return StaticKVCache.from_cache(cache)


def step_inputs(caches: tuple[StaticKVCache, ...], rows: int, heads: int, kv_heads: int, d: int,
                dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """One decode step's q, k, v, the caches reserved for `rows` rows."""
    for cache in caches:
        cache.reserve(rows)
    q = (2 * mx.random.normal((1, 1, heads * d))).astype(dtype)
    k = (2 * mx.random.normal((1, 1, kv_heads * d))).astype(dtype)
    v = mx.random.normal((1, 1, kv_heads * d)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
@pytest.mark.parametrize("prefix", [1, 64, 700, 2300])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_attention_step_matches_core(case: str, prefix: int, dtype: mx.Dtype) -> None:
    c = ATTENTION_CASES[case]
    h, hkv, d = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    rope = Rope(d, **c["rope"])  # type: ignore[arg-type]
    qn = make_norm(d, dtype) if c["norms"] else None
    kn = make_norm(d, dtype) if c["norms"] else None
    att = AttentionStep(n_heads=h, n_kv_heads=hkv, head_dim=d, q_norm=qn, k_norm=kn, rope=rope)
    assert att.bind() == "attention_step_cuda"
    core = att.reference()

    def prefilled() -> StaticKVCache:
        return prefilled_cache(core, prefix, h, hkv, d, dtype)

    mine, theirs = prefilled(), prefilled()
    for step in range(3):
        q, k, v = step_inputs((mine, theirs), prefix + step + 1, h, hkv, d, dtype)
        got = att(q, k, v, mine)
        want = core(q, k, v, theirs)
        mx.eval(got, want, mine.arrays(), theirs.arrays())
        assert got.shape == want.shape == (1, 1, h * d)
        assert rel_err(got, want) <= 8 * ULP[dtype]
        assert int(mine.offset.item()) == int(theirs.offset.item()) == prefix + step + 1
        n = prefix + step + 1
        assert rel_err(mine.state["keys"][..., :n, :], theirs.state["keys"][..., :n, :]) <= 2 * ULP[dtype]
        assert rel_err(mine.state["values"][..., :n, :], theirs.state["values"][..., :n, :]) == 0.0


@contextmanager
def heads_in_one_block(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Attention launches built meanwhile run a slice's query heads in one block (head_split 1,
    the geometry before the split became the default)."""
    from dataclasses import replace as with_field

    from mlx_omnia.engine.core.kernels import attention_step

    plain = attention_step.attention_spec
    monkeypatch.setattr(attention_step, "attention_spec",
                        lambda *a: with_field(plain(*a), head_split=1))
    try:
        yield
    finally:
        monkeypatch.setattr(attention_step, "attention_spec", plain)


def two_caches(core: Any, prefix: int, heads: int, kv_heads: int, d: int,
               dtype: mx.Dtype) -> tuple[StaticKVCache, StaticKVCache]:
    mine, theirs = (prefilled_cache(core, prefix, heads, kv_heads, d, dtype) for _ in range(2))
    return mine, theirs


def assert_same_caches(mine: StaticKVCache, theirs: StaticKVCache, step: int) -> None:
    for name in ("keys", "values", "offset"):
        assert mx.array_equal(mine.state[name], theirs.state[name]), (step, name)


@pytest.mark.parametrize("case", ["qwen3", "gqa8 traditional", "scaled freqs"])
@pytest.mark.parametrize("prefix", [1, 700, 2300])
def test_attention_head_split_gives_the_same_bits(
    case: str, prefix: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The query heads of a slice split over two blocks (head_split 2, the default where the
    group is even: their own partials, counters and merges) write exactly what one block a
    slice writes, output, cache and offset, step after step."""
    from mlx_omnia.engine.core.kernels.attention_step import attention_spec

    c = ATTENTION_CASES[case]
    h, hkv, d = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    dtype = mx.bfloat16

    def decl() -> AttentionStep:
        mx.random.seed(5)
        norms = c["norms"]
        return AttentionStep(n_heads=h, n_kv_heads=hkv, head_dim=d,
                             q_norm=make_norm(d, dtype) if norms else None,
                             k_norm=make_norm(d, dtype) if norms else None,
                             rope=Rope(d, **c["rope"]))  # type: ignore[arg-type]

    one, two = decl(), decl()
    assert one.bind() == two.bind() == "attention_step_cuda"
    assert attention_spec(two, dtype, StaticKVCache.step).head_split == 2
    mine, theirs = two_caches(one.reference(), prefix, h, hkv, d, dtype)
    for step in range(3):
        q, k, v = step_inputs((mine, theirs), prefix + step + 1, h, hkv, d, dtype)
        got = two(q, k, v, mine)
        with heads_in_one_block(monkeypatch):
            want = one(q, k, v, theirs)
            mx.eval(got, want, mine.arrays(), theirs.arrays())
        assert rel_err(got, want) == 0.0, step
        assert_same_caches(mine, theirs, step)


def _padded_rows(a: mx.array, capacity: int) -> mx.array:
    extra = capacity - a.shape[2]
    return mx.concatenate([a, mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)], axis=2)


@pytest.mark.parametrize("case", ["qwen3", "llama", "gqa8 traditional"])
@pytest.mark.parametrize("prefixes", [(1, 64), (700, 5, 2300, 31), tuple(range(1, 17))],
                         ids=["two", "four long", "sixteen"])
def test_attention_rows_give_each_rows_own_bits(case: str, prefixes: tuple[int, ...]) -> None:
    """A batch's rows (BatchRows: one cache row and offset a sequence) in one launch: each row
    writes exactly what the single-row launch writes at its offset (output and cache), and the
    whole agrees with the core's batch attention (put_along_axis, masked attention)."""
    c = ATTENTION_CASES[case]
    h, hkv, d = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    dtype = mx.bfloat16
    norms = c["norms"]
    att = AttentionStep(n_heads=h, n_kv_heads=hkv, head_dim=d,
                        q_norm=make_norm(d, dtype) if norms else None,
                        k_norm=make_norm(d, dtype) if norms else None,
                        rope=Rope(d, **c["rope"]))  # type: ignore[arg-type]
    assert att.bind() == "attention_step_cuda"
    core = att.reference()
    rows, steps = len(prefixes), 3
    capacity = -(-(max(prefixes) + steps) // 256) * 256
    filled = [prefilled_cache(core, p, h, hkv, d, dtype) for p in prefixes]
    keys = mx.concatenate([_padded_rows(f.state["keys"][..., :p, :], capacity)
                           for f, p in zip(filled, prefixes, strict=True)])
    values = mx.concatenate([_padded_rows(f.state["values"][..., :p, :], capacity)
                             for f, p in zip(filled, prefixes, strict=True)])
    singles = [StaticKVCache(mx.array(keys[b : b + 1]), mx.array(values[b : b + 1]), p)
               for b, p in enumerate(prefixes)]
    ref_keys, ref_values = mx.array(keys), mx.array(values)
    offsets = mx.array(prefixes, dtype=mx.int32)
    mx.eval(keys, values, ref_keys, ref_values, *(a for s in singles for a in s.arrays()))
    for step in range(steps):
        q = (2 * mx.random.normal((rows, 1, h * d))).astype(dtype)
        k = (2 * mx.random.normal((rows, 1, hkv * d))).astype(dtype)
        v = mx.random.normal((rows, 1, hkv * d)).astype(dtype)
        mine = BatchRows(keys, values, offsets)
        theirs = BatchRows(ref_keys, ref_values, offsets)
        got = att(q, k, v, mine)
        want = core(q, k, v, theirs)
        mx.eval(got, want, theirs.keys, theirs.values)
        # one evaluation each: launches of one binding share its counters and partials, and MLX
        # may run launches with no data between them at once (decode never does: each layer's
        # input is the last one's output)
        alone = []
        for b in range(rows):
            alone.append(att(q[b : b + 1], k[b : b + 1], v[b : b + 1], singles[b]))
            mx.eval(alone[-1], singles[b].arrays())
        assert got.shape == want.shape == (rows, 1, h * d)
        assert rel_err(got, want) <= 8 * ULP[dtype], step
        assert mine.keys is keys and mine.values is values  # written in place
        assert mx.array_equal(mine.offset, offsets + 1)
        for b, p in enumerate(prefixes):
            n = p + step + 1
            assert mx.array_equal(got[b : b + 1], alone[b]), (step, b)
            assert mx.array_equal(keys[b : b + 1, :, :n], singles[b].state["keys"][..., :n, :])
            assert mx.array_equal(values[b : b + 1, :, :n], singles[b].state["values"][..., :n, :])
        n_all = [p + step + 1 for p in prefixes]
        for b, n in enumerate(n_all):
            assert rel_err(keys[b : b + 1, :, :n], theirs.keys[b : b + 1, :, :n]) <= 2 * ULP[dtype]
            assert rel_err(values[b : b + 1, :, :n], theirs.values[b : b + 1, :, :n]) == 0.0
        ref_keys, ref_values = theirs.keys, theirs.values
        offsets = offsets + 1


def random_cache(prefix: int, kv_heads: int, d: int, dtype: mx.Dtype, seed: int) -> StaticKVCache:
    """A static cache of `prefix` random rows (a long cache without a long prefill: the core's
    attention over 64k queries would not fit), capacity rounded up to 256 rows."""
    mx.random.seed(seed)
    capacity = -(-prefix // 256) * 256
    keys = mx.random.normal((1, kv_heads, capacity, d)).astype(dtype)
    values = mx.random.normal((1, kv_heads, capacity, d)).astype(dtype)
    mx.eval(keys, values)
    return StaticKVCache(keys, values, prefix)


@pytest.mark.parametrize("case", ["qwen3", "gqa8 traditional", "head 32", "scaled freqs"])
@pytest.mark.parametrize("prefix", [1, 2048, 16384, 40959, 65536])
def test_attention_step_long_cache_matches_core(case: str, prefix: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_SLICES chunks of rows a slice walks several with an online softmax (`walks`):
    element-wise against the core attention at 1 to 64k rows, step after step (a step past a
    chunk's end moves to the next slice, past MAX_SLICES chunks to a walked one); the head
    split writes the same bits as one block a slice there too."""
    from mlx_omnia.engine.core.kernels.attention_step import attention_spec
    from mlx_omnia.engine.core.kernels.attention_step.cuda import MAX_SLICES

    c = ATTENTION_CASES[case]
    h, hkv, d = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    dtype = mx.bfloat16

    def decl() -> AttentionStep:
        mx.random.seed(9)
        norms = c["norms"]
        return AttentionStep(n_heads=h, n_kv_heads=hkv, head_dim=d,
                             q_norm=make_norm(d, dtype) if norms else None,
                             k_norm=make_norm(d, dtype) if norms else None,
                             rope=Rope(d, **c["rope"]))  # type: ignore[arg-type]

    att, one = decl(), decl()
    assert att.bind() == one.bind() == "attention_step_cuda"
    core = att.reference()
    mine, theirs, single = (random_cache(prefix, hkv, d, dtype, prefix) for _ in range(3))
    for step in range(3):
        q, k, v = step_inputs((mine, theirs, single), prefix + step + 1, h, hkv, d, dtype)
        spec = attention_spec(att, dtype, mine.capacity)
        assert spec.walks == (mine.capacity // spec.keys_per_block > MAX_SLICES)
        got = att(q, k, v, mine)
        want = core(q, k, v, theirs)
        mx.eval(got, want, mine.arrays(), theirs.arrays())
        with heads_in_one_block(monkeypatch):
            alone = one(q, k, v, single)
            mx.eval(alone, single.arrays())
        assert rel_err(got, want) <= 8 * ULP[dtype], (step, spec.tag())
        assert mx.array_equal(got, alone), (step, spec.tag())
        n = prefix + step + 1
        assert int(mine.offset.item()) == n
        assert rel_err(mine.state["keys"][..., :n, :], theirs.state["keys"][..., :n, :]) <= 2 * ULP[dtype]
        assert rel_err(mine.state["values"][..., :n, :], theirs.state["values"][..., :n, :]) == 0.0
        assert_same_caches(mine, single, step)
    if prefix > 41000:
        assert attention_spec(att, dtype, mine.capacity).walks


@pytest.mark.parametrize("case", ["qwen3", "gqa8 traditional"])
def test_attention_rows_long_caches_give_each_rows_own_bits(case: str) -> None:
    """A batch's rows whose capacity walks (past MAX_SLICES chunks), short and long rows
    together: each row writes exactly the single-row launch's bits at its offset, and the whole
    agrees with the core's batch attention."""
    from mlx_omnia.engine.core.kernels.attention_step import attention_spec

    c = ATTENTION_CASES[case]
    h, hkv, d = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    dtype = mx.bfloat16
    norms = c["norms"]
    att = AttentionStep(n_heads=h, n_kv_heads=hkv, head_dim=d,
                        q_norm=make_norm(d, dtype) if norms else None,
                        k_norm=make_norm(d, dtype) if norms else None,
                        rope=Rope(d, **c["rope"]))  # type: ignore[arg-type]
    assert att.bind() == "attention_step_cuda"
    core = att.reference()
    prefixes = (5, 41000, 45000, 20000)
    capacity = 45056
    filled = [random_cache(p, hkv, d, dtype, p) for p in prefixes]
    keys = mx.concatenate([_padded_rows(f.state["keys"], capacity) for f in filled])
    values = mx.concatenate([_padded_rows(f.state["values"], capacity) for f in filled])
    assert attention_spec(att, dtype, capacity).walks
    singles = [StaticKVCache(mx.array(keys[b : b + 1]), mx.array(values[b : b + 1]), p)
               for b, p in enumerate(prefixes)]
    ref_keys, ref_values = mx.array(keys), mx.array(values)
    offsets = mx.array(prefixes, dtype=mx.int32)
    mx.eval(keys, values, ref_keys, ref_values, *(a for s in singles for a in s.arrays()))
    rows = len(prefixes)
    for step in range(2):
        q = (2 * mx.random.normal((rows, 1, h * d))).astype(dtype)
        k = (2 * mx.random.normal((rows, 1, hkv * d))).astype(dtype)
        v = mx.random.normal((rows, 1, hkv * d)).astype(dtype)
        mine = BatchRows(keys, values, offsets)
        theirs = BatchRows(ref_keys, ref_values, offsets)
        got = att(q, k, v, mine)
        want = core(q, k, v, theirs)
        mx.eval(got, want, theirs.keys, theirs.values)
        alone = []
        for b in range(rows):  # one evaluation each (see the test above)
            alone.append(att(q[b : b + 1], k[b : b + 1], v[b : b + 1], singles[b]))
            mx.eval(alone[-1], singles[b].arrays())
        assert rel_err(got, want) <= 8 * ULP[dtype], step
        for b, p in enumerate(prefixes):
            n = p + step + 1
            assert mx.array_equal(got[b : b + 1], alone[b]), (step, b)
            assert mx.array_equal(keys[b : b + 1, :, :n], singles[b].state["keys"][..., :n, :])
        ref_keys, ref_values = theirs.keys, theirs.values
        offsets = offsets + 1


def quantized_cache(prefix: int, kv_heads: int, d: int, dtype: mx.Dtype, fmt: KVFormat,
                    seed: int) -> StaticQuantizedKVCache:
    """A static quantized cache of `prefix` random rows, capacity rounded up to 256 rows."""
    mx.random.seed(seed)
    capacity = -(-prefix // 256) * 256
    keys = mx.random.normal((1, kv_heads, capacity, d)).astype(dtype)
    values = mx.random.normal((1, kv_heads, capacity, d)).astype(dtype)
    parts = (*fmt.quantize(keys), *fmt.quantize(values))
    mx.eval(parts)
    return StaticQuantizedKVCache(fmt, parts, prefix)


def float32_attention(q: mx.array, cache: StaticQuantizedKVCache, n: int, scale: float) -> mx.array:
    """softmax(q . K^T * scale) . V over the first n rows dequantized, all in float32 (q [1, H,
    1, D]; GQA by repeating the kv heads)."""
    fmt = cache.format
    rows = [cache.state[name][:, :, :n] for name in PARTS]
    keys = mx.dequantize(*rows[:3], group_size=fmt.group_size, bits=fmt.bits).astype(mx.float32)
    values = mx.dequantize(*rows[3:], group_size=fmt.group_size, bits=fmt.bits).astype(mx.float32)
    repeats = q.shape[1] // keys.shape[1]
    keys, values = mx.repeat(keys, repeats, axis=1), mx.repeat(values, repeats, axis=1)
    scores = (q.astype(mx.float32) @ keys.swapaxes(-1, -2)) * scale
    return mx.softmax(scores, axis=-1) @ values


CODES_FORMATS = [(8, 64), (4, 64), (8, 32), (4, 32), (8, 128)]


CODES_CASES = [(case, bits, group) for case in ("qwen3", "gqa8 traditional", "mha")
               for bits, group in CODES_FORMATS
               if ATTENTION_CASES[case]["head_dim"] % group == 0]


@pytest.mark.parametrize(("case", "bits", "group"), CODES_CASES)
@pytest.mark.parametrize("length", [1, 2048, 16384, 65536])
def test_attention_codes_match_float32_attention(case: str, bits: int, group: int,
                                                 length: int) -> None:
    """The launch reading a quantized cache's codes (both head splits where the group is even)
    against float32 attention over the dequantized rows, element-wise, at 1 to 64k rows (past
    MAX_SLICES chunks a slice walks)."""
    from mlx_omnia.engine.core.kernels import launch_scratch
    from mlx_omnia.engine.core.kernels.attention_step.cuda import (
        CodesSpec,
        codes_fits,
        codes_launcher,
        partials_bytes,
    )

    c = ATTENTION_CASES[case]
    h, hkv, d = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    dtype, fmt, scale = mx.bfloat16, KVFormat(bits, group), d**-0.5
    cache = quantized_cache(length, hkv, d, dtype, fmt, length)
    q = (2 * mx.random.normal((1, h, 1, d))).astype(dtype)
    want = float32_attention(q, cache, length, scale)
    scratch = launch_scratch(partials_bytes(h, d))
    splits = [1, 2] if (h // hkv) % 2 == 0 else [1]
    for hs in splits:
        spec = CodesSpec(dtype=dtype, n_heads=h, n_kv_heads=hkv, head_dim=d,
                         capacity=cache.capacity, scale=scale, bits=bits, group_size=group,
                         head_split=hs)
        assert codes_fits(spec)
        counters = mx.zeros((hkv * 2 + 4,), dtype=mx.int32)
        parts = [cache.state[name] for name in PARTS]
        got = codes_launcher(spec)([q, *parts, cache.state["offset"], counters], scratch)
        mx.eval(got)
        assert got.shape == (1, 1, h * d)
        assert rel_err(mx.reshape(got, want.shape), want) <= 4 * ULP[dtype], (hs, spec.tag())
        assert not mx.any(counters).item()  # the last block of each kv head reset its counter


@pytest.mark.parametrize("case", ["qwen3", "gqa8 traditional"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("prefix", [1, 700, 9000])
def test_attention_step_on_a_quantized_cache_reads_the_codes(case: str, bits: int,
                                                              prefix: int) -> None:
    """AttentionStep's binding on a StaticQuantizedKVCache: the core's norms, rope and append,
    then the codes launch: equal caches to the core's, step after step, and the output within
    bf16 rounding of float32 attention over the dequantized rows."""
    c = ATTENTION_CASES[case]
    h, hkv, d = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    dtype, fmt = mx.bfloat16, KVFormat(bits, 64)
    norms = c["norms"]
    att = AttentionStep(n_heads=h, n_kv_heads=hkv, head_dim=d,
                        q_norm=make_norm(d, dtype) if norms else None,
                        k_norm=make_norm(d, dtype) if norms else None,
                        rope=Rope(d, **c["rope"]))  # type: ignore[arg-type]
    assert att.bind() == "attention_step_cuda"
    mine, theirs = (quantized_cache(prefix, hkv, d, dtype, fmt, prefix) for _ in range(2))
    wanted: list[mx.array] = []

    def reference_attend(q: mx.array, k: mx.array, v: mx.array, cache: Any) -> mx.array:
        cache.update_and_fetch_quantized(k, v)
        wanted.append(float32_attention(q, cache, prefix + len(wanted) + 1, att.scale))
        return wanted[-1].astype(q.dtype)

    reference = att.reference_project(reference_attend)
    for step in range(3):
        for cache in (mine, theirs):
            cache.reserve(prefix + step + 1)
        q = (2 * mx.random.normal((1, 1, h * d))).astype(dtype)
        k = (2 * mx.random.normal((1, 1, hkv * d))).astype(dtype)
        v = mx.random.normal((1, 1, hkv * d)).astype(dtype)
        got = att(q, k, v, mine)
        reference(q, k, v, theirs)
        want = mx.reshape(wanted[-1].swapaxes(1, 2), (1, 1, h * d))
        mx.eval(got, want, mine.state, theirs.state)
        assert rel_err(got, want) <= 4 * ULP[dtype], step
        for name in (*PARTS, "offset"):
            assert mx.array_equal(mine.state[name], theirs.state[name]), (step, name)


@pytest.mark.parametrize(("family", "quantize"), [
    ("qwen3", None), ("qwen3", {"bits": 4, "group_size": 64}),
    ("qwen3_moe", {"bits": 4, "group_size": 64}),
])
def test_batch_step_logits_agree_with_each_sequence_alone(
    tmp_path: Path, family: str, quantize: dict[str, int] | None
) -> None:
    """A small model's batched decode step (the rows kernels, compiled) against each sequence
    decoded alone on the single-row kernels, teacher-forced: every row's logits within the
    greedy gate of its own sequence's, over 24 steps, sequences of different lengths."""
    from mlx_omnia import load
    from mlx_omnia.bench import shapes
    from mlx_omnia.engine.generate.batch import BatchCache, batch_forward, layout_of
    from mlx_omnia.engine.generate.loop import Decoding

    if family == "qwen3":
        config = dict(shapes.SHAPES["tiny"], hidden_size=256, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=3)
    else:
        config = dict(shapes.SHAPES["tiny-moe"], hidden_size=256, moe_intermediate_size=128,
                      num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64)
    shapes.SHAPES["test-batch"] = config
    path = shapes.build_checkpoint("test-batch", tmp_path / "m", dtype="bfloat16")
    model = load(str(path), dtype="bfloat16", quantize=quantize)
    network = model.network
    prompts = [[5, 9, 13] * n for n in (1, 7, 30, 2, 11)]
    alone = [Decoding(network, ()) for _ in prompts]
    firsts = [a.feed(p, last_only=True) for a, p in zip(alone, prompts, strict=True)]
    mx.eval(firsts, *(a.state() for a in alone))
    batch = [Decoding(network, ()) for _ in prompts]
    for b, p in zip(batch, prompts, strict=True):
        b.feed(p, last_only=True)
        mx.eval(b.state())
    cache = BatchCache(batch[0].rows(), layout_of(network), batch[0].length)
    for b in batch[1:]:
        cache.put(b.rows(), b.length)
    forward = batch_forward(network)
    tokens = [int(mx.argmax(f[-1]).item()) for f in firsts]
    worst = 0.0
    for _ in range(24):
        ids = mx.array(tokens + [0] * (cache.slots - len(tokens)), dtype=mx.int32)[:, None]
        logits = cache.forward(forward, ids)
        mx.eval(logits, cache.state())
        solo = []
        for a, t in zip(alone, tokens, strict=True):  # one evaluation each (see the rows test)
            solo.append(a.feed([t], last_only=True)[-1])
            mx.eval(solo[-1], a.state())
        for row, want in enumerate(solo):
            worst = max(worst, rel_err(logits[row], want))
        tokens = [int(mx.argmax(w).item()) for w in solo]
    print(f"batch vs alone: worst {worst:.4f} of the largest logit")
    assert worst <= greedy_tolerance(quantize)


def test_kernels_bind_only_on_the_gpu_device() -> None:
    lin = make_linear(256, 512, (None, None), mx.bfloat16)
    mx.set_default_device(mx.cpu)
    try:
        assert lin.bind() == "core"
    finally:
        mx.set_default_device(mx.gpu)
    assert lin.bind() == "qmv_cuda"


def reference_model(path: Path, quantize: dict[str, int] | None) -> Any:
    """The checkpoint loaded in bf16 with every declaration bound to its core implementation."""
    import os

    from mlx_omnia import load

    os.environ["OMNIA_REFERENCE_KERNELS"] = "1"
    try:
        return load(str(path), dtype="bfloat16", quantize=quantize)
    finally:
        del os.environ["OMNIA_REFERENCE_KERNELS"]


def greedy_tolerance(quantize: dict[str, int] | None) -> float:
    """The bench's gate (docs/benchmarks.md, "The gate"), fixed per dtype and format, never
    measured from the two paths it judges: bf16 6.25 % of the largest |logit|, 4-bit 12.5 %."""
    from mlx_omnia.bench.gate import gate_tolerance

    return gate_tolerance("bfloat16", quantized=quantize is not None, backend="cuda")


def assert_greedy_agrees(
    fast: Any, ref: Any, prompt: str, tolerance: float, steps: int = 128
) -> None:
    """Teacher-forced on the reference's greedy tokens: at each step the two paths' logits
    differ by at most `tolerance` of the reference's largest |logit|, and their argmaxes agree
    except at near-ties (the reference's top-2 margin within twice the tolerance), which stay
    rare."""
    ids = fast.encode(prompt)
    a, b = fast.decoding(), ref.decoding()
    la, lb = a.feed(ids), b.feed(ids)
    flips: list[tuple[int, float]] = []
    worst = 0.0
    for step in range(steps):
        mx.eval(la, lb, a.state(), b.state())
        fa = np.array(la[-1].astype(mx.float32))
        fb = np.array(lb[-1].astype(mx.float32))
        assert np.isfinite(fa).all()
        scale = max(float(np.abs(fb).max()), 1e-6)
        worst = max(worst, float(np.abs(fa - fb).max()) / scale)
        token = int(fb.argmax())
        if int(fa.argmax()) != token:
            top2 = np.sort(fb)[-2:]
            flips.append((step, float(top2[1] - top2[0]) / scale))
        la, lb = a.feed([token]), b.feed([token])
    print(f"greedy agreement: {steps - len(flips)}/{steps}, worst {worst:.4f} of the largest "
          f"logit (tolerance {tolerance:.4f}), flips {flips}")
    assert worst <= tolerance, (worst, tolerance)
    assert all(margin <= 2 * tolerance for _, margin in flips), (tolerance, flips)
    assert len(flips) <= steps // 8, flips


@pytest.mark.parametrize("quantize", [None, {"bits": 4, "group_size": 64}])
def test_small_model_greedy_tokens_agree_with_the_reference(
    tmp_path: Path, quantize: dict[str, int] | None
) -> None:
    """A whole model whose every declaration binds a kernel, decoding through the compiled
    kernel step: greedy tokens agree with the core path's (assert_greedy_agrees), and on the
    prompt and three steps the logits stay within the fixed tolerance of the core path's (bf16:
    also within 2 % of the largest logit). Measured on the H200 (scripts/device/kernel_agreement.py,
    2026-12-03, worst of 32 steps): kernel vs core 1.4 % (bf16) and 3.0 % (4-bit g64); MLX's
    own CPU and GPU core paths differ by 3.5 % and 23.6 % (printed, not a bound)."""

    from mlx_omnia import load
    from tests.fixtures.tiny import write_tiny_llama

    path = write_tiny_llama(tmp_path / "m", hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    fast = load(str(path), dtype="bfloat16", quantize=quantize)
    kinds = set(fast.bindings().values())
    assert kinds == {"qmv_cuda", "attention_step_cuda", "chained_qmv_cuda", "core"}, kinds
    ref = reference_model(path, quantize)
    assert set(ref.bindings().values()) == {"core"}
    assert_greedy_agrees(fast, ref, "the quick brown fox jumps over", greedy_tolerance(quantize))
    gpu = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        cpu = load(str(path), dtype="bfloat16", quantize=quantize)
        c = cpu.decoding()
    finally:
        mx.set_default_device(gpu)
    ids = fast.encode("the quick brown fox jumps over")
    a, b = fast.decoding(), ref.decoding()
    a.feed(ids[:-1]), b.feed(ids[:-1])
    kernel_err: list[float] = []
    backend_err: list[float] = []
    for step, token in enumerate([*ids[-1:], 5, 9, 13]):
        la, lb = a.feed([token]), b.feed([token])
        mx.eval(la, lb, a.state(), b.state())
        mx.set_default_device(mx.cpu)
        try:
            lc = c.feed([*ids[:-1], token] if step == 0 else [token])
            mx.eval(lc, c.state())
        finally:
            mx.set_default_device(gpu)
        kernel_err.append(rel_err(la, lb))
        backend_err.append(rel_err(lc[-1:], lb))
    print(f"kernel vs core {max(kernel_err):.4f}, CPU core vs GPU core {max(backend_err):.4f}")
    assert max(kernel_err) <= greedy_tolerance(quantize)
    if quantize is None:
        assert max(kernel_err) <= 0.02


# --- mixture of experts: Route, GateUp, DownCombine ------------------------------------------
def make_experts(decl: GateUp | DownCombine, fmt: tuple[int | None, int | None],
                 dtype: mx.Dtype) -> None:
    decl.weight = (mx.random.normal(decl.weight.shape) * 0.05).astype(dtype)
    bits, group = fmt
    if bits is not None and group is not None:
        decl.quantize_weights(bits=bits, group_size=group)


def distinct_ids(n_experts: int, k: int) -> mx.array:
    return mx.array(np.random.default_rng(n_experts * 31 + k).permutation(n_experts)[:k],
                    dtype=mx.uint32)


@pytest.mark.parametrize(("n", "k", "order", "normalize"), [
    (128, 8, "softmax_topk", True), (64, 8, "softmax_topk", False), (60, 4, "softmax_topk", True),
    (8, 2, "topk_softmax", False), (256, 32, "softmax_topk", True), (32, 1, "softmax_topk", False),
])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_route_matches_core(n: int, k: int, order: RouteOrder, normalize: bool,
                            dtype: mx.Dtype) -> None:
    route = Route(n, k, order=order, normalize=normalize)
    assert route.bind() == "route_cuda"
    core = route.reference()
    for seed in range(4):
        mx.random.seed(seed)
        logits = (3 * mx.random.normal((1, 1, n))).astype(dtype)
        w, ids = route(logits)
        rw, rids = core(logits)
        assert w.shape == rw.shape == ids.shape == (1, 1, k) and ids.dtype == rids.dtype
        order_got, order_want = np.argsort(np.array(ids)[0, 0]), np.argsort(np.array(rids)[0, 0])
        assert np.array_equal(np.array(ids)[0, 0][order_got], np.array(rids)[0, 0][order_want])
        got = np.array(w.astype(mx.float32))[0, 0][order_got]
        want = np.array(rw.astype(mx.float32))[0, 0][order_want]
        assert np.abs(got - want).max() <= 2 * ULP[dtype] * max(np.abs(want).max(), 1e-3)


@pytest.mark.parametrize(("n", "k"), [(128, 8), (60, 4), (64, 8)])
@pytest.mark.parametrize("fmt", [(None, None), (4, 64), (8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_routed_matches_router_then_route(n: int, k: int, fmt: tuple[int | None, int | None],
                                          dtype: mx.Dtype) -> None:
    """Route declaring its router (norm + gate): the one-block launch equals the router's
    logits computed by the qmv kernel with the same launch, then the route kernel (bit for
    bit), and those logits match the core's within the matmul rounding."""
    from mlx_omnia.engine.core.kernels.moe import routed_spec
    from mlx_omnia.engine.core.kernels.moe.cuda import route_launcher, routed_qmv

    gate, nrm = make_linear(2048, n, fmt, dtype), make_norm(2048, dtype)
    router = Projections([gate], norm=nrm)
    route = Route(n, k, normalize=True, router=router)
    assert route.bind() == "route_cuda"
    fused = routed_spec(route)
    assert fused is not None
    weights = [gate.weight] if gate.bits is None else [gate.weight, gate.scales, gate.biases]
    for seed in range(3):
        mx.random.seed(seed)
        h = (3 * mx.random.normal((1, 1, 2048))).astype(dtype)
        w, ids = route(h)
        logits = launcher(routed_qmv(fused[1], n), (1, 1))([h, *weights, nrm.weight])[0]
        rw, rids = route_launcher(fused[0], (1, 1))(logits)
        assert w.shape == ids.shape == (1, 1, k) and ids.dtype == mx.uint32
        assert np.array_equal(np.array(ids), np.array(rids))
        assert np.array_equal(np.array(w.astype(mx.float32)), np.array(rw.astype(mx.float32)))
        (core_logits,) = router.reference()(h)
        assert rel_err(logits, core_logits) <= 8 * ULP[dtype]


EXPERT_SHAPES = [(2048, 768, 128, 8), (256, 64, 8, 2), (512, 1408, 16, 4)]  # in, hidden, E, k


@pytest.mark.parametrize("shape", EXPERT_SHAPES, ids=str)
@pytest.mark.parametrize("fmt", [(None, None), (4, 32), (4, 64), (8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_experts_match_core(shape: tuple[int, int, int, int], fmt: tuple[int | None, int | None],
                            dtype: mx.Dtype) -> None:
    d_in, hidden, n, k = shape
    if fmt[0] is None and n * hidden * d_in > 64 * 2**20:
        n = 16  # dense stacks of 128 experts: fewer experts, same rows
    gate_up, down = GateUp(n, d_in, hidden), DownCombine(n, hidden, d_in)
    make_experts(gate_up, fmt, dtype)
    make_experts(down, fmt, dtype)
    assert gate_up.bind() == down.bind() == "experts_cuda"
    ids = distinct_ids(n, k).reshape(1, 1, k)
    x = mx.random.normal((1, 1, d_in)).astype(dtype)
    h = gate_up(x, ids)
    want_h = gate_up.reference()(x, ids)
    assert h.shape == want_h.shape == (1, 1, k, hidden)
    assert rel_err(h, want_h) <= 8 * ULP[dtype]
    weights = mx.softmax(mx.random.normal((1, 1, k)), axis=-1).astype(dtype)
    res = mx.random.normal((1, 1, d_in)).astype(dtype)
    core = down.reference()
    for r in (None, res):
        got = down(want_h, ids, weights, r)
        want = core(want_h, ids, weights, r)
        assert got.shape == want.shape == (1, 1, d_in)
        assert rel_err(got, want) <= 8 * ULP[dtype]


@pytest.mark.parametrize("rows", [2, 9])
@pytest.mark.parametrize("fmt", [(None, None), (4, 64)], ids=str)
def test_moe_rows_match_each_row_alone(fmt: tuple[int | None, int | None], rows: int) -> None:
    """A batch's rows through Route, GateUp (with its norm) and DownCombine (with the residual)
    in one launch each: every row gives exactly the single-row launch's bits, and the whole
    agrees with the core."""
    dtype, d_in, hidden, n, k = mx.bfloat16, 512, 256, 64, 8
    route = Route(n, k, order="softmax_topk", normalize=True)
    gate_up = GateUp(n, d_in, hidden, norm=make_norm(d_in, dtype))
    down = DownCombine(n, hidden, d_in)
    make_experts(gate_up, fmt, dtype)
    make_experts(down, fmt, dtype)
    assert route.bind() == "route_cuda"
    assert gate_up.bind() == down.bind() == "experts_cuda"
    logits = (3 * mx.random.normal((rows, 1, n))).astype(dtype)
    w, ids = route(logits)
    assert w.shape == ids.shape == (rows, 1, k)
    x = mx.random.normal((rows, 1, d_in)).astype(dtype)
    h = gate_up(x, ids)
    assert h.shape == (rows, 1, k, hidden)
    res = mx.random.normal((rows, 1, d_in)).astype(dtype)
    out = down(h, ids, w, res)
    assert out.shape == (rows, 1, d_in)
    for b in range(rows):
        wb, ib = route(logits[b : b + 1])
        assert mx.array_equal(wb, w[b : b + 1]) and mx.array_equal(ib, ids[b : b + 1])
        assert mx.array_equal(gate_up(x[b : b + 1], ids[b : b + 1]), h[b : b + 1])
        assert mx.array_equal(down(h[b : b + 1], ids[b : b + 1], w[b : b + 1], res[b : b + 1]),
                              out[b : b + 1])
    assert rel_err(h, gate_up.reference()(x, ids)) <= 8 * ULP[dtype]
    assert rel_err(out, down.reference()(h, ids, w, res)) <= 8 * ULP[dtype]


@pytest.mark.parametrize("fmt", [(None, None), (4, 64), (8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_experts_gate_up_with_norm_matches_core(fmt: tuple[int | None, int | None],
                                                dtype: mx.Dtype) -> None:
    """GateUp declaring the layer's RmsNorm: the kernel normalizes the staged input itself."""
    d_in, hidden, n, k = 2048, 768, 128 if fmt[0] is not None else 16, 8
    nrm = RmsNorm(d_in, 1e-6)
    nrm.weight = (1 + 0.2 * mx.random.normal((d_in,))).astype(dtype)
    gate_up = GateUp(n, d_in, hidden, norm=nrm)
    make_experts(gate_up, fmt, dtype)
    assert gate_up.bind() == "experts_cuda"
    ids = distinct_ids(n, k).reshape(1, 1, k)
    for seed in range(3):
        mx.random.seed(seed)
        x = (4 * mx.random.normal((1, 1, d_in))).astype(dtype)
        got, want = gate_up(x, ids), gate_up.reference()(x, ids)
        assert got.shape == want.shape == (1, 1, k, hidden)
        assert rel_err(got, want) <= 8 * ULP[dtype]


@pytest.mark.parametrize(("k_in", "d", "inner"), [(4096, 2560, 9728), (2048, 2048, 6144)])
@pytest.mark.parametrize("fmt", [(None, None), (4, 64), (8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("gate", ["silu", "gelu_tanh"])
def test_chained_qmv_equals_projection_then_projections(
    k_in: int, d: int, inner: int, fmt: tuple[int | None, int | None], dtype: mx.Dtype,
    gate: Gate,
) -> None:
    """ChainedProjections (o_proj + residual, then the MLP's gate/up of norm(h), one launch:
    the gate/up blocks wait for the o_proj blocks) writes exactly what the two qmv launches
    write, launch after launch (its counters return to zero); both match the core within the
    matmul rounding."""
    from mlx_omnia.engine.core.kernels.qmv import chained_specs

    o_proj = make_linear(k_in, d, fmt, dtype)
    g, u, nrm = make_linear(d, inner, fmt, dtype), make_linear(d, inner, fmt, dtype), make_norm(d, dtype)
    then = Projections([g, u], norm=nrm, gate=gate)
    decl = ChainedProjections(o_proj, then)
    assert o_proj.bind() == then.bind() == "qmv_cuda"
    assert decl.bind() == "chained_qmv_cuda"
    specs = chained_specs(decl)
    assert specs is not None

    def mats(m: Linear) -> list[mx.array]:
        return [m.weight] if m.bits is None else [m.weight, m.scales, m.biases]

    for seed in range(3):
        mx.random.seed(seed)
        a = mx.random.normal((1, 1, k_in)).astype(dtype)
        x = (2 * mx.random.normal((1, 1, d))).astype(dtype)
        h, act = decl(a, x)
        want_h = launcher(specs[0], (1, 1))([a, *mats(o_proj), x])[0]
        (want_act,) = launcher(specs[1], (1, 1))([want_h, *mats(g), *mats(u), nrm.weight])
        assert h.shape == (1, 1, d) and act.shape == (1, 1, inner)
        assert rel_err(h, want_h) == 0.0 and rel_err(act, want_act) == 0.0
        core_h = o_proj.reference()(a, x)
        assert rel_err(h, core_h) <= 8 * ULP[dtype]
        assert rel_err(act, then.reference()(h)[0]) <= 8 * ULP[dtype]


@pytest.mark.parametrize(("k_in", "n", "k"), [(4096, 128, 8), (512, 60, 4), (256, 8, 2)])
@pytest.mark.parametrize("fmt", [(None, None), (4, 64), (8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_project_route_equals_projection_then_routed(
    k_in: int, n: int, k: int, fmt: tuple[int | None, int | None], dtype: mx.Dtype
) -> None:
    """ProjectRoute (o_proj + residual, then the router and routing of the sum, one launch:
    the router's block waits for the projection's blocks) writes exactly what the projection's
    qmv launch, the router's qmv with the same launch, and the route kernel write, launch after
    launch (its counters return to zero); h matches the core within the matmul rounding."""
    from mlx_omnia.engine.core.kernels.moe import project_route_specs
    from mlx_omnia.engine.core.kernels.moe.cuda import chained_router, route_launcher

    o_proj, gate = make_linear(k_in, 256, fmt, dtype), make_linear(256, n, fmt, dtype)
    nrm = make_norm(256, dtype)
    route = Route(n, k, normalize=True, router=Projections([gate], norm=nrm))
    decl = ProjectRoute(o_proj, route)
    assert o_proj.bind() == "qmv_cuda" and route.bind() == "route_cuda"
    assert decl.bind() == "project_route_cuda"
    specs = project_route_specs(decl)
    assert specs is not None
    project, routing, router = specs
    chained = chained_router(router, n, project.config.warps)

    def mats(m: Linear) -> list[mx.array]:
        return [m.weight] if m.bits is None else [m.weight, m.scales, m.biases]

    for seed in range(3):
        mx.random.seed(seed)
        a = mx.random.normal((1, 1, k_in)).astype(dtype)
        x = (2 * mx.random.normal((1, 1, 256))).astype(dtype)
        h, w, ids = decl(a, x)
        want_h = launcher(project, (1, 1))([a, *mats(o_proj), x])[0]
        logits = launcher(chained, (1, 1))([want_h, *mats(gate), nrm.weight])[0]
        rw, rids = route_launcher(routing, (1, 1))(logits)
        assert h.shape == (1, 1, 256) and w.shape == ids.shape == (1, 1, k)
        assert rel_err(h, want_h) == 0.0
        assert np.array_equal(np.array(ids), np.array(rids))
        assert np.array_equal(np.array(w.astype(mx.float32)), np.array(rw.astype(mx.float32)))
        assert rel_err(h, o_proj.reference()(a, x)) <= 8 * ULP[dtype]


@pytest.mark.parametrize("shape", EXPERT_SHAPES, ids=str)
@pytest.mark.parametrize("fmt", [(None, None), (4, 64), (8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm"])
def test_experts_chain_equals_gate_up_then_down(
    shape: tuple[int, int, int, int], fmt: tuple[int | None, int | None], dtype: mx.Dtype,
    with_norm: bool,
) -> None:
    """The experts chain (gate/up then down in one launch, blocks ordered by tickets) writes exactly
    what the gate/up kernel followed by the down kernel write, launch after launch (its
    counters return to zero), with and without the residual."""
    d_in, hidden, n, k = shape
    if fmt[0] is None and n * hidden * d_in > 64 * 2**20:
        n = 16
    nrm = None
    if with_norm:
        nrm = RmsNorm(d_in, 1e-6)
        nrm.weight = (1 + 0.2 * mx.random.normal((d_in,))).astype(dtype)
    gate_up = GateUp(n, d_in, hidden, norm=nrm)
    chained, alone = DownCombine(n, hidden, d_in, gate_up=gate_up), DownCombine(n, hidden, d_in)
    make_experts(gate_up, fmt, dtype)
    make_experts(chained, fmt, dtype)
    for name in ("weight", "scales", "biases"):
        if name in chained:
            setattr(alone, name, getattr(chained, name))
    alone.bits, alone.group_size = chained.bits, chained.group_size
    assert gate_up.bind() == alone.bind() == "experts_cuda"
    assert chained.bind() == "experts_chain_cuda"
    ids = distinct_ids(n, k).reshape(1, 1, k)
    weights = mx.softmax(mx.random.normal((1, 1, k)), axis=-1).astype(dtype)
    for step in range(3):
        x = (2 * mx.random.normal((1, 1, d_in))).astype(dtype)
        for r in (None, x):
            got = chained(x, ids, weights, r)
            want = alone(gate_up(x, ids), ids, weights, r)
            core = chained.reference_down()(gate_up.reference()(x, ids), ids, weights, r)
            mx.eval(got, want, core)
            assert got.shape == want.shape == (1, 1, d_in), step
            assert rel_err(got, want) == 0.0, step
            assert rel_err(got, core) <= 16 * ULP[dtype], step


@pytest.mark.parametrize(("k_in", "width", "n", "k", "hidden"),
                         [(4096, 2048, 128, 8, 768), (512, 256, 60, 4, 128), (256, 256, 8, 2, 64)])
@pytest.mark.parametrize("fmt", [(None, None), (4, 64), (8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_route_experts_equals_project_route_then_the_experts_chain(
    k_in: int, width: int, n: int, k: int, hidden: int, fmt: tuple[int | None, int | None],
    dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RouteExperts (o_proj + residual, router, routing, expert gate/up, expert down and the
    residual, one launch of four phases ordered by tickets) writes exactly what the
    project_route launch followed by the experts chain launch write, launch after launch (its
    counters return to zero)."""
    from mlx_omnia.engine.core.moe import RouteExperts

    monkeypatch.delenv("OMNIA_ROUTE_EXPERTS", raising=False)
    if fmt[0] is None and n * hidden * width > 64 * 2**20:
        n = 16
    post = make_norm(width, dtype)
    o_proj, gate = make_linear(k_in, width, fmt, dtype), make_linear(width, n, fmt, dtype)
    route = Route(n, k, normalize=True, router=Projections([gate], norm=post))
    pair = ProjectRoute(o_proj, route)
    gate_up = GateUp(n, width, hidden, norm=post)
    experts = DownCombine(n, hidden, width, gate_up=gate_up)
    make_experts(gate_up, fmt, dtype)
    make_experts(experts, fmt, dtype)
    decl = RouteExperts(pair, experts)
    assert pair.bind() == "project_route_cuda" and gate_up.bind() == "experts_cuda"
    assert experts.bind() == "experts_chain_cuda" and route.bind() == "route_cuda"
    assert decl.bind() == "route_experts_cuda"
    for step in range(3):
        a = mx.random.normal((1, 1, k_in)).astype(dtype)
        x = (2 * mx.random.normal((1, 1, width))).astype(dtype)
        got = decl(a, x)
        h, weights, ids = pair(a, x)
        want = experts(h, ids, weights, residual=h)
        mx.eval(got, want)
        assert got.shape == want.shape == (1, 1, width), step
        assert rel_err(got, want) == 0.0, step


@pytest.mark.parametrize("fmt", [(None, None), (4, 64)], ids=str)
def test_route_experts_routed_by_every_expert_block_gives_the_same_bits(
    fmt: tuple[int | None, int | None], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RouteExperts with `local_route` (the default: each gate/up and down block routes the
    logits into its shared memory, no router block publishes the ids) writes exactly what the
    launch whose last router block routes writes, launch after launch."""
    from functools import partial

    from mlx_omnia.engine.core.kernels import moe
    from mlx_omnia.engine.core.moe import RouteExperts

    monkeypatch.delenv("OMNIA_ROUTE_EXPERTS", raising=False)
    k_in, width, n, k, hidden = 4096, 2048, 128, 8, 768
    dtype = mx.bfloat16
    if fmt[0] is None:
        n = 16
    post = make_norm(width, dtype)
    o_proj, gate = make_linear(k_in, width, fmt, dtype), make_linear(width, n, fmt, dtype)
    route = Route(n, k, normalize=True, router=Projections([gate], norm=post))
    gate_up = GateUp(n, width, hidden, norm=post)
    experts = DownCombine(n, hidden, width, gate_up=gate_up)
    make_experts(gate_up, fmt, dtype)
    make_experts(experts, fmt, dtype)
    decl = RouteExperts(ProjectRoute(o_proj, route), experts)
    assert decl.bind() == "route_experts_cuda"
    plain = moe.route_experts_launcher
    for step in range(3):
        a = mx.random.normal((1, 1, k_in)).astype(dtype)
        x = (2 * mx.random.normal((1, 1, width))).astype(dtype)
        got = decl(a, x)
        mx.eval(got)
        monkeypatch.setattr(moe, "route_experts_launcher", partial(plain, local_route=False))
        want = decl(a, x)
        mx.eval(want)
        monkeypatch.setattr(moe, "route_experts_launcher", plain)
        assert rel_err(got, want) == 0.0, step


@pytest.mark.parametrize("local_route", [True, False])
@pytest.mark.parametrize("fmt", [(None, None), (4, 64)], ids=str)
def test_route_experts_down_two_rows_a_warp_gives_the_same_bits(
    fmt: tuple[int | None, int | None], local_route: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RouteExperts' down phase at two output rows a warp (`expert_down_rows`, half the down
    blocks: ROUTE_EXPERTS_DOWN_ROWS 2) writes exactly what one row a warp writes."""
    from functools import partial

    from mlx_omnia.engine.core.kernels import moe
    from mlx_omnia.engine.core.kernels.moe import cuda as moe_cuda
    from mlx_omnia.engine.core.moe import RouteExperts

    monkeypatch.delenv("OMNIA_ROUTE_EXPERTS", raising=False)
    k_in, width, n, k, hidden = 4096, 2048, 128, 8, 768
    dtype = mx.bfloat16
    if fmt[0] is None:
        n = 16
    post = make_norm(width, dtype)
    o_proj, gate = make_linear(k_in, width, fmt, dtype), make_linear(width, n, fmt, dtype)
    route = Route(n, k, normalize=True, router=Projections([gate], norm=post))
    gate_up = GateUp(n, width, hidden, norm=post)
    experts = DownCombine(n, hidden, width, gate_up=gate_up)
    make_experts(gate_up, fmt, dtype)
    make_experts(experts, fmt, dtype)
    decl = RouteExperts(ProjectRoute(o_proj, route), experts)
    assert decl.bind() == "route_experts_cuda"
    plain = moe_cuda.route_experts_launcher
    monkeypatch.setattr(moe, "route_experts_launcher", partial(plain, local_route=local_route))
    for step in range(3):
        a = mx.random.normal((1, 1, k_in)).astype(dtype)
        x = (2 * mx.random.normal((1, 1, width))).astype(dtype)
        outs = []
        for rows in (2, 1):
            monkeypatch.setattr(moe_cuda, "ROUTE_EXPERTS_DOWN_ROWS", rows)
            plain.cache_clear()
            outs.append(decl(a, x))
            mx.eval(outs[-1])
        assert rel_err(outs[0], outs[1]) == 0.0, step
    plain.cache_clear()


# K 8192 with 8 query heads a kv head fits one block only with the heads split over two blocks
# (half the attention's shared memory); 8-bit q/k/v stage more and do not fit there
PROJECT_ATTEND_SHAPES = [
    (k_in, heads, kv_heads, fmt)
    for k_in, heads, kv_heads in [(2560, 32, 8), (2048, 32, 4), (256, 4, 2)]
    for fmt in [(None, None), (4, 64), (8, 64)]
] + [(8192, 32, 4, (None, None)), (8192, 32, 4, (4, 64))]


@pytest.mark.parametrize(("k_in", "heads", "kv_heads", "fmt"), PROJECT_ATTEND_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("prefix", [37, 2100])
def test_project_attend_equals_projections_then_attention(
    k_in: int, heads: int, kv_heads: int, fmt: tuple[int | None, int | None], dtype: mx.Dtype,
    prefix: int,
) -> None:
    """ProjectAttend (q/k/v after the norm, then the attention of them, one launch: the
    attention's blocks load their cached rows, then wait for the q/k/v blocks) writes exactly
    what the q/k/v launch (with the attention's block size) followed by the attention launch
    write, launch after launch (both counter arrays return to zero), cache included; its q/k/v
    phase's two rows a lane group give one row's bits; the output matches the
    core attention of those q, k, v within the attention test's bound."""
    from mlx_omnia.engine.core.kernels.attention_step import attention_spec
    from mlx_omnia.engine.core.kernels.attention_step.cuda import MAX_HEAD_SPLIT, attend_qkv_spec
    from mlx_omnia.engine.core.kernels.attention_step.cuda import launcher as attention_launcher

    d = 128 if heads > 4 else 64
    mats = [make_linear(k_in, n, fmt, dtype) for n in (heads * d, kv_heads * d, kv_heads * d)]
    qkv = Projections(mats, norm=make_norm(k_in, dtype))
    att = AttentionStep(n_heads=heads, n_kv_heads=kv_heads, head_dim=d, q_norm=make_norm(d, dtype),
                        k_norm=make_norm(d, dtype), rope=Rope(d, base=1e6))
    decl = ProjectAttend(qkv, att)
    assert qkv.bind() == "qmv_cuda" and att.bind() == "attention_step_cuda"
    assert decl.bind() == "project_attend_cuda"
    spec = projections_spec(qkv)
    assert spec is not None
    first = attend_qkv_spec(spec)  # the q/k/v phase's launch shape
    one_row = replace(first, launch=replace(first.config, rows=1))
    core = att.reference()

    def prefilled() -> StaticKVCache:
        return prefilled_cache(core, prefix, heads, kv_heads, d, dtype)

    mine, theirs, ref = prefilled(), prefilled(), prefilled()
    inputs_of_attention = [att.q_norm.weight, att.k_norm.weight]  # type: ignore[union-attr]
    from mlx_omnia.engine.core.kernels.attention_step import inverse_frequencies

    inv_freq = inverse_frequencies(att)
    heads_counters = mx.zeros((kv_heads * MAX_HEAD_SPLIT,), dtype=mx.int32)
    for step in range(3):
        for cache in (mine, theirs, ref):
            cache.reserve(prefix + step + 1)
        x = (2 * mx.random.normal((1, 1, k_in))).astype(dtype)
        got = decl(x, mine)
        weights = [a for m in mats for a in ([m.weight] if m.bits is None else [m.weight, m.scales, m.biases])]
        q, k, v = launcher(first, (1, 1))([x, *weights, qkv.norm.weight])  # type: ignore[union-attr]
        # two rows a lane group (attend_qkv_spec, quantized weights) sum each row as one does
        # (the warp count alone may not: the norm's partial sums are per warp)
        alone = launcher(one_row, (1, 1))([x, *weights, qkv.norm.weight])  # type: ignore[union-attr]
        assert all(rel_err(a, b) == 0.0 for a, b in zip((q, k, v), alone, strict=True)), step
        pos = theirs.state["offset"]
        want, following = attention_launcher(attention_spec(att, dtype, theirs.capacity), (1, 1))(
            [q, k, v, *inputs_of_attention, inv_freq, theirs.state["keys"],
             theirs.state["values"], pos, heads_counters])
        theirs.advance(pos, following)
        core_out = core(q, k, v, ref)
        mx.eval(got, want, core_out, mine.arrays(), theirs.arrays(), ref.arrays())
        n = prefix + step + 1
        assert got.shape == want.shape == (1, 1, heads * d), step
        assert rel_err(got, want) == 0.0, step
        assert int(mine.offset.item()) == int(theirs.offset.item()) == n
        for name in ("keys", "values"):
            assert rel_err(mine.state[name][..., :n, :], theirs.state[name][..., :n, :]) == 0.0
        assert rel_err(got, core_out) <= 8 * ULP[dtype], step


@pytest.mark.parametrize(("k_in", "heads", "kv_heads"), [(2560, 32, 8), (2048, 32, 4)])
@pytest.mark.parametrize("prefix", [37, 700])
def test_project_attend_head_split_gives_the_same_bits(
    k_in: int, heads: int, kv_heads: int, prefix: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ProjectAttend whose attention phase splits a slice's query heads over two blocks (the
    default) writes exactly what the launch of one block a slice writes: output, cache and
    offset."""
    dtype, d = mx.bfloat16, 128
    mats = [make_linear(k_in, n, (4, 64), dtype) for n in (heads * d, kv_heads * d, kv_heads * d)]
    qkv = Projections(mats, norm=make_norm(k_in, dtype))
    att = AttentionStep(n_heads=heads, n_kv_heads=kv_heads, head_dim=d, q_norm=make_norm(d, dtype),
                        k_norm=make_norm(d, dtype), rope=Rope(d, base=1e6))
    one, two = ProjectAttend(qkv, att), ProjectAttend(qkv, att)
    assert qkv.bind() == "qmv_cuda" and att.bind() == "attention_step_cuda"
    assert one.bind() == two.bind() == "project_attend_cuda"
    mine, theirs = two_caches(att.reference(), prefix, heads, kv_heads, d, dtype)
    for step in range(3):
        for cache in (mine, theirs):
            cache.reserve(prefix + step + 1)
        x = (2 * mx.random.normal((1, 1, k_in))).astype(dtype)
        got = two(x, mine)
        mx.eval(got, mine.arrays())
        with heads_in_one_block(monkeypatch):
            want = one(x, theirs)
            mx.eval(want, theirs.arrays())
        assert rel_err(got, want) == 0.0, step
        assert_same_caches(mine, theirs, step)


@pytest.mark.parametrize("quantize", [None, {"bits": 4, "group_size": 64}])
def test_qwen3_model_greedy_tokens_agree_with_the_reference(
    tmp_path: Path, quantize: dict[str, int] | None
) -> None:
    """A small qwen3 whose o_proj and gate/up run as one chained launch (chained_qmv_cuda):
    greedy tokens through the compiled kernel step agree with the core path's."""

    from mlx_omnia import load
    from mlx_omnia.bench import shapes

    shapes.SHAPES["test-qwen3"] = dict(
        shapes.SHAPES["tiny"], hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
    )
    path = shapes.build_checkpoint("test-qwen3", tmp_path / "m", dtype="bfloat16")
    fast = load(str(path), dtype="bfloat16", quantize=quantize)
    kinds = set(fast.bindings().values())
    assert {"qmv_cuda", "attention_step_cuda", "chained_qmv_cuda", "project_attend_cuda"} <= kinds, kinds
    ref = reference_model(path, quantize)
    assert_greedy_agrees(fast, ref, "the quick brown fox jumps over", greedy_tolerance(quantize))


@pytest.mark.parametrize("route_experts", [False, True], ids=["pairs", "route_experts"])
def test_moe_model_greedy_tokens_agree_with_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route_experts: bool
) -> None:
    """A qwen3_moe whose every declaration binds a kernel (4-bit): greedy tokens through the
    compiled kernel step agree with the core path's (assert_greedy_agrees); its sparse blocks
    run in one launch after the attention's (RouteExperts) unless OMNIA_ROUTE_EXPERTS=0."""

    from mlx_omnia import load
    from mlx_omnia.bench import shapes

    monkeypatch.setenv("OMNIA_ROUTE_EXPERTS", "1" if route_experts else "0")

    shapes.SHAPES["test-moe"] = dict(
        shapes.SHAPES["tiny-moe"], hidden_size=256, moe_intermediate_size=128, num_experts=8,
        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )
    path = shapes.build_checkpoint("test-moe", tmp_path / "m", dtype="bfloat16")
    quantize = {"bits": 4, "group_size": 64}
    fast = load(str(path), dtype="bfloat16", quantize=quantize)
    kinds = set(fast.bindings().values())
    assert {"qmv_cuda", "attention_step_cuda", "route_cuda", "experts_cuda",
            "experts_chain_cuda", "project_route_cuda", "project_attend_cuda"} <= kinds, kinds
    assert ("route_experts_cuda" in kinds) == route_experts, kinds
    ref = reference_model(path, quantize)
    assert_greedy_agrees(fast, ref, "the quick brown fox jumps over", greedy_tolerance(quantize))
