"""MistralForCausalLM, module for module as the checkpoint names it.

Llama's structure without biases; attention may be limited to a sliding window of positions."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    ChainedProjections,
    Embedding,
    Linear,
    Projections,
    RmsNorm,
)
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.mistral.config import MistralConfig


class MistralAttention(nn.Module):
    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size)
        self.rope = build_rope(self.head_dim, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            window=cfg.sliding_window, rope=self.rope,
        )

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache | None) -> mx.array:
        """The attention of the projections q, k, v: o_proj's input."""
        return self.attention.project(q, k, v, cache)


class MistralMLP(nn.Module):
    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)



class MistralDecoderLayer(nn.Module):
    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__()
        self.self_attn = MistralAttention(cfg)
        self.mlp = MistralMLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn, mlp = self.self_attn, self.mlp
        self.qkv = Projections(
            (attn.q_proj, attn.k_proj, attn.v_proj), norm=self.input_layernorm
        )
        self.gate_up = Projections(
            (mlp.gate_proj, mlp.up_proj), norm=self.post_attention_layernorm, gate="silu"
        )
        # o_proj (with the residual) runs right before the MLP's gate/up of its sum
        self.o_gate_up = ChainedProjections(attn.o_proj, self.gate_up)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v = self.qkv(x)
        h, act = self.o_gate_up(self.self_attn.attend(q, k, v, cache), x)
        return self.mlp.down_proj(act, residual=h)


class MistralModel(nn.Module):
    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [MistralDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def hidden(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        """The last layer's output, before the final norm."""
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return h

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        return self.norm(self.hidden(ids, cache))


class MistralForCausalLM(nn.Module):
    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = MistralModel(cfg)
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
