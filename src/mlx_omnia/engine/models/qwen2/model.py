"""Qwen2ForCausalLM, module for module as the checkpoint names it.

Differs from llama in the attention projections: q/k/v carry a bias, o_proj none."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.fusion import (
    NORM_INTO_PROJECTIONS,
    PROJECTION_INTO_PROJECTIONS,
    RESIDUAL_INTO_PROJECTION,
    Fusions,
)
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.qwen2.config import Qwen2Config

# The neighbours that run as one launch where a kernel computes them (the binding pass finds
# them in the forwards marked FUSED; docs/kernels.md): input_layernorm and q/k/v; o_proj with the
# residual, then post_attention_layernorm and gate/up; down_proj with the residual; the final
# norm and the head.
FUSED = Fusions(NORM_INTO_PROJECTIONS, RESIDUAL_INTO_PROJECTION, PROJECTION_INTO_PROJECTIONS)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rope = build_rope(self.head_dim, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            rope=self.rope,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attention(q, k, v, cache))


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @FUSED
    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen2DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        """The last layer's output (the head applies `norm`)."""
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return h


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen2Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        return self.logits(h[:, -1:] if last_only else h)

    @FUSED
    def logits(self, h: mx.array) -> mx.array:
        h = self.model.norm(h)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]
