"""Qwen3ForCausalLM, module for module as the checkpoint names it.

Differs from llama in the attention: an RMS norm over head_dim (q_norm, k_norm) on every query
and key head before rope, and head_dim is the config's, not hidden_size / heads."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    ChainedProjections,
    Embedding,
    Linear,
    ProjectAttend,
    Projections,
    RmsNorm,
)
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.qwen3.config import Qwen3Config


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope = build_rope(self.head_dim, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            q_norm=self.q_norm, k_norm=self.k_norm, rope=self.rope,
        )


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)



class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn, mlp = self.self_attn, self.mlp
        self.qkv = Projections(
            (attn.q_proj, attn.k_proj, attn.v_proj), norm=self.input_layernorm
        )
        self.gate_up = Projections(
            (mlp.gate_proj, mlp.up_proj), norm=self.post_attention_layernorm, gate="silu"
        )
        # the attention runs right after the q/k/v projections of the layer input
        self.qkv_attend = ProjectAttend(self.qkv, attn.attention)
        # o_proj (with the residual) runs right before the MLP's gate/up of its sum
        self.o_gate_up = ChainedProjections(attn.o_proj, self.gate_up)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h, act = self.o_gate_up(self.qkv_attend(x, cache), x)
        return self.mlp.down_proj(act, residual=h)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def hidden(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        """The last layer's output, before the final norm."""
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return h

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        return self.norm(self.hidden(ids, cache))


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        table = self.model.embed_tokens if cfg.tie_word_embeddings else self.lm_head
        self.head = Projections((table,), norm=self.model.norm)

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model.hidden(ids, cache)
        (logits,) = self.head(h[:, -1:] if last_only else h)
        return logits

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]
