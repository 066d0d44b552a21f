"""AttentionStep (core reference) against a numpy reference: causal, GQA, sliding window,
soft-capping, sinks; one prefill call and token-by-token through the cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep

B, H, KV, D, L = 1, 4, 2, 8, 10
rng = np.random.default_rng(0)
Q = rng.standard_normal((B, H, L, D)).astype(np.float32)
K = rng.standard_normal((B, KV, L, D)).astype(np.float32)
V = rng.standard_normal((B, KV, L, D)).astype(np.float32)
SINKS = rng.standard_normal(H).astype(np.float32)


def numpy_attention(window: int | None, softcap: float | None, sinks: np.ndarray | None) -> np.ndarray:
    k, v = np.repeat(K, H // KV, axis=1), np.repeat(V, H // KV, axis=1)
    s = Q @ k.swapaxes(-1, -2) / np.sqrt(D)
    if softcap:
        s = np.tanh(s / softcap) * softcap
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = j <= i
    if window:
        visible &= j > i - window
    s = np.where(visible, s, -np.inf)
    if sinks is not None:
        s = np.concatenate([np.broadcast_to(sinks[None, :, None, None], (B, H, L, 1)), s], -1)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    if sinks is not None:
        w = w[..., 1:]
    return w @ v


@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks"),
    [(None, None, False), (3, None, False), (None, 5.0, False), (4, 5.0, False),
     (None, None, True), (3, 50.0, True)],
)
def test_attention_matches_numpy_in_one_call_and_stepwise(
    window: int | None, softcap: float | None, with_sinks: bool
) -> None:
    step = AttentionStep(n_heads=H, n_kv_heads=KV, head_dim=D, window=window, softcap=softcap)
    sinks = mx.array(SINKS) if with_sinks else None
    want = numpy_attention(window, softcap, SINKS if with_sinks else None)
    full = np.array(step.attend(mx.array(Q), mx.array(K), mx.array(V), None, sinks))
    cache = KVCache()
    pieces = [
        np.array(step.attend(mx.array(Q[:, :, t : t + 1]), mx.array(K[:, :, t : t + 1]),
                      mx.array(V[:, :, t : t + 1]), cache, sinks))
        for t in range(L)
    ]
    assert np.abs(full - want).max() < 1e-5
    assert np.abs(np.concatenate(pieces, axis=2) - want).max() < 1e-5
