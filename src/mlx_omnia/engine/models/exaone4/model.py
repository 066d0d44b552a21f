"""Exaone4ForCausalLM, module for module as the checkpoint names it.

Like OLMo 2, each block normalizes its outputs (post_attention_layernorm,
post_feedforward_layernorm) instead of its inputs; unlike OLMo 2, q_norm/k_norm are RMS norms
of each head (over head_dim). Hybrid attention: sliding-window layers with rope, global layers
without any position embedding (see config.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.exaone4.config import Exaone4Config


class Exaone4Attention(nn.Module):
    def __init__(self, cfg: Exaone4Config, layer_type: str) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size)
        self.q_norm = RmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.use_rope = cfg.uses_rope(layer_type)
        self.rope = build_rope(self.head_dim, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            window=cfg.sliding_window if layer_type == "sliding_attention" else None,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = self.q_norm(reshape(self.q_proj(x), b, length, self.n_heads, -1)).swapaxes(1, 2)
        k = self.k_norm(reshape(self.k_proj(x), b, length, self.n_kv_heads, -1)).swapaxes(1, 2)
        v = reshape(self.v_proj(x), b, length, self.n_kv_heads, -1).swapaxes(1, 2)
        if self.use_rope:
            offset = cache.offset if cache is not None else 0
            q = self.rope(q, offset)
            k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class Exaone4MLP(nn.Module):
    def __init__(self, cfg: Exaone4Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Exaone4DecoderLayer(nn.Module):
    def __init__(self, cfg: Exaone4Config, layer_type: str) -> None:
        super().__init__()
        self.self_attn = Exaone4Attention(cfg, layer_type)
        self.mlp = Exaone4MLP(cfg)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(x, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Exaone4Model(nn.Module):
    def __init__(self, cfg: Exaone4Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Exaone4DecoderLayer(cfg, kind) for kind in cfg.layer_types]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Exaone4ForCausalLM(nn.Module):
    def __init__(self, cfg: Exaone4Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Exaone4Model(cfg)
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
