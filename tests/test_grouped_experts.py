"""The experts' products grouped by expert (core/moe.py `ExpertGroups`, bound on a GPU by
kernels/grouped_experts): the layout, and the same numbers as a row at a time (bit for bit for
quantized experts, within float32 rounding for dense ones) for every expert format and option,
alone and in the MoE families' prefill."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.binding import kernels_for
from mlx_omnia.engine.core.kernels import grouped_experts
from mlx_omnia.engine.core.layers import RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, ExpertGroups, GateUp
from tests.fixtures import parity

RNG = np.random.default_rng(11)


def random_ids(shape: tuple[int, ...], n_experts: int, k: int, skew: bool = False) -> mx.array:
    """[*shape, k] distinct expert ids per token; `skew` sends most rows to a few experts."""
    scores = RNG.standard_normal((*shape, n_experts))
    if skew:
        scores[..., :3] += 3.0
    return mx.array(np.argsort(-scores, axis=-1)[..., :k].astype(np.uint32))


@pytest.mark.parametrize(("tokens", "n_experts", "k", "skew"),
                         [(40, 8, 2, False), (300, 64, 8, False), (300, 64, 8, True), (7, 128, 8, False)])
def test_layout_places_every_row_once_in_its_experts_block(
    tokens: int, n_experts: int, k: int, skew: bool
) -> None:
    ids = random_ids((tokens,), n_experts, k, skew)
    g = ExpertGroups.of(ids, n_experts)
    flat = np.array(ids).reshape(-1)
    n = flat.size
    slot, source, expert = np.array(g.slot), np.array(g.source), np.array(g.expert)
    assert g.rows in (16, 32, 64) and slot.shape == (n,) and source.shape == (g.blocks * g.rows,)
    assert np.array_equal(source[slot], np.arange(n))  # each row sits where its source says
    held = source < n
    assert held.sum() == n and np.all(source[~held] == n)  # the rest is padding
    block_of = np.arange(g.blocks * g.rows) // g.rows
    assert np.array_equal(expert[block_of[held]], flat[source[held]])  # a block: one expert
    assert np.all(np.diff(source[held][np.argsort(slot)]) != 0)
    # an expert's rows in token order, its blocks contiguous
    for e in np.unique(flat):
        places = np.sort(slot[flat == e])
        assert np.array_equal(source[places], np.flatnonzero(flat == e))
        assert places[-1] - places[0] < -(-len(places) // g.rows) * g.rows


def pair(fmt: str, *, bias: bool = False, swiglu: bool = False, norm: bool = False,
         dtype: mx.Dtype = mx.float32) -> tuple[GateUp, DownCombine]:
    e, d, h = 16, 64, 32
    up = GateUp(e, d, h, bias=bias, activation="gpt_oss_swiglu" if swiglu else "silu")
    down = DownCombine(e, h, d, bias=bias)
    for decl in (up, down):
        decl.weight = mx.array(RNG.standard_normal(decl.weight.shape) / np.sqrt(decl.input_dims)).astype(dtype)
        if bias:
            decl.bias = mx.array(RNG.standard_normal(decl.bias.shape)).astype(dtype)
        if fmt == "q4":
            decl.quantize_weights(bits=4, group_size=32)
        elif fmt == "mxfp4":
            decl.quantize_weights(bits=4, group_size=32, mode="mxfp4")
        decl.bind(force_reference=True)  # as loading binds, once the formats are final
    if norm:
        rms = RmsNorm(64, eps=1e-5)
        rms.weight = mx.array(RNG.standard_normal(64)).astype(dtype)
        up = up.after_norm(rms)
    return up, down.after(up)


@pytest.mark.parametrize(
    ("fmt", "options"),
    [("dense", {}), ("q4", {}), ("q4", {"norm": True}), ("mxfp4", {"bias": True, "swiglu": True}),
     ("q4", {"dtype": mx.bfloat16, "norm": True})],  # CPU gather_mm: float32 only
)
def test_grouped_products_equal_a_row_at_a_time(fmt: str, options: dict[str, object]) -> None:
    dtype = options.get("dtype", mx.float32)
    assert isinstance(dtype, mx.Dtype)
    up, chain = pair(fmt, **{k: v for k, v in options.items() if k != "dtype"}, dtype=dtype)  # type: ignore[arg-type]
    x = mx.array(RNG.standard_normal((2, 30, 64))).astype(dtype)
    residual = mx.array(RNG.standard_normal((2, 30, 64))).astype(dtype)
    ids = random_ids((2, 30), 16, 4)
    weights = mx.softmax(mx.array(RNG.standard_normal((2, 30, 4))), axis=-1).astype(dtype)
    assert ExpertGroups.wanted(ids, 16)
    h_rows, h_grouped = up.reference()(x, ids), up.reference(grouped=True)(x, ids)
    same(h_rows, h_grouped, exact=fmt != "dense")
    rows = chain.reference()(x, ids, weights, residual)
    grouped = chain.reference(grouped=True)(x, ids, weights, residual)
    assert rows.dtype == grouped.dtype == dtype
    same(rows, grouped, exact=fmt != "dense")


def same(a: mx.array, b: mx.array, *, exact: bool) -> None:
    """Equal bit for bit (quantized experts: MLX's own CPU kernels, one row at a time in either
    layout), or within float32 rounding (dense experts: a block is one BLAS GEMM, which may sum
    in another order than a row's GEMV, e.g. OpenBLAS)."""
    x, y = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    if exact:
        assert np.array_equal(x, y)
    else:
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)


def test_few_rows_stay_a_row_at_a_time() -> None:
    ids = random_ids((1,), 16, 4)
    assert not ExpertGroups.wanted(ids, 16)
    up, _ = pair("q4")
    x = mx.array(RNG.standard_normal((1, 64))).astype(mx.float32)
    assert np.array_equal(np.array(up.reference()(x, ids)), np.array(up.reference(grouped=True)(x, ids)))


def test_grouped_kernel_applies_on_a_gpu_only_and_after_specialized_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    up, _ = pair("q4")
    assert up.bind() == "core"  # this CPU
    monkeypatch.setattr(grouped_experts, "gpu_backend", lambda: True)
    assert up.bind() == "grouped_experts"
    for declaration in (GateUp, DownCombine):
        order = kernels_for(declaration)
        assert order[-1].name == "grouped_experts" and order[-1].general
        assert not any(k.general for k in order[:-1])


@pytest.mark.parametrize(
    ("variant", "quantize"),
    [("qwen3_moe-sparse", None), ("qwen3_moe-sparse", 4), ("mixtral-default", None),
     ("olmoe-clip", None), ("qwen2_moe-shared", None), ("deepseek_v2-lite", None),
     ("gpt_oss-mxfp4", None)],
)
def test_family_prefill_grouped_equals_core(
    variant: str, quantize: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's logits with the experts grouped (the GPU binding, made to apply here) equal
    the core's row-at-a-time logits: exactly for quantized experts, within float32 rounding for
    dense ones (`same`)."""
    path = parity.checkpoint_dir(variant, "v5")
    core = load(path, dtype="float32", quantize=quantize)
    monkeypatch.setattr(grouped_experts, "gpu_backend", lambda: True)
    grouped = load(path, dtype="float32", quantize=quantize)
    bound = grouped.bindings().values()
    assert "grouped_experts" in bound and "grouped_experts" not in core.bindings().values()
    ids = parity.PROMPT_IDS * 2
    want = np.array(core.logits(ids).astype(mx.float32))
    got = np.array(grouped.logits(ids).astype(mx.float32))
    if quantize is not None or variant == "gpt_oss-mxfp4":
        assert np.array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
