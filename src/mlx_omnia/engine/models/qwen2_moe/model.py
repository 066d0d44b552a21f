"""Qwen2MoeForCausalLM, module for module as the checkpoint names it.

Qwen2's attention (q/k/v bias, no o bias) with a sparse MLP: a router `gate` (hidden ->
experts), softmax-then-top-k routing (renormalized when norm_topk_prob), the selected experts'
silu-gated MLPs (stacked as experts.gate_up_proj / experts.down_proj), plus a dense
`shared_expert` every token goes through, scaled by sigmoid(shared_expert_gate(x)). Layers
named in mlp_only_layers, or off the decoder_sparse_step, keep a dense MLP."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.qwen2_moe.config import Qwen2MoeConfig


class Qwen2MoeAttention(nn.Module):
    def __init__(self, cfg: Qwen2MoeConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
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


class Qwen2MoeMLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner)
        self.up_proj = Linear(hidden, inner)
        self.down_proj = Linear(inner, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeExperts(nn.Module):
    def __init__(self, cfg: Qwen2MoeConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen2MoeConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.route = Route(
            cfg.num_experts, cfg.num_experts_per_tok, order="softmax_topk",
            normalize=cfg.norm_topk_prob,
        )
        self.experts = Qwen2MoeExperts(cfg)
        self.shared_expert = Qwen2MoeMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.route(self.gate(x))
        shared = mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, ids, weights) + shared


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2MoeConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Qwen2MoeAttention(cfg)
        self.mlp = (
            Qwen2MoeSparseMoeBlock(cfg) if cfg.sparse(index)
            else Qwen2MoeMLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2MoeModel(nn.Module):
    def __init__(self, cfg: Qwen2MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen2MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Qwen2MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen2MoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen2MoeModel(cfg)
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
