"""Starcoder2ForCausalLM, module for module as the checkpoint names it.

LayerNorms with bias (not RMS norms), biases on every projection (use_bias), a two-matrix
GELU(tanh) MLP (c_fc, c_proj), and sliding-window attention."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import gelu_tanh
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, LayerNorm, Linear
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.starcoder2.config import Starcoder2Config


class Starcoder2Attention(nn.Module):
    def __init__(self, cfg: Starcoder2Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.use_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.rope = build_rope(self.head_dim, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            window=cfg.sliding_window,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = reshape(self.q_proj(x), b, length, self.n_heads, -1).swapaxes(1, 2)
        k = reshape(self.k_proj(x), b, length, self.n_kv_heads, -1).swapaxes(1, 2)
        v = reshape(self.v_proj(x), b, length, self.n_kv_heads, -1).swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: Starcoder2Config) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.use_bias)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.use_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, cfg: Starcoder2Config) -> None:
        super().__init__()
        self.self_attn = Starcoder2Attention(cfg)
        self.mlp = Starcoder2MLP(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_epsilon)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Starcoder2Model(nn.Module):
    def __init__(self, cfg: Starcoder2Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Starcoder2DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = LayerNorm(cfg.hidden_size, cfg.norm_epsilon)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Starcoder2ForCausalLM(nn.Module):
    def __init__(self, cfg: Starcoder2Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Starcoder2Model(cfg)
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
