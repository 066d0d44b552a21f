"""Layer declarations shared by families: the arithmetic, not the structure (design rule 4).

Parameter names follow checkpoints (`weight`, `bias`, and MLX's `scales`/`biases` when quantized),
so a family's module tree is the checkpoint's tensor tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import mlx.core as mx

from mlx_omnia.engine.core.binding import Declaration, Declared
from mlx_omnia.engine.core.cache import (
    QUANTIZED_CACHES,
    KVCache,
    Mask,
    StaticKVCache,
    quantized_attention,
    visibility,
)
from mlx_omnia.engine.core.mxcompat import (
    drop_parameters,
    gelu_tanh_mul,
    reshape,
    silu_mul,
)

QuantMode = Literal["affine"]
Gate = Literal["silu", "gelu_tanh"]


class Linear(Declaration):
    """Qmv: y = x @ W.T (+ b) (+ residual), W dense or affine-quantized along the input
    dimension. `residual` declares what follows: the result is added to it (x + attn(x))."""


    weight: mx.array
    bias: mx.array
    scales: mx.array
    biases: mx.array

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False) -> None:
        super().__init__()
        self.input_dims = input_dims
        self.output_dims = output_dims
        self.weight = mx.zeros((output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.bits: int | None = None
        self.group_size: int | None = None
        self._bound: Callable[..., mx.array] = self.reference()

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def to_quantized(self, *, bits: int, group_size: int) -> None:
        """Declare affine quantization (placeholders; weights come from a checkpoint or `quantize`)."""
        packed = self.input_dims * bits // 32
        groups = self.input_dims // group_size
        self.weight = mx.zeros((self.output_dims, packed), dtype=mx.uint32)
        self.scales = mx.zeros((self.output_dims, groups))
        self.biases = mx.zeros((self.output_dims, groups))
        self.bits, self.group_size = bits, group_size

    def quantize_weights(self, *, bits: int, group_size: int) -> None:
        """Round-to-nearest affine quantization of the loaded dense weight."""
        w, scales, biases = mx.quantize(self.weight, group_size=group_size, bits=bits)
        self.weight, self.scales, self.biases = w, scales, biases
        self.bits, self.group_size = bits, group_size

    def dequantize_weights(self, dtype: mx.Dtype = mx.float32) -> None:
        """Expand quantized weights to dense `dtype` (the CPU's fast path)."""
        if not self.quantized:
            self.weight = self.weight.astype(dtype)
            return
        self.weight = mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        ).astype(dtype)
        drop_parameters(self, "scales", "biases")
        self.bits = self.group_size = None

    def dense_weight(self, dtype: mx.Dtype) -> mx.array:
        """W [output_dims, input_dims] as a dense `dtype` matrix (dequantized when quantized),
        for a family that multiplies by W other than as x @ W.T (MLA's absorbed kv_b_proj)."""
        if not self.quantized:
            return self.weight.astype(dtype)
        return mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits,
            dtype=dtype,
        )

    def reference(self, *, dequantized_rows: int | None = None) -> Callable[..., mx.array]:
        """The core call. `dequantized_rows`: a call with at least that many rows (a prefill
        chunk) multiplies by the weight dequantized to the input's dtype instead (the same
        products: where quantized_matmul dequantizes in its kernel, here a whole matrix first,
        which a backend may run far faster for many rows)."""
        if self.quantized:
            bits, group_size = self.bits, self.group_size

            def qmm(x: mx.array, residual: mx.array | None = None) -> mx.array:
                if dequantized_rows is not None and x.size // x.shape[-1] >= dequantized_rows:
                    w = mx.dequantize(
                        self.weight, self.scales, self.biases, group_size=group_size, bits=bits,
                        dtype=x.dtype,
                    )
                    y = x @ w.T
                else:
                    y = mx.quantized_matmul(
                        x, self.weight, self.scales, self.biases,
                        transpose=True, group_size=group_size, bits=bits,
                    )
                y = y + self.bias if "bias" in self else y
                return y if residual is None else residual + y

            return qmm

        def mm(x: mx.array, residual: mx.array | None = None) -> mx.array:
            y = mx.addmm(self.bias, x, self.weight.T) if "bias" in self else x @ self.weight.T
            return y if residual is None else residual + y

        return mm

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        if residual is None:
            return self._bound(x)
        return self._bound(x, residual)


class Embedding(Declaration):
    """Embed: rows of a (possibly quantized) table; `as_linear` is the tied LM head."""

    weight: mx.array
    scales: mx.array
    biases: mx.array

    def __init__(self, num_embeddings: int, dims: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.dims = dims
        self.weight = mx.zeros((num_embeddings, dims))
        self.bits: int | None = None
        self.group_size: int | None = None
        self._bound: Callable[[mx.array], mx.array] = self.reference()
        self._head: Callable[[mx.array], mx.array] = self._matmul

    # what a traced forward records: the rows (`_bound`) and the tied head (`_head`)
    entries = ("_bound", "_head")

    def traced_call(self, entry: str) -> Callable[..., mx.array]:
        return self.as_linear if entry == "_head" else self

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def to_quantized(self, *, bits: int, group_size: int) -> None:
        self.weight = mx.zeros((self.num_embeddings, self.dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((self.num_embeddings, self.dims // group_size))
        self.biases = mx.zeros((self.num_embeddings, self.dims // group_size))
        self.bits, self.group_size = bits, group_size

    def quantize_weights(self, *, bits: int, group_size: int) -> None:
        w, scales, biases = mx.quantize(self.weight, group_size=group_size, bits=bits)
        self.weight, self.scales, self.biases = w, scales, biases
        self.bits, self.group_size = bits, group_size

    def dequantize_weights(self, dtype: mx.Dtype = mx.float32) -> None:
        if not self.quantized:
            self.weight = self.weight.astype(dtype)
            return
        self.weight = mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        ).astype(dtype)
        drop_parameters(self, "scales", "biases")
        self.bits = self.group_size = None

    def reference(self) -> Callable[[mx.array], mx.array]:
        if self.quantized:
            bits, group_size = self.bits, self.group_size

            def rows_q(ids: mx.array) -> mx.array:
                return mx.dequantize(
                    self.weight[ids], self.scales[ids], self.biases[ids],
                    group_size=group_size, bits=bits,
                )

            return rows_q
        def rows(ids: mx.array) -> mx.array:
            return self.weight[ids]

        return rows

    def __call__(self, ids: mx.array) -> mx.array:
        return self._bound(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        """LmHead for tied embeddings: x @ E.T."""
        return self._head(x)

    def _matmul(self, x: mx.array) -> mx.array:
        if self.quantized:
            return mx.quantized_matmul(
                x, self.weight, self.scales, self.biases,
                transpose=True, group_size=self.group_size, bits=self.bits,
            )
        return x @ self.weight.T


class RmsNorm(Declaration):
    """RMS normalization: x / rms(x) * weight."""

    weight: mx.array

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self._bound: Callable[[mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array], mx.array]:
        return lambda x: mx.fast.rms_norm(x, self.weight, self.eps)

    def __call__(self, x: mx.array) -> mx.array:
        return self._bound(x)


class OffsetRmsNorm(Declaration):
    """RMS normalization scaled by (1 + weight), computed in float32 and cast back to the input
    dtype: the checkpoint stores the zero-centred `weight` (Gemma's convention)."""

    weight: mx.array

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps
        self._bound: Callable[[mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array], mx.array]:
        def norm(x: mx.array) -> mx.array:
            scale = 1.0 + self.weight.astype(mx.float32)
            return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)

        return norm

    def __call__(self, x: mx.array) -> mx.array:
        return self._bound(x)


class PerHeadLayerNorm(Declaration):
    """Layer normalization of each head's features with a weight per head (shape [heads, dims]),
    no bias, computed in float32 and cast back: (x - mean) / sqrt(var + eps) * weight[head], for
    x [..., heads, dims] (Cohere's query/key norm)."""

    weight: mx.array

    def __init__(self, heads: int, dims: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = mx.ones((heads, dims))
        self.eps = eps
        self._bound: Callable[[mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array], mx.array]:
        def norm(x: mx.array) -> mx.array:
            y = mx.fast.layer_norm(x.astype(mx.float32), None, None, self.eps)
            return (y * self.weight.astype(mx.float32)).astype(x.dtype)

        return norm

    def __call__(self, x: mx.array) -> mx.array:
        return self._bound(x)


class Rope(Declaration):
    """Rotary position embedding over the first `dims` features (rotate-half layout unless
    `traditional`), with frequencies from `base` or an explicit `freqs` table (scaled kinds)."""

    def __init__(
        self,
        dims: int,
        *,
        base: float,
        scale: float = 1.0,
        traditional: bool = False,
        freqs: mx.array | None = None,
        attention_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.base = base
        self.scale = scale
        self.traditional = traditional
        # Kept out of the parameter tree: derived from the config, never loaded.
        self._freqs = freqs
        self.attention_factor = attention_factor
        self._bound: Callable[[mx.array, int], mx.array] = self.reference()

    @property
    def freqs(self) -> mx.array | None:
        """Per-pair periods of scaled kinds (None: derived from `base`)."""
        return self._freqs

    def reference(self) -> Callable[[mx.array, int], mx.array]:
        freqs = self._freqs
        factor = self.attention_factor

        def rope(x: mx.array, offset: int) -> mx.array:
            if factor != 1.0:
                # The attention factor scales cos and sin: the rotated features only.
                if self.dims < x.shape[-1]:
                    x = mx.concatenate([x[..., : self.dims] * factor, x[..., self.dims :]], -1)
                else:
                    x = x * factor
            return mx.fast.rope(
                x, self.dims, traditional=self.traditional,
                base=None if freqs is not None else self.base,
                scale=self.scale, offset=offset, freqs=freqs,
            )

        return rope

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        return self._bound(x, offset)


class AttentionStep(Declaration):
    """Append this step's keys/values to the cache, then causal scaled-dot-product attention.

    Called on a layer's flat projections q [B, L, H*D] and k, v [B, L, Hkv*D], it is the whole
    attention: per-head `q_norm` / `k_norm` (when declared), `rope` at the cache's offset, the
    cache append, this attention, heads merged back to [B, L, H*Dv]. The norms and the rope are
    the family's modules (declared here, not owned: the checkpoint names them where they are).
    `attend` is the attention alone, of heads a family normed and rotated itself: q [B, H, L, D];
    k, v [B, Hkv, L, D] (grouped-query when n_kv_heads < n_heads).

    `window`: sliding-window attention, a query sees itself and the `window - 1` keys before it
    (transformers' convention). `softcap`: scores become tanh(s / softcap) * softcap before the
    softmax (Gemma 2). `sinks`: per-head logits that join every softmax and take probability mass
    without contributing a value (gpt-oss)."""

    def __init__(
        self,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        value_dim: int | None = None,
        q_norm: RmsNorm | None = None,
        k_norm: RmsNorm | None = None,
        rope: Rope | None = None,
    ) -> None:
        super().__init__()
        self._q_norm = Declared(q_norm)
        self._k_norm = Declared(k_norm)
        self._rope = Declared(rope)
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.value_dim = value_dim if value_dim is not None else head_dim
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.window = window
        self.softcap = softcap
        self._attend = self._core_attend()
        self._bound: Callable[..., mx.array] = self.reference()

    @property
    def q_norm(self) -> RmsNorm | None:
        return self._q_norm.value

    @property
    def k_norm(self) -> RmsNorm | None:
        return self._k_norm.value

    @property
    def rope(self) -> Rope | None:
        return self._rope.value

    def reference(self) -> Callable[..., mx.array]:
        return self.reference_project()

    def reference_project(
        self, attend: Callable[..., mx.array] | None = None
    ) -> Callable[..., mx.array]:
        """The core attention of flat projections: the ops a family would write itself.
        `attend`: what attends the normed and rotated heads (q [B, H, L, D], k, v, cache), in
        place of the core's (a kernel's, handing the core anything it does not compute)."""
        heads, kv_heads, dims, vdims = self.n_heads, self.n_kv_heads, self.head_dim, self.value_dim
        attend_heads = attend if attend is not None else self._attend

        def project(
            q: mx.array, k: mx.array, v: mx.array, cache: KVCache | StaticKVCache | None
        ) -> mx.array:
            b, length, _ = q.shape
            q = reshape(q, b, length, heads, dims)
            k = reshape(k, b, length, kv_heads, dims)
            v = reshape(v, b, length, kv_heads, vdims)
            if self.q_norm is not None:
                q = self.q_norm(q)
            if self.k_norm is not None:
                k = self.k_norm(k)
            q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
            if self.rope is not None:
                offset = cache.offset if cache is not None else 0
                q = self.rope(q, offset)  # pyright: ignore[reportArgumentType]  # array offsets too
                k = self.rope(k, offset)  # pyright: ignore[reportArgumentType]
            out = attend_heads(q, k, v, cache)
            return reshape(out.swapaxes(1, 2), b, length, heads * vdims)

        return project

    def core_attend(self) -> Callable[..., mx.array]:
        """The core's attention of normed and rotated heads (what reference_project calls)."""
        return self._attend

    def _core_attend(self) -> Callable[..., mx.array]:
        scale, softcap = self.scale, self.softcap
        repeats = self.n_heads // self.n_kv_heads

        def attend(
            q: mx.array, k: mx.array, v: mx.array, cache: KVCache | StaticKVCache | None,
            sinks: mx.array | None = None,
        ) -> mx.array:
            length = q.shape[2]
            if isinstance(cache, QUANTIZED_CACHES):
                qk, qv = cache.update_and_fetch_quantized(k, v)
                mask: Mask = cache.attention_mask(length, qk[0].shape[2], self.window)
                if length == 1:  # a decode step reads the codes (half or a quarter the bytes)
                    return quantized_attention(
                        q, qk, qv, cache.format, scale=scale, mask=mask, sinks=sinks,
                        softcap=softcap,
                    )
                # a prefill chunk's many queries: the same arithmetic over the dequantized
                # rows, through the fused attention (no [L, T] scores of quantized matmuls)
                k, v = cache.format.dequantize(qk, q.dtype), cache.format.dequantize(qv, q.dtype)
            elif cache is not None:
                k, v = cache.update_and_fetch(k, v)
                mask = cache.attention_mask(length, k.shape[2], self.window)
            elif self.window is None:
                mask = "causal" if length > 1 else None
            else:
                mask = visibility(k.shape[2] - length, length, k.shape[2], self.window)
            if softcap is None:
                return mx.fast.scaled_dot_product_attention(
                    q, k, v, scale=scale, mask=mask, sinks=sinks
                )
            # Soft-capped scores cannot go through the fused kernel: spell it out in float32.
            if repeats > 1:
                k = mx.repeat(k, repeats, axis=1)
                v = mx.repeat(v, repeats, axis=1)
            scores = (q.astype(mx.float32) * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
            scores = mx.tanh(scores / softcap) * softcap
            if mask == "causal":
                mask = visibility(k.shape[2] - length, length, k.shape[2], None)
            if isinstance(mask, mx.array):
                scores = mx.where(mask, scores, -mx.inf)
            if sinks is not None:
                sink = mx.broadcast_to(
                    sinks.astype(mx.float32)[None, :, None, None], (*scores.shape[:-1], 1)
                )
                weights = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:]
            else:
                weights = mx.softmax(scores, axis=-1)
            return (weights @ v.astype(mx.float32)).astype(q.dtype)

        return attend

    def __call__(
        self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache | StaticKVCache | None
    ) -> mx.array:
        """The attention of flat projections q [B, L, H*D], k, v [B, L, Hkv*D]."""
        return self._bound(q, k, v, cache)

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache | StaticKVCache | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention of normed, rotated heads q [B, H, L, D], k, v [B, Hkv, L, D] (the core)."""
        if sinks is None:
            return self._attend(q, k, v, cache)
        return self._attend(q, k, v, cache, sinks)


class LayerNorm(Declaration):
    """Layer normalization: (x - mean(x)) / sqrt(var(x) + eps) * weight (+ bias)."""

    weight: mx.array
    bias: mx.array

    def __init__(self, dims: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        if bias:
            self.bias = mx.zeros((dims,))
        self.eps = eps
        self._bound: Callable[[mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array], mx.array]:
        return lambda x: mx.fast.layer_norm(
            x, self.weight, self.bias if "bias" in self else None, self.eps
        )

    def __call__(self, x: mx.array) -> mx.array:
        return self._bound(x)


class Projections(Declaration):
    """Several projections of one input: the attention's q/k/v, an MLP's gate/up, a head.

    The family lists its own Linears (or an Embedding used as the tied LM head) and, when they
    read a normalized input, the RmsNorm before them; with `gate`, two projections combine into
    act(first) * second. Returns the projections' outputs (one, when gated). The binding pass
    builds it where a family's table fuses the norm into the projections (core/fusion.py); it
    names the family's modules without owning them."""

    def __init__(
        self, matrices: Sequence[Linear | Embedding], *, norm: RmsNorm | None = None,
        gate: Gate | None = None,
    ) -> None:
        super().__init__()
        if gate is not None and len(matrices) != 2:
            raise ValueError("a gated Projections combines exactly two projections")
        self._matrices = Declared(tuple(matrices))
        self._norm = Declared(norm)
        self.gate: Gate | None = gate
        self._bound: Callable[[mx.array], tuple[mx.array, ...]] = self.reference()

    @property
    def matrices(self) -> tuple[Linear | Embedding, ...]:
        return self._matrices.value

    @property
    def norm(self) -> RmsNorm | None:
        return self._norm.value

    def reference(self) -> Callable[[mx.array], tuple[mx.array, ...]]:
        def run(x: mx.array) -> tuple[mx.array, ...]:
            h = self.norm(x) if self.norm is not None else x
            outs = [m.as_linear(h) if isinstance(m, Embedding) else m(h) for m in self.matrices]
            if self.gate == "silu":
                return (silu_mul(outs[0], outs[1]),)
            if self.gate == "gelu_tanh":
                return (gelu_tanh_mul(outs[0], outs[1]),)
            return tuple(outs)

        return run

    def __call__(self, x: mx.array) -> tuple[mx.array, ...]:
        return self._bound(x)


class ProjectAttend(Declaration):
    """A layer's q/k/v projections (after its norm), then the attention step of them: (x [..., in],
    cache) -> the attention's output [..., n_heads * head_dim]. Declares the two in the order
    they run, so a kernel may run both in one launch; each keeps its own binding for what the
    pair's kernel declines. Built by the binding pass (core/fusion.py); owns neither."""

    def __init__(self, qkv: Projections, attention: AttentionStep) -> None:
        super().__init__()
        self._qkv = Declared(qkv)
        self._attention = Declared(attention)
        self._bound: Callable[[mx.array, KVCache | StaticKVCache | None], mx.array] = self.reference()

    @property
    def qkv(self) -> Projections:
        return self._qkv.value

    @property
    def attention(self) -> AttentionStep:
        return self._attention.value

    def reference(self) -> Callable[[mx.array, KVCache | StaticKVCache | None], mx.array]:
        qkv, attention = self.qkv, self.attention

        def project_attend(x: mx.array, cache: KVCache | StaticKVCache | None) -> mx.array:
            q, k, v = qkv(x)
            return attention(q, k, v, cache)

        return project_attend

    def __call__(self, x: mx.array, cache: KVCache | StaticKVCache | None) -> mx.array:
        return self._bound(x, cache)


class ChainedProjections(Declaration):
    """A projection with its residual, then projections of the sum: (a [..., in], residual
    [..., out]) -> (h = residual + project(a), *then(h)); an attention's o_proj, then the MLP's
    gate/up after the layer's norm. Declares the two in the order they run, so a kernel may run
    both in one launch; each keeps its own binding for what the pair's kernel declines. Built by
    the binding pass (core/fusion.py); owns neither."""

    def __init__(self, project: Linear, then: Projections) -> None:
        super().__init__()
        self._project = Declared(project)
        self._then = Declared(then)
        self._bound: Callable[[mx.array, mx.array], tuple[mx.array, ...]] = self.reference()

    @property
    def project(self) -> Linear:
        return self._project.value

    @property
    def then(self) -> Projections:
        return self._then.value

    def reference(self) -> Callable[[mx.array, mx.array], tuple[mx.array, ...]]:
        project, then = self.project, self.then

        def chained(a: mx.array, residual: mx.array) -> tuple[mx.array, ...]:
            h = project(a, residual=residual)
            return (h, *then(h))

        return chained

    def __call__(self, a: mx.array, residual: mx.array) -> tuple[mx.array, ...]:
        return self._bound(a, residual)
