"""CohereForCausalLM, module for module as the checkpoint names it.

Differs from llama in: LayerNorm without bias (mean-centred, in float32) instead of RMS norm;
one input norm feeding attention and MLP in parallel, both added to the residual; rope on
interleaved pairs (x0, x1), (x2, x3), ...; optional per-head LayerNorm of queries and keys; the
tied head's logits multiplied by logit_scale."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    Embedding,
    LayerNorm,
    Linear,
    PerHeadLayerNorm,
)
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.cohere.config import CohereConfig


class CohereAttention(nn.Module):
    def __init__(self, cfg: CohereConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.use_qk_norm = cfg.use_qk_norm
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.use_qk_norm:
            eps = cfg.layer_norm_eps
            self.q_norm = PerHeadLayerNorm(self.n_heads, self.head_dim, eps)
            self.k_norm = PerHeadLayerNorm(self.n_kv_heads, self.head_dim, eps)
        self.rope = build_rope(self.head_dim, cfg.rope, traditional=True)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = reshape(self.q_proj(x), b, length, self.n_heads, self.head_dim)
        k = reshape(self.k_proj(x), b, length, self.n_kv_heads, self.head_dim)
        v = reshape(self.v_proj(x), b, length, self.n_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class CohereMLP(nn.Module):
    def __init__(self, cfg: CohereConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: CohereConfig) -> None:
        super().__init__()
        self.self_attn = CohereAttention(cfg)
        self.mlp = CohereMLP(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, bias=False)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, cache) + self.mlp(h)


class CohereModel(nn.Module):
    def __init__(self, cfg: CohereConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [CohereDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, bias=False)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class CohereForCausalLM(nn.Module):
    def __init__(self, cfg: CohereConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = CohereModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return logits * self.config.logit_scale

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]
