"""OlmoeForCausalLM, module for module as the checkpoint names it.

Attention with an RMS norm over the whole query projection (q_norm, heads * head_dim) and the
whole key projection (k_norm, kv_heads * head_dim) before rope, and, when clip_qkv is set,
queries, keys and values clamped to [-clip_qkv, clip_qkv] after the norms. Every layer's MLP is
sparse: a router `gate`, softmax-then-top-k routing (renormalized when norm_topk_prob), and the
selected experts' silu-gated MLPs, stacked as experts.gate_up_proj / experts.down_proj."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.olmoe.config import OlmoeConfig


class OlmoeAttention(nn.Module):
    def __init__(self, cfg: OlmoeConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.clip = cfg.clip_qkv
        bias = cfg.attention_bias
        q_dims, kv_dims = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_dims, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, kv_dims, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, kv_dims, bias=bias)
        self.o_proj = Linear(q_dims, cfg.hidden_size, bias=bias)
        self.q_norm = RmsNorm(q_dims, cfg.rms_norm_eps)
        self.k_norm = RmsNorm(kv_dims, cfg.rms_norm_eps)
        self.rope = build_rope(self.head_dim, cfg.rope)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x))
        k = self.k_norm(self.k_proj(x))
        v = self.v_proj(x)
        if self.clip is not None:
            q = mx.clip(q, -self.clip, self.clip)
            k = mx.clip(k, -self.clip, self.clip)
            v = mx.clip(v, -self.clip, self.clip)
        q = reshape(q, b, length, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = reshape(k, b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        v = reshape(v, b, length, self.n_kv_heads, self.head_dim).swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        out = self.attention.attend(q, k, v, cache)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class OlmoeExperts(nn.Module):
    def __init__(self, cfg: OlmoeConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class OlmoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg: OlmoeConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.route = Route(
            cfg.num_experts, cfg.num_experts_per_tok, order="softmax_topk",
            normalize=cfg.norm_topk_prob,
        )
        self.experts = OlmoeExperts(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.route(self.gate(x))
        return self.experts(x, ids, weights)


class OlmoeDecoderLayer(nn.Module):
    def __init__(self, cfg: OlmoeConfig) -> None:
        super().__init__()
        self.self_attn = OlmoeAttention(cfg)
        self.mlp = OlmoeSparseMoeBlock(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class OlmoeModel(nn.Module):
    def __init__(self, cfg: OlmoeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [OlmoeDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class OlmoeForCausalLM(nn.Module):
    def __init__(self, cfg: OlmoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = OlmoeModel(cfg)
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
