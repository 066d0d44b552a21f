"""Qwen3MoeForCausalLM, module for module as the checkpoint names it.

Qwen3's attention (q_norm/k_norm per head before rope) with a sparse MLP: a router `gate`
(hidden -> experts), softmax-then-top-k routing (renormalized when norm_topk_prob), and the
selected experts' silu-gated MLPs, stacked as experts.gate_up_proj / experts.down_proj. Layers
named in mlp_only_layers, or off the decoder_sparse_step, keep a dense MLP."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    Embedding,
    Linear,
    ProjectAttend,
    Projections,
    RmsNorm,
)
from mlx_omnia.engine.core.moe import DownCombine, GateUp, ProjectRoute, Route, RouteExperts
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.qwen3_moe.config import Qwen3MoeConfig


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
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            q_norm=self.q_norm, k_norm=self.k_norm, rope=self.rope,
        )


class Qwen3MoeMLP(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, norm: RmsNorm) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.gate_up = Projections((self.gate_proj, self.up_proj), norm=norm, gate="silu")

    def __call__(self, h: mx.array) -> mx.array:
        """h + the MLP of norm(h)."""
        (act,) = self.gate_up(h)
        return self.down_proj(act, residual=h)


class Qwen3MoeExperts(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, norm: RmsNorm) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner, norm=norm)
        self.down_proj = DownCombine(n, inner, hidden, gate_up=self.gate_up_proj)

    def __call__(self, h: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        """h + the selected experts' MLPs of norm(h) (the norm is the gate/up projection's; the
        down projection declares the gate/up before it and runs it)."""
        return self.down_proj(h, ids, weights, residual=h)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, norm: RmsNorm, o_proj: Linear) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        # the router reads the layer's post_attention_layernorm of h, as the experts do
        self.router = Projections((self.gate,), norm=norm)
        self.route = Route(
            cfg.num_experts, cfg.num_experts_per_tok, order="softmax_topk",
            normalize=cfg.norm_topk_prob, router=self.router,
        )
        # the attention's o_proj (with the residual) runs right before the routing of its sum
        self.project_route = ProjectRoute(o_proj, self.route)
        self.experts = Qwen3MoeExperts(cfg, norm)
        # ... and the experts right after the routing, on its h
        self.route_experts = RouteExperts(self.project_route, self.experts.down_proj)

    def __call__(self, h: mx.array) -> mx.array:
        """h + the experts' MLP of norm(h)."""
        weights, ids = self.route(h)
        return self.experts(h, ids, weights)

    def after_attention(self, a: mx.array, x: mx.array) -> mx.array:
        """With h = x + o_proj(a) (a the attention's output): h + the experts' MLP of norm(h)."""
        return self.route_experts(a, x)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Qwen3MoeAttention(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norm = self.post_attention_layernorm
        attn = self.self_attn
        self.mlp = (Qwen3MoeSparseMoeBlock(cfg, norm, attn.o_proj) if cfg.sparse(index)
                    else Qwen3MoeMLP(cfg, norm))
        self.qkv = Projections((attn.q_proj, attn.k_proj, attn.v_proj), norm=self.input_layernorm)
        # the attention runs right after the q/k/v projections of the layer input
        self.qkv_attend = ProjectAttend(self.qkv, attn.attention)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        a = self.qkv_attend(x, cache)
        if isinstance(self.mlp, Qwen3MoeSparseMoeBlock):
            return self.mlp.after_attention(a, x)
        return self.mlp(self.self_attn.o_proj(a, residual=x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen3MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def hidden(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        """The last layer's output, before the final norm."""
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return h

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        return self.norm(self.hidden(ids, cache))


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
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
