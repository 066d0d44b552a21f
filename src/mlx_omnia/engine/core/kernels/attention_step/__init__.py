"""The decode attention kernel bound to AttentionStep declarations (see cuda.py).

`attention_applies` accepts a declaration that declares exactly what the kernel computes: causal
attention with no sliding window, soft-capping or sinks, values as wide as keys, head_dim a
multiple of 32 up to 128, queries and keys rotated by a plain Rope over the whole head
(default or scaled frequencies, no attention factor) after an optional per-head RmsNorm. The
bound `project` runs the kernel for one token on a StaticKVCache (the compiled decode step's
cache: fixed capacity, offset on the device) and hands everything else to the core."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlx_omnia.engine.core.cache import StaticKVCache
from mlx_omnia.engine.core.kernels import cuda_backend
from mlx_omnia.engine.core.kernels.attention_step.cuda import (
    AttentionStepSpec,
    launcher,
    spec_fits,
)
from mlx_omnia.engine.core.kernels.cuda_common import CUDA_TYPES
from mlx_omnia.engine.core.mxcompat import evaluate

if TYPE_CHECKING:
    from mlx_omnia.engine.core.layers import AttentionStep, RmsNorm


def _plain_norm(norm: RmsNorm | None, dims: int) -> bool:
    from mlx_omnia.engine.core.layers import RmsNorm

    return norm is None or (type(norm) is RmsNorm and norm.weight.shape == (dims,))


def attention_spec(decl: AttentionStep, dtype: mx.Dtype, capacity: int) -> AttentionStepSpec:
    return AttentionStepSpec(
        dtype=dtype, n_heads=decl.n_heads, n_kv_heads=decl.n_kv_heads, head_dim=decl.head_dim,
        capacity=capacity, scale=decl.scale,
        q_eps=None if decl.q_norm is None else decl.q_norm.eps,
        k_eps=None if decl.k_norm is None else decl.k_norm.eps,
        traditional=decl.rope.traditional if decl.rope is not None else False,
    )


def attention_applies(decl: AttentionStep) -> bool:
    return cuda_backend() and attention_fits(decl)


def attention_fits(decl: AttentionStep) -> bool:
    """Every declared property is one the kernel computes (the backend aside)."""
    from mlx_omnia.engine.core.layers import Rope

    rope = decl.rope
    return (
        decl.window is None
        and decl.softcap is None
        and decl.value_dim == decl.head_dim
        and type(rope) is Rope
        and rope.dims == decl.head_dim
        and rope.attention_factor == 1.0
        and _plain_norm(decl.q_norm, decl.head_dim)
        and _plain_norm(decl.k_norm, decl.head_dim)
        and spec_fits(attention_spec(decl, mx.bfloat16, StaticKVCache.step))
    )


def inverse_frequencies(decl: AttentionStep) -> mx.array:
    """scale / period of each rotated pair, in float32 (theta = position * this)."""
    rope = decl.rope
    assert rope is not None
    if rope.freqs is not None:
        periods = np.array(rope.freqs, dtype=np.float64)
    else:
        periods = rope.base ** (np.arange(0, rope.dims, 2, dtype=np.float64) / rope.dims)
    return mx.array((rope.scale / periods).astype(np.float32))


def attention_build(decl: AttentionStep) -> Callable[..., mx.array]:
    reference = decl.reference_project()
    inv_freq = inverse_frequencies(decl)
    # The kernel's slice counters, one per kv head: zero between launches (the last block of a
    # kv head resets its own); owned by this binding, written in place.
    counters = mx.zeros((decl.n_kv_heads,), dtype=mx.int32)
    evaluate(counters)
    calls: dict[
        tuple[mx.Dtype, int, tuple[int, ...]],
        Callable[[list[mx.array]], tuple[mx.array, mx.array]],
    ] = {}

    def project(q: mx.array, k: mx.array, v: mx.array, cache: Any) -> mx.array:
        if (
            not isinstance(cache, StaticKVCache)
            or q.shape[:2] != (1, 1)
            or q.dtype not in CUDA_TYPES
            or not (k.dtype == v.dtype == q.dtype == cache.state["keys"].dtype)
            or (decl.q_norm is not None and decl.q_norm.weight.dtype != q.dtype)
            or (decl.k_norm is not None and decl.k_norm.weight.dtype != q.dtype)
        ):
            return reference(q, k, v, cache)
        key = (q.dtype, cache.capacity, q.shape[:-1])
        run = calls.get(key)
        if run is None:
            spec = attention_spec(decl, q.dtype, cache.capacity)
            if not spec_fits(spec):
                return reference(q, k, v, cache)
            run = calls[key] = launcher(spec, key[2])
        pos = cache.state["offset"]
        inputs = [q, k, v]
        if decl.q_norm is not None:
            inputs.append(decl.q_norm.weight)
        if decl.k_norm is not None:
            inputs.append(decl.k_norm.weight)
        inputs += [inv_freq, cache.state["keys"], cache.state["values"], pos, counters]
        out, following = run(inputs)
        cache.advance(pos, following)
        return out

    return project


def implementation() -> Any:
    from mlx_omnia.engine.core.binding import Implementation

    return Implementation("attention_step_cuda", attention_applies, attention_build)
