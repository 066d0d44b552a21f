"""Lfm2ForCausalLM, module for module as the checkpoint names it.

A decoder layer is `operator_norm`, then its operator, a residual, then `ffn_norm`, the SwiGLU
`feed_forward` (w2(silu(w1 x) * w3 x)) and a residual. The operator is attention (GQA with
per-head RMS norms q_layernorm / k_layernorm before rope) where `layer_types` says
full_attention, and elsewhere a gated short convolution:

    B, C, x = in_proj(h) split in three along the features
    y       = out_proj(C * conv(B * x))

with `conv` causal and depthwise over the last conv_L_cache tokens (core ShortConv: its state
holds the last conv_L_cache - 1 gated inputs). The final norm is `embedding_norm`."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.recurrent import ShortConv, State
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.lfm2.config import Lfm2Config

LayerCache = KVCache | State  # an attention layer's, a convolution's


class Lfm2Attention(nn.Module):
    def __init__(self, cfg: Lfm2Config) -> None:
        super().__init__()
        heads, kv_heads, dims = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, heads * dims)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * dims)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * dims)
        self.out_proj = Linear(heads * dims, cfg.hidden_size)
        self.q_layernorm = RmsNorm(dims, cfg.norm_eps)
        self.k_layernorm = RmsNorm(dims, cfg.norm_eps)
        self.rope = build_rope(dims, cfg.rope)
        self.attention = AttentionStep(
            n_heads=heads, n_kv_heads=kv_heads, head_dim=dims,
            q_norm=self.q_layernorm, k_norm=self.k_layernorm, rope=self.rope,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.out_proj(self.attention(q, k, v, cache))


class Lfm2ShortConv(nn.Module):
    def __init__(self, cfg: Lfm2Config) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.in_proj = Linear(hidden, 3 * hidden, bias=cfg.conv_bias)
        self.conv = ShortConv(hidden, cfg.conv_kernel, bias=cfg.conv_bias)
        self.out_proj = Linear(hidden, hidden, bias=cfg.conv_bias)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, c, h = mx.split(self.in_proj(x), 3, axis=-1)
        return self.out_proj(c * self.conv(b * h, state))


class Lfm2MLP(nn.Module):
    def __init__(self, cfg: Lfm2Config) -> None:
        super().__init__()
        self.w1 = Linear(cfg.hidden_size, cfg.feed_forward_size)
        self.w3 = Linear(cfg.hidden_size, cfg.feed_forward_size)
        self.w2 = Linear(cfg.feed_forward_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: Lfm2Config, kind: str) -> None:
        super().__init__()
        self.attends = kind == "full_attention"
        if self.attends:
            self.self_attn = Lfm2Attention(cfg)
        else:
            self.conv = Lfm2ShortConv(cfg)
        self.feed_forward = Lfm2MLP(cfg)
        self.operator_norm = RmsNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RmsNorm(cfg.hidden_size, cfg.norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        normed = self.operator_norm(x)
        if self.attends:
            h = x + self.self_attn(normed, cast(KVCache | None, cache))
        else:
            h = x + self.conv(normed, cast(State | None, cache))
        return h + self.feed_forward(self.ffn_norm(h))

    def make_cache(self) -> LayerCache:
        return KVCache() if self.attends else RecurrentState((self.conv.conv.name,))


class Lfm2Model(nn.Module):
    def __init__(self, cfg: Lfm2Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Lfm2DecoderLayer(cfg, kind) for kind in cfg.layer_types]
        self.embedding_norm = RmsNorm(cfg.hidden_size, cfg.norm_eps)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.embedding_norm(h)


class Lfm2ForCausalLM(nn.Module):
    def __init__(self, cfg: Lfm2Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Lfm2Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[LayerCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[LayerCache]:
        """Keys and values for each attention layer, a RecurrentState for each convolution."""
        return [layer.make_cache() for layer in self.model.layers]
