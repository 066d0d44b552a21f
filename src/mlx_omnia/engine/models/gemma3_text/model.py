"""Gemma3ForCausalLM (text), module for module as the checkpoint names it.

Differs from Gemma 2 in: a (1 + weight) RMS norm over head_dim on every query and key head
(q_norm, k_norm) before rope; each layer kind has its own rope (sliding layers a local base,
global layers the global base, possibly linearly scaled); no attention soft-capping."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import gelu_tanh
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, OffsetRmsNorm
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.gemma3_text.config import Gemma3TextConfig


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig, layer_type: str) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope = build_rope(self.head_dim, cfg.rope[layer_type])
        self.attention = AttentionStep(
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            scale=cfg.query_pre_attn_scalar**-0.5,
            window=cfg.sliding_window if layer_type == "sliding_attention" else None,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = self.q_norm(reshape(self.q_proj(x), b, length, self.n_heads, self.head_dim))
        k = self.k_norm(reshape(self.k_proj(x), b, length, self.n_kv_heads, self.head_dim))
        v = reshape(self.v_proj(x), b, length, self.n_kv_heads, self.head_dim)
        q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig, layer_type: str) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_type)
        self.mlp = Gemma3MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRmsNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = OffsetRmsNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRmsNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRmsNorm(cfg.hidden_size, eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Gemma3DecoderLayer(cfg, kind) for kind in cfg.layer_types]
        self.norm = OffsetRmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        h = h * mx.array(self.embed_scale, dtype=h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Gemma3TextModel(cfg)
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
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]
