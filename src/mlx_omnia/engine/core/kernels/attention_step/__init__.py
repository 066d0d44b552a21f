"""The decode attention kernel bound to AttentionStep (and ProjectAttend) declarations: a
predicate accepts only what the kernel computes exactly (docs/kernels.md lists what it
declines), and `project` runs one token on a StaticKVCache, handing anything else to the core."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_omnia.engine.core.binding import register
from mlx_omnia.engine.core.cache import PARTS, BatchRows, StaticKVCache, StaticQuantizedKVCache
from mlx_omnia.engine.core.kernels import CudaKernel, launch_counters, launch_scratch
from mlx_omnia.engine.core.kernels.attention_step.cuda import (
    MAX_BATCH_ROWS,
    MAX_HEAD_SPLIT,
    AttentionStepSpec,
    CodesSpec,
    codes_fits,
    codes_launcher,
    launcher,
    partials_bytes,
    project_attend_fits,
    project_attend_launcher,
    project_attend_scratch_bytes,
    rows_launcher,
    spec_fits,
)
from mlx_omnia.engine.core.kernels.cuda_common import CUDA_TYPES
from mlx_omnia.engine.core.kernels.qmv import matrix_inputs, projections_spec
from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec
from mlx_omnia.engine.core.layers import AttentionStep, ProjectAttend, RmsNorm, Rope
from mlx_omnia.engine.core.mxcompat import evaluate


def _plain_norm(norm: RmsNorm | None, dims: int) -> bool:
    return norm is None or (type(norm) is RmsNorm and norm.weight.shape == (dims,))


def attention_spec(decl: AttentionStep, dtype: mx.Dtype, capacity: int) -> AttentionStepSpec:
    """The launch geometry of `decl`: a slice's query heads split over two blocks wherever the
    group is even, else one block a slice; the same bits either way, and the split is faster
    (fewer registers, more blocks; docs/kernels.md, "Head split")."""
    spec = AttentionStepSpec(
        dtype=dtype, n_heads=decl.n_heads, n_kv_heads=decl.n_kv_heads, head_dim=decl.head_dim,
        capacity=capacity, scale=decl.scale,
        q_eps=None if decl.q_norm is None else decl.q_norm.eps,
        k_eps=None if decl.k_norm is None else decl.k_norm.eps,
        traditional=decl.rope.traditional if decl.rope is not None else False,
    )
    split = replace(spec, head_split=2)
    return split if spec_fits(split) else spec


def attention_fits(decl: AttentionStep) -> bool:
    """Every declared property is one the kernel computes (the backend aside)."""
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


class AttentionStepKernel(CudaKernel[AttentionStep]):
    """Head norms, rope, the cache append and the attention of one token, in one launch."""

    name = "attention_step_cuda"
    declaration = AttentionStep

    def fits(self, decl: AttentionStep) -> bool:
        return attention_fits(decl)

    def build(self, decl: AttentionStep) -> Callable[..., mx.array]:
        reference = decl.reference_project()
        inv_freq = inverse_frequencies(decl)
        # The kernel's slice counters, one per kv head and head split: zero between launches (the
        # last block of a kv head resets its own); owned by this binding, written in place.
        counters = launch_counters(decl.n_kv_heads * MAX_HEAD_SPLIT)
        evaluate(counters)
        # the partials at any capacity, taken before any launch is traced (launch_scratch)
        scratch = launch_scratch(partials_bytes(decl.n_heads, decl.head_dim))
        calls: dict[
            tuple[mx.Dtype, int, tuple[int, ...]],
            Callable[..., tuple[mx.array, mx.array]],
        ] = {}

        # the same for a batch's rows: one set per row
        row_counters = launch_counters(MAX_BATCH_ROWS * decl.n_kv_heads * MAX_HEAD_SPLIT)
        evaluate(row_counters)
        codes = codes_project(decl, scratch)

        def project(q: mx.array, k: mx.array, v: mx.array, cache: Any) -> mx.array:
            if isinstance(cache, BatchRows):
                return batch_rows(q, k, v, cache)
            if isinstance(cache, StaticQuantizedKVCache):
                return codes(q, k, v, cache)
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
            out, following = run([q, k, v, *cache_inputs(decl, inv_freq, cache), counters], scratch)
            cache.advance(pos, following)
            return out

        def batch_rows(q: mx.array, k: mx.array, v: mx.array, cache: BatchRows) -> mx.array:
            """A batch's rows, one token each: one launch, every row at its own offset."""
            rows = q.shape[0]
            if (
                q.ndim != 3 or q.shape[1] != 1 or not 1 <= rows <= MAX_BATCH_ROWS
                or q.dtype not in CUDA_TYPES
                or not (k.dtype == v.dtype == q.dtype == cache.keys.dtype == cache.values.dtype)
                or cache.keys.shape[0] != rows
                or (decl.q_norm is not None and decl.q_norm.weight.dtype != q.dtype)
                or (decl.k_norm is not None and decl.k_norm.weight.dtype != q.dtype)
            ):
                return reference(q, k, v, cache)
            spec = attention_spec(decl, q.dtype, cache.keys.shape[2])
            if not spec_fits(spec):
                return reference(q, k, v, cache)
            norms = [n.weight for n in (decl.q_norm, decl.k_norm) if n is not None]
            out = rows_launcher(spec, rows)(
                [q, k, v, *norms, inv_freq, cache.keys, cache.values, cache.offset, row_counters]
            )
            cache.advance()
            return out

        return project


def codes_spec(decl: AttentionStep, q: mx.array, cache: StaticQuantizedKVCache) -> CodesSpec:
    """The codes launch's geometry: the query heads of a slice split over two blocks wherever
    the group is even (as attention_spec)."""
    spec = CodesSpec(
        dtype=q.dtype, n_heads=decl.n_heads, n_kv_heads=decl.n_kv_heads, head_dim=decl.head_dim,
        capacity=cache.capacity, scale=decl.scale, bits=cache.format.bits,
        group_size=cache.format.group_size,
    )
    split = replace(spec, head_split=2)
    return split if codes_fits(split) else spec


def codes_project(decl: AttentionStep, scratch: mx.array) -> Callable[..., mx.array]:
    """One token on a StaticQuantizedKVCache: the core's head norms, rope and append of the
    quantized row, then one launch attending over the codes (attention_codes.cuh) instead of
    the core's two quantized matmuls; anything else is the core's."""
    core = decl.core_attend()
    counters = launch_counters(decl.n_kv_heads * MAX_HEAD_SPLIT)
    evaluate(counters)

    def attend(q: mx.array, k: mx.array, v: mx.array, cache: Any) -> mx.array:
        if (
            not isinstance(cache, StaticQuantizedKVCache)
            or q.shape[0] != 1 or q.shape[2] != 1
            or q.dtype not in CUDA_TYPES
            or cache.state["keys_scales"].dtype != q.dtype
        ):
            return core(q, k, v, cache)
        spec = codes_spec(decl, q, cache)
        if not codes_fits(spec):
            return core(q, k, v, cache)
        cache.update_and_fetch_quantized(k, v)
        state = cache.state
        parts = [state[name] for name in PARTS]
        out = codes_launcher(spec)([q, *parts, state["offset"], counters], scratch)
        return mx.reshape(out, q.shape)

    return decl.reference_project(attend)


def cache_inputs(decl: AttentionStep, inv_freq: mx.array, cache: StaticKVCache) -> list[mx.array]:
    """The kernel's inputs between q, k, v and its counters: the head norms' weights (when
    declared), the rope frequencies, the cache's buffers and offset."""
    norms = [n.weight for n in (decl.q_norm, decl.k_norm) if n is not None]
    return [*norms, inv_freq, cache.state["keys"], cache.state["values"], cache.state["offset"]]


# -- ProjectAttend: the q/k/v projections and the attention in one launch --------------------
def project_attend_qkv(decl: ProjectAttend) -> QmvSpec | None:
    """The q/k/v projections' qmv spec, when the qmv kernel computes them."""
    return projections_spec(decl.qkv)


class ProjectAttendKernel(CudaKernel[ProjectAttend]):
    """The q/k/v projections of one token, then its attention step, in one launch."""

    name = "project_attend_cuda"
    declaration = ProjectAttend
    chained = True

    def fits(self, decl: ProjectAttend) -> bool:
        """Every declared property is one the kernel computes (the backend aside): each half alone,
        the head norms in the activation dtype, and the pair in one launch at the smallest cache
        (the capacity is checked again per call)."""
        qkv = project_attend_qkv(decl)
        if qkv is None or not attention_fits(decl.attention):
            return False
        norms = (decl.attention.q_norm, decl.attention.k_norm)
        if any(n is not None and n.weight.dtype != qkv.dtype for n in norms):
            return False
        spec = attention_spec(decl.attention, qkv.dtype, StaticKVCache.step)
        return project_attend_fits(qkv, spec)

    def build(self, decl: ProjectAttend) -> Callable[[mx.array, Any], mx.array]:
        """One launch for one token on a StaticKVCache; anything else goes through the projections'
        and the attention's own bindings."""
        qkv = project_attend_qkv(decl)
        assert qkv is not None
        separate = decl.reference()
        attention = decl.attention
        inv_freq = inverse_frequencies(attention)
        # Both counter arrays are written in place and left zero by each launch: owned here.
        heads = launch_counters(attention.n_kv_heads * MAX_HEAD_SPLIT)
        counters = launch_counters(3)
        evaluate(heads, counters)
        # q, k, v and the partials at any capacity, taken before any launch is traced
        scratch = launch_scratch(project_attend_scratch_bytes(
            attention.n_heads, attention.n_kv_heads, attention.head_dim))
        calls: dict[
            tuple[int, tuple[int, ...]], Callable[..., tuple[mx.array, mx.array]]
        ] = {}

        def run(x: mx.array, cache: Any) -> mx.array:
            if (
                not isinstance(cache, StaticKVCache)
                or x.shape[:2] != (1, 1)
                or x.size != qkv.k
                or x.dtype != qkv.dtype
                or cache.state["keys"].dtype != qkv.dtype
                or cache.state["values"].dtype != qkv.dtype
            ):
                return separate(x, cache)
            key = (cache.capacity, x.shape[:-1])
            call = calls.get(key)
            if call is None:
                spec = attention_spec(attention, qkv.dtype, cache.capacity)
                if not project_attend_fits(qkv, spec):
                    return separate(x, cache)
                call = calls[key] = project_attend_launcher(qkv, spec, key[1])
            pos = cache.state["offset"]
            inputs: list[mx.array] = [x]
            for m in decl.qkv.matrices:
                inputs += matrix_inputs(m)
            if decl.qkv.norm is not None:
                inputs.append(decl.qkv.norm.weight)
            out, following = call([*inputs, *cache_inputs(attention, inv_freq, cache), heads, counters],
                                  scratch)
            cache.advance(pos, following)
            return out

        return run


ATTENTION_STEP = AttentionStepKernel()
PROJECT_ATTEND = ProjectAttendKernel()
register(ATTENTION_STEP)
register(PROJECT_ATTEND)
