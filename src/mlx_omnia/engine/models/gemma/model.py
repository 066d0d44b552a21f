"""GemmaForCausalLM, module for module as the checkpoint names it.

Differs from llama in: RMS norms scale by (1 + weight), in float32; the embedding is multiplied
by sqrt(hidden_size) rounded to the model dtype; the MLP gate is GELU (tanh approximation); the
LM head is the tied embedding (as in every released Gemma)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import gelu_tanh
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, OffsetRmsNorm
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.gemma.config import GemmaConfig


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.rope = build_rope(self.head_dim, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = reshape(self.q_proj(x), b, length, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = reshape(self.k_proj(x), b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        v = reshape(self.v_proj(x), b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = OffsetRmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class GemmaModel(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [GemmaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = OffsetRmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        h = h * mx.array(self.embed_scale, dtype=h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class GemmaForCausalLM(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = GemmaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]
