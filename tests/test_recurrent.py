"""The recurrent declarations (core/recurrent.py) against float64 numpy written from their
definitions: ShortConv's causal depthwise convolution and the gated delta rule, stepwise and
chunked (chunks that do not divide the sequence, several calls continuing one state, grouped
key heads), the same rule with a decay per key channel, Mamba-2's and Mamba-1's selective
scans likewise, and the compiled decode step's static state."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.core.recurrent import (
    ChannelGatedDeltaRule,
    DiagonalSelectiveScan,
    GatedDeltaRule,
    SelectiveScan,
    ShortConv,
)
from mlx_omnia.engine.core.state import RecurrentState, StaticRecurrentState


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def conv_reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """y[t, c] = sum_j w[c, 0, j] x[t - (K - 1) + j, c], zeros before the start."""
    b, length, c = x.shape
    k = w.shape[-1]
    padded = np.concatenate([np.zeros((b, k - 1, c)), x], axis=1)
    y = np.zeros_like(x)
    for t in range(length):
        y[:, t] = (padded[:, t : t + k] * w[:, 0, :].T).sum(axis=1)
    return y if bias is None else y + bias


@pytest.mark.parametrize(("kernel", "bias"), [(3, False), (4, True)])
def test_short_conv_in_pieces_equals_the_whole(kernel: int, bias: bool) -> None:
    conv = ShortConv(6, kernel, bias=bias)
    conv.weight = mx.random.normal((6, 1, kernel), key=mx.random.key(1))
    if bias:
        conv.bias = mx.random.normal((6,), key=mx.random.key(2))
    x = mx.random.normal((2, 11, 6), key=mx.random.key(3))
    want = conv_reference(_np(x), _np(conv.weight), _np(conv.bias) if bias else None)
    state = RecurrentState(("conv",))
    pieces = [conv(x[:, :5], state), conv(x[:, 5:6], state), conv(x[:, 6:], state)]
    np.testing.assert_allclose(_np(mx.concatenate(pieces, axis=1)), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(_np(state.arrays["conv"]), _np(x[:, -(kernel - 1) :]))
    silu = ShortConv(6, kernel, bias=bias, activation="silu")
    silu.update(conv.parameters())
    np.testing.assert_allclose(_np(silu(x, None)), want / (1 + np.exp(-want)), rtol=1e-5, atol=1e-6)


def delta_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
    s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Token by token, float64, as the rule is written (key heads repeated over value heads)."""
    repeats = v.shape[2] // k.shape[2]
    q, k = np.repeat(q, repeats, axis=2), np.repeat(k, repeats, axis=2)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    out = np.zeros(v.shape)
    for t in range(v.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        recalled = np.einsum("bhk,bhkv->bhv", k[:, t], s)
        delta = (v[:, t] - recalled) * beta[:, t][..., None]
        s = s + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], s)
    return out, s


@pytest.mark.parametrize(
    ("key_heads", "chunk", "splits", "strongest", "alike"),
    [
        (2, 64, (70,), 0.5, 0.0),
        (4, 16, (1, 37, 38), 0.5, 0.0),
        (2, 8, (), 0.5, 0.0),
        (2, 64, (20,), 0.001, 0.9),
        (4, 64, (3, 4), 0.0, 1.0),
    ],
)
def test_gated_delta_rule_equals_the_stepwise_definition(
    key_heads: int, chunk: int, splits: tuple[int, ...], strongest: float, alike: float
) -> None:
    """Chunks of 64, 16 and 8, continued over calls. Keys alike (each `alike` of one shared
    key) under a weak or no decay: a power series inverse of T was 1e3 to 1e9 off there."""
    b, length, heads, dk, dv = 2, 90, 4, 16, 8
    keys = mx.random.split(mx.random.key(7), 6)
    q = mx.random.normal((b, length, key_heads, dk), key=keys[0])
    shared = mx.random.normal((b, 1, key_heads, dk), key=keys[5])
    k = alike * shared + (1 - alike) * mx.random.normal((b, length, key_heads, dk), key=keys[1])
    v = mx.random.normal((b, length, heads, dv), key=keys[2])
    g = -mx.random.uniform(0.0, strongest, (b, length, heads), key=keys[3])
    beta = mx.sigmoid(mx.random.normal((b, length, heads), key=keys[4]) + (2.0 if alike else 0.0))
    rule = GatedDeltaRule(key_heads=key_heads, value_heads=heads, key_dim=dk, value_dim=dv,
                          chunk=chunk)
    state = RecurrentState(("recurrent",))
    bounds = [0, *splits, length]
    out = mx.concatenate(
        [rule(q[:, i:j], k[:, i:j], v[:, i:j], g[:, i:j], beta[:, i:j], state)
         for i, j in itertools.pairwise(bounds)],
        axis=1,
    )
    want, s = delta_reference(_np(q), _np(k), _np(v), _np(g), _np(beta), np.zeros((b, heads, dk, dv)))
    np.testing.assert_allclose(_np(out), want, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(_np(state.arrays["recurrent"]), s, rtol=1e-4, atol=2e-5)


def test_a_static_state_is_read_and_replaced_in_a_compiled_step() -> None:
    conv = ShortConv(4, 3)
    conv.weight = mx.random.normal((4, 1, 3), key=mx.random.key(4))
    x = mx.random.normal((1, 9, 4), key=mx.random.key(5))
    eager = RecurrentState(("conv",))
    want = [conv(x[:, :6], eager)] + [conv(x[:, t : t + 1], eager) for t in range(6, 9)]
    prefilled = RecurrentState(("conv",))
    got = [conv(x[:, :6], prefilled)]
    static = StaticRecurrentState.from_state(prefilled)
    step = mx.compile(lambda t: conv(t, static), inputs=[static.state], outputs=[static.state])
    got += [step(x[:, t : t + 1]) for t in range(6, 9)]
    np.testing.assert_allclose(_np(mx.concatenate(got, 1)), _np(mx.concatenate(want, 1)), rtol=1e-6)
    np.testing.assert_array_equal(_np(static.state["conv"]), _np(eager.arrays["conv"]))


def scan_reference(
    x: np.ndarray, dt: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Mamba-2's recurrence token by token, float64 (groups repeated over heads)."""
    repeats = x.shape[2] // b.shape[2]
    b, c = np.repeat(b, repeats, axis=2), np.repeat(c, repeats, axis=2)
    s = np.zeros((x.shape[0], x.shape[2], x.shape[3], b.shape[3]))
    y = np.zeros(x.shape)
    for t in range(x.shape[1]):
        s = (np.exp(dt[:, t] * a)[..., None, None] * s
             + np.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], b[:, t]))
        y[:, t] = np.einsum("bhpn,bhn->bhp", s, c[:, t]) + d[:, None] * x[:, t]
    return y, s


@pytest.mark.parametrize(("groups", "chunk", "splits"), [(1, 64, (50,)), (2, 16, (1, 33, 34)), (4, 8, ())])
def test_selective_scan_equals_the_stepwise_definition(
    groups: int, chunk: int, splits: tuple[int, ...]
) -> None:
    b, length, heads, p, n = 2, 90, 4, 8, 16
    keys = mx.random.split(mx.random.key(11), 6)
    x = mx.random.normal((b, length, heads, p), key=keys[0])
    dt = mx.random.uniform(0.01, 0.5, (b, length, heads), key=keys[1])
    a = -mx.random.uniform(0.5, 2.0, (heads,), key=keys[2])
    bb = mx.random.normal((b, length, groups, n), key=keys[3])
    cc = mx.random.normal((b, length, groups, n), key=keys[4])
    d = mx.random.normal((heads,), key=keys[5])
    scan = SelectiveScan(heads=heads, head_dim=p, state_size=n, groups=groups, chunk=chunk)
    state = RecurrentState(("ssm",))
    bounds = [0, *splits, length]
    out = mx.concatenate(
        [scan(x[:, i:j], dt[:, i:j], a, bb[:, i:j], cc[:, i:j], d, state)
         for i, j in itertools.pairwise(bounds)],
        axis=1,
    )
    want, s = scan_reference(_np(x), _np(dt), _np(a), _np(bb), _np(cc), _np(d))
    np.testing.assert_allclose(_np(out), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_np(state.arrays["ssm"]), s, rtol=1e-4, atol=1e-4)


def diagonal_scan_reference(
    x: np.ndarray, dt: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray,
    s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Mamba-1's recurrence token by token, float64: a state row per channel, A [C, N]."""
    y = np.zeros(x.shape)
    for t in range(x.shape[1]):
        s = (np.exp(dt[:, t, :, None] * a) * s
             + (dt[:, t] * x[:, t])[:, :, None] * b[:, t, None, :])
        y[:, t] = np.einsum("bcn,bn->bc", s, c[:, t]) + d * x[:, t]
    return y, s


@pytest.mark.parametrize(("chunk", "splits"), [(64, (50,)), (16, (1, 33, 34)), (8, ()), (5, (2, 3, 61))])
def test_diagonal_selective_scan_equals_the_stepwise_definition(
    chunk: int, splits: tuple[int, ...]
) -> None:
    """Chunks of 64, 16, 8 and 5 (the last ones partial), continued over calls of 1 to 56 tokens,
    from a carried state (one call of 50, then 40) and from a given one."""
    b, length, channels, n = 2, 90, 12, 16
    keys = mx.random.split(mx.random.key(13), 7)
    x = mx.random.normal((b, length, channels), key=keys[0])
    dt = mx.random.uniform(0.01, 0.5, (b, length, channels), key=keys[1])
    a = -mx.exp(mx.random.uniform(-1.0, 2.5, (channels, n), key=keys[2]))  # decays 0.37 to 12
    bb = mx.random.normal((b, length, n), key=keys[3])
    cc = mx.random.normal((b, length, n), key=keys[4])
    d = mx.random.normal((channels,), key=keys[5])
    start = mx.random.normal((b, channels, n), key=keys[6])
    scan = DiagonalSelectiveScan(channels=channels, state_size=n, chunk=chunk)
    state = RecurrentState(("ssm",))
    state.put("ssm", start)
    bounds = [0, *splits, length]
    out = mx.concatenate(
        [scan(x[:, i:j], dt[:, i:j], a, bb[:, i:j], cc[:, i:j], d, state)
         for i, j in itertools.pairwise(bounds)],
        axis=1,
    )
    want, s = diagonal_scan_reference(_np(x), _np(dt), _np(a), _np(bb), _np(cc), _np(d), _np(start))
    np.testing.assert_allclose(_np(out), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_np(state.arrays["ssm"]), s, rtol=1e-4, atol=1e-4)
    fresh, _ = diagonal_scan_reference(
        _np(x), _np(dt), _np(a), _np(bb), _np(cc), _np(d), np.zeros((b, channels, n))
    )
    np.testing.assert_allclose(_np(scan(x, dt, a, bb, cc, d, None)), fresh, rtol=1e-4, atol=1e-4)


def test_diagonal_selective_scan_keeps_the_input_dtype_and_a_float32_state() -> None:
    scan = DiagonalSelectiveScan(channels=4, state_size=8, chunk=4)
    keys = mx.random.split(mx.random.key(17), 3)
    x = mx.random.normal((1, 7, 4), key=keys[0]).astype(mx.bfloat16)
    dt = mx.full((1, 7, 4), 0.1, dtype=mx.bfloat16)
    bc = mx.random.normal((1, 7, 8), key=keys[1]).astype(mx.bfloat16)
    state = RecurrentState(("ssm",))
    y = scan(x, dt, -mx.ones((4, 8)), bc, bc, mx.ones((4,)), state)
    assert y.dtype == mx.bfloat16 and y.shape == (1, 7, 4)
    assert state.arrays["ssm"].dtype == mx.float32 and state.arrays["ssm"].shape == (1, 4, 8)


def channel_delta_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
    s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """KDA's rule token by token, float64, as written: S <- diag(exp(g)) S, then the delta
    rule's update, o = S^T q."""
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    out = np.zeros(v.shape)
    for t in range(v.shape[1]):
        s = s * np.exp(g[:, t])[..., :, None]
        recalled = np.einsum("bhk,bhkv->bhv", k[:, t], s)
        delta = (v[:, t] - recalled) * beta[:, t][..., None]
        s = s + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], s)
    return out, s


@pytest.mark.parametrize(
    ("chunk", "splits", "strongest", "alike"),
    [
        (64, (70,), 0.5, 0.0),
        (16, (1, 37, 38), 0.5, 0.0),
        (8, (), 0.5, 0.0),
        (64, (50,), 30.0, 0.0),
        (64, (20,), 0.001, 0.9),
        (16, (3, 4), 0.0, 1.0),
    ],
)
def test_channel_gated_delta_rule_equals_the_stepwise_definition(
    chunk: int, splits: tuple[int, ...], strongest: float, alike: float
) -> None:
    """Chunks of 64, 16 and 8 (the last ones partial; a call of 20 tokens takes a chunk of
    32), continued over calls of 1 to 70 tokens from a given state. Decays up to exp(-30) a
    token and channel reach exp(-1900) within a chunk: no factor may grow past float32 on the
    way. Keys alike (each `alike` of one shared key) under a weak or no decay make T's powers
    grow like binomials (a power series inverse there is off by 1e4 to 1e19): the blocked
    inverse stays as exact as the steps."""
    b, length, heads, dk, dv = 2, 90, 3, 16, 8
    keys = mx.random.split(mx.random.key(29), 7)
    q = mx.random.normal((b, length, heads, dk), key=keys[0])
    shared = mx.random.normal((b, 1, heads, dk), key=keys[6])
    k = alike * shared + (1 - alike) * mx.random.normal((b, length, heads, dk), key=keys[1])
    v = mx.random.normal((b, length, heads, dv), key=keys[2])
    g = -mx.random.uniform(0.0, strongest, (b, length, heads, dk), key=keys[3])
    beta = mx.sigmoid(mx.random.normal((b, length, heads), key=keys[4]) + 2.0)
    start = mx.random.normal((b, heads, dk, dv), key=keys[5])
    rule = ChannelGatedDeltaRule(heads=heads, key_dim=dk, value_dim=dv, chunk=chunk)
    state = RecurrentState(("recurrent",))
    state.put("recurrent", start)
    bounds = [0, *splits, length]
    out = mx.concatenate(
        [rule(q[:, i:j], k[:, i:j], v[:, i:j], g[:, i:j], beta[:, i:j], state)
         for i, j in itertools.pairwise(bounds)],
        axis=1,
    )
    want, s = channel_delta_reference(_np(q), _np(k), _np(v), _np(g), _np(beta), _np(start))
    np.testing.assert_allclose(_np(out), want, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(_np(state.arrays["recurrent"]), s, rtol=1e-4, atol=2e-5)
    fresh, _ = channel_delta_reference(
        _np(q), _np(k), _np(v), _np(g), _np(beta), np.zeros((b, heads, dk, dv))
    )
    np.testing.assert_allclose(_np(rule(q, k, v, g, beta, None)), fresh, rtol=1e-4, atol=2e-5)


def test_channel_gated_delta_rule_keeps_the_input_dtype_and_a_float32_state() -> None:
    rule = ChannelGatedDeltaRule(heads=2, key_dim=8, value_dim=4, chunk=4)
    keys = mx.random.split(mx.random.key(31), 3)
    qk = mx.random.normal((1, 7, 2, 8), key=keys[0]).astype(mx.bfloat16)
    v = mx.random.normal((1, 7, 2, 4), key=keys[1]).astype(mx.bfloat16)
    g = -mx.random.uniform(0.0, 1.0, (1, 7, 2, 8), key=keys[2]).astype(mx.bfloat16)
    state = RecurrentState(("recurrent",))
    out = rule(qk, qk, v, g, mx.full((1, 7, 2), 0.5, dtype=mx.bfloat16), state)
    assert out.dtype == mx.bfloat16 and out.shape == (1, 7, 2, 4)
    assert state.arrays["recurrent"].dtype == mx.float32
    assert state.arrays["recurrent"].shape == (1, 2, 8, 4)
    with pytest.raises(ValueError, match="power of two"):
        ChannelGatedDeltaRule(heads=2, key_dim=8, value_dim=4, chunk=48)
