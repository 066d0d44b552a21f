"""Route, GateUp and DownCombine (core/moe.py) against a plain numpy reference, dense and
affine-quantized, with leading batch dimensions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.layers import RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route, RouteOrder

E, D, H, K = 8, 64, 32, 2
RNG = np.random.default_rng(7)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_route(logits: np.ndarray, k: int, order: str, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Weights and ids [..., k], ids sorted ascending per row (order within the k is free)."""
    if order == "topk_softmax":
        ids = np.argsort(-logits, axis=-1)[..., :k]
        weights = softmax(np.take_along_axis(logits, ids, axis=-1))
    else:
        probs = softmax(logits)
        ids = np.argsort(-probs, axis=-1)[..., :k]
        weights = np.take_along_axis(probs, ids, axis=-1)
        if normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
    perm = np.argsort(ids, axis=-1)
    return np.take_along_axis(weights, perm, axis=-1), np.take_along_axis(ids, perm, axis=-1)


def sorted_route(weights: mx.array, ids: mx.array) -> tuple[np.ndarray, np.ndarray]:
    w, i = np.array(weights), np.array(ids)
    perm = np.argsort(i, axis=-1)
    return np.take_along_axis(w, perm, axis=-1), np.take_along_axis(i, perm, axis=-1)


@pytest.mark.parametrize(
    ("order", "normalize"), [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]
)
def test_route_matches_numpy(order: RouteOrder, normalize: bool) -> None:
    logits = RNG.standard_normal((3, 5, E)).astype(np.float32)
    route = Route(E, K, order=order, normalize=normalize)
    w, ids = sorted_route(*route(mx.array(logits)))
    want_w, want_ids = np_route(logits.astype(np.float64), K, order, normalize)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-6, atol=1e-7)


def test_topk_softmax_equals_renormalized_softmax_topk() -> None:
    logits = mx.array(RNG.standard_normal((7, E)).astype(np.float32))
    a = sorted_route(*Route(E, K, order="topk_softmax")(logits))
    b = sorted_route(*Route(E, K, order="softmax_topk", normalize=True)(logits))
    assert np.array_equal(a[1], b[1])
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)


def test_route_keeps_the_logits_dtype() -> None:
    logits = mx.array(RNG.standard_normal((4, E)).astype(np.float32)).astype(mx.bfloat16)
    weights, ids = Route(E, K)(logits)
    assert weights.dtype == mx.bfloat16 and ids.shape == (4, K)


def test_route_rejects_top_k_above_experts() -> None:
    with pytest.raises(ValueError, match="top_k"):
        Route(4, 5)


def np_experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gu: np.ndarray, dn: np.ndarray) -> np.ndarray:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)), e = ids[j], token by token."""
    out = np.zeros(x.shape, dtype=np.float64)
    flat_x, flat_ids, flat_w = x.reshape(-1, D), ids.reshape(-1, K), weights.reshape(-1, K)
    flat_out = out.reshape(-1, D)
    for t in range(flat_x.shape[0]):
        for j in range(K):
            e = flat_ids[t, j]
            y = gu[e] @ flat_x[t]
            g, u = y[:H], y[H:]
            h = g / (1 + np.exp(-g)) * u
            flat_out[t] += flat_w[t, j] * (dn[e] @ h)
    return out


def make(bits: int | None) -> tuple[GateUp, DownCombine, np.ndarray, np.ndarray]:
    gate_up, down = GateUp(E, D, H), DownCombine(E, H, D)
    gate_up.weight = mx.array(RNG.uniform(-0.125, 0.125, (E, 2 * H, D)).astype(np.float32))
    down.weight = mx.array(RNG.uniform(-0.125, 0.125, (E, D, H)).astype(np.float32))
    if bits is not None:
        gate_up.quantize_weights(bits=bits, group_size=32)
        down.quantize_weights(bits=bits, group_size=32)
    bind_layers(gate_up)
    bind_layers(down)
    dense: list[np.ndarray] = []
    for m in (gate_up, down):
        if m.quantized:
            w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        else:
            w = m.weight
        dense.append(np.array(w).astype(np.float64))
    return gate_up, down, dense[0], dense[1]


@pytest.mark.parametrize("bits", [None, 4, 8])
def test_gate_up_down_combine_match_numpy(bits: int | None) -> None:
    gate_up, down, gu, dn = make(bits)
    assert gate_up.binding == "core" and down.binding == "core"
    x = RNG.standard_normal((2, 5, D)).astype(np.float32)
    ids = np.stack([RNG.choice(E, K, replace=False) for _ in range(10)]).reshape(2, 5, K)
    w = RNG.uniform(0, 1, (2, 5, K)).astype(np.float32)
    h = gate_up(mx.array(x), mx.array(ids))
    assert h.shape == (2, 5, K, H)
    y = down(h, mx.array(ids), mx.array(w))
    assert y.shape == (2, 5, D)
    want = np_experts(x.astype(np.float64), ids, w.astype(np.float64), gu, dn)
    err = np.abs(np.array(y) - want).max() / np.abs(want).max()
    assert err < 2e-6, err


def test_gate_up_declared_norm_normalizes_its_input_first() -> None:
    """GateUp(norm=n)(x, ids) == GateUp(n(x), ids) with the same experts: the declared norm is
    the layer's own (not owned: it adds no parameter)."""
    plain, _, _, _ = make(None)
    n = RmsNorm(D, 1e-6)
    n.weight = mx.array(RNG.uniform(0.5, 1.5, (D,)).astype(np.float32))
    normed = GateUp(E, D, H, norm=n)
    normed.weight = plain.weight
    bind_layers(normed)
    assert "norm" not in dict(normed.parameters()) and "weight" in dict(normed.parameters())
    x = mx.array(RNG.standard_normal((1, 3, D)).astype(np.float32))
    ids = mx.array(np.stack([RNG.choice(E, K, replace=False) for _ in range(3)]).reshape(1, 3, K))
    got, want = normed(x, ids), plain(n(x), ids)
    assert np.array_equal(np.array(got), np.array(want))


def test_quantize_dequantize_round_trip() -> None:
    gate_up, _, gu, _ = make(4)
    assert gate_up.weight.dtype == mx.uint32 and gate_up.scales.shape == (E, 2 * H, D // 32)
    gate_up.dequantize_weights()
    assert not gate_up.quantized and "scales" not in gate_up
    assert np.array_equal(np.array(gate_up.weight).astype(np.float64), gu)
    placeholder = DownCombine(E, H, D)
    placeholder.to_quantized(bits=4, group_size=32)
    assert placeholder.weight.shape == (E, D, H * 4 // 32) and placeholder.biases.shape == (E, D, 1)
