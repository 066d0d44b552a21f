"""Qwen3MoeForCausalLM, module for module as the checkpoint names it.

Qwen3's attention (q_norm/k_norm per head before rope) with a sparse MLP: a router `gate`
(hidden -> experts), softmax-then-top-k routing (renormalized when norm_topk_prob), and the
selected experts' silu-gated MLPs, stacked as experts.gate_up_proj / experts.down_proj. Layers
named in mlp_only_layers, or off the decoder_sparse_step, keep a dense MLP."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.fusion import (
    EXPERTS_CHAIN,
    NORM_INTO_EXPERTS,
    NORM_INTO_PROJECTIONS,
    PROJECTION_INTO_ROUTE,
    PROJECTIONS_INTO_ATTENTION,
    RESIDUAL_INTO_PROJECTION,
    ROUTE_INTO_EXPERTS,
    ROUTER_INTO_ROUTE,
    Fusions,
)
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.qwen3_moe.config import Qwen3MoeConfig

# The neighbours that run as one launch where a kernel computes them (the binding pass finds
# them in the forwards marked FUSED; docs/kernels.md): input_layernorm and q/k/v, then the
# attention; in a sparse layer o_proj with the residual, post_attention_layernorm, the router,
# the routing, the experts' gate/up and down with the residual; in a dense one o_proj and
# down_proj with their residuals, post_attention_layernorm and gate/up; the final norm and the
# head.
FUSED = Fusions(NORM_INTO_PROJECTIONS, NORM_INTO_EXPERTS, ROUTER_INTO_ROUTE, EXPERTS_CHAIN,
                RESIDUAL_INTO_PROJECTION, PROJECTIONS_INTO_ATTENTION, PROJECTION_INTO_ROUTE,
                ROUTE_INTO_EXPERTS)


class Qwen3MoeAttention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
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
        # per head: q_norm / k_norm, rope at the cache's offset, then attention over the cache
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            q_norm=self.q_norm, k_norm=self.k_norm, rope=self.rope,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attention(q, k, v, cache))


class Qwen3MoeMLP(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeExperts(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.route = Route(
            cfg.num_experts, cfg.num_experts_per_tok, order="softmax_topk",
            normalize=cfg.norm_topk_prob,
        )
        self.experts = Qwen3MoeExperts(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.route(self.gate(x))
        return self.experts(x, ids, weights)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Qwen3MoeAttention(cfg)
        self.mlp = Qwen3MoeSparseMoeBlock(cfg) if cfg.sparse(index) else Qwen3MoeMLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @FUSED
    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen3MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        """The last layer's output (the head applies `norm`)."""
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return h


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
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
