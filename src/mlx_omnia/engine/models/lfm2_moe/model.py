"""Lfm2MoeForCausalLM, module for module as the checkpoint names it.

A decoder layer is `operator_norm`, then its operator, a residual, then `ffn_norm`, the
`feed_forward` and a residual. The feed-forward of the first num_dense_layers layers is a SwiGLU
MLP (w2(silu(w1 x) * w3 x)); the others are experts: router logits `gate(x)`, scores
sigmoid(logits), the top k chosen by score + `expert_bias` (when use_expert_bias; the bias picks,
it does not weigh), their scores renormalized (norm_topk_prob: / (sum + 1e-6)) and times
routed_scaling_factor, then the chosen experts' SwiGLU MLPs (stacked as
experts.gate_up_proj / experts.down_proj). The operator is attention (GQA with per-head RMS
norms q_layernorm / k_layernorm before rope) where `layer_types` says full_attention, and
elsewhere a gated short convolution:

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
from mlx_omnia.engine.core.moe import DownCombine, GateUp
from mlx_omnia.engine.core.recurrent import ShortConv, State
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.lfm2_moe.config import Lfm2MoeConfig

LayerCache = KVCache | State  # an attention layer's, a convolution's


class Lfm2MoeAttention(nn.Module):
    def __init__(self, cfg: Lfm2MoeConfig) -> None:
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


class Lfm2MoeShortConv(nn.Module):
    def __init__(self, cfg: Lfm2MoeConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.in_proj = Linear(hidden, 3 * hidden, bias=cfg.conv_bias)
        self.conv = ShortConv(hidden, cfg.conv_kernel, bias=cfg.conv_bias)
        self.out_proj = Linear(hidden, hidden, bias=cfg.conv_bias)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, c, h = mx.split(self.in_proj(x), 3, axis=-1)
        return self.out_proj(c * self.conv(b * h, state))


class Lfm2MoeMLP(nn.Module):
    def __init__(self, cfg: Lfm2MoeConfig) -> None:
        super().__init__()
        self.w1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.w3 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(silu(self.w1(x)) * self.w3(x))


def sigmoid_routing(
    logits: mx.array, bias: mx.array | None, top_k: int, normalize: bool, scale: float
) -> tuple[mx.array, mx.array]:
    """(weights, ids) [..., top_k]: the top k of sigmoid(logits) (+ bias when choosing), their
    sigmoid scores renormalized when `normalize`, times `scale` (float32, back to the dtype)."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choosing = scores if bias is None else scores + bias.astype(mx.float32)
    ids = mx.argpartition(-choosing, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-6)
    return (weights * scale).astype(logits.dtype), ids


class Lfm2MoeExperts(nn.Module):
    def __init__(self, cfg: Lfm2MoeConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class Lfm2MoeSparseMoeBlock(nn.Module):
    expert_bias: mx.array

    def __init__(self, cfg: Lfm2MoeConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = Lfm2MoeExperts(cfg)
        if cfg.use_expert_bias:
            self.expert_bias = mx.zeros((cfg.num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.expert_bias if "expert_bias" in self else None
        weights, ids = sigmoid_routing(self.gate(x), bias, self.top_k, self.normalize, self.scale)
        return self.experts(x, ids, weights)


class Lfm2MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Lfm2MoeConfig, kind: str, index: int) -> None:
        super().__init__()
        self.attends = kind == "full_attention"
        if self.attends:
            self.self_attn = Lfm2MoeAttention(cfg)
        else:
            self.conv = Lfm2MoeShortConv(cfg)
        self.feed_forward: Lfm2MoeMLP | Lfm2MoeSparseMoeBlock = (
            Lfm2MoeMLP(cfg) if index < cfg.num_dense_layers else Lfm2MoeSparseMoeBlock(cfg)
        )
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


class Lfm2MoeModel(nn.Module):
    def __init__(self, cfg: Lfm2MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Lfm2MoeDecoderLayer(cfg, kind, i) for i, kind in enumerate(cfg.layer_types)]
        self.embedding_norm = RmsNorm(cfg.hidden_size, cfg.norm_eps)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.embedding_norm(h)


class Lfm2MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Lfm2MoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Lfm2MoeModel(cfg)
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
