"""DeepseekV2ForCausalLM, module for module as the checkpoint names it.

Multi-head latent attention: queries come from q_proj, or through a low-rank bottleneck
(q_a_proj, q_a_layernorm, q_b_proj) when q_lora_rank is set, as [nope | rope] features per head.
kv_a_proj_with_mqa compresses the token to a latent of kv_lora_rank (normalized by
kv_a_layernorm, then expanded by kv_b_proj to each head's [k_nope | v]) plus one rope key k_pe
shared by every head. The rope acts on the q_pe / k_pe features only, on interleaved pairs
(x[2i], x[2i+1]), i.e. the `traditional` layout; the softmax scale is qk_head_dim^-1/2 times
mscale(factor, mscale_all_dim)^2 under yarn scaling.

The cache holds the latent, not the heads (kv_lora_rank + qk_rope_head_dim numbers a token, where
the expanded keys and values would take n_heads * (qk_head_dim + v_head_dim)). kv_b_proj's rows
are, per head, W_uk [qk_nope, kv_lora_rank] then W_uv [v_head_dim, kv_lora_rank], so

    q_nope . k_nope = q_nope . (W_uk c) = (q_nope W_uk) . c        (c: the normed latent)
    sum_t p_t v_t   = sum_t p_t W_uv c_t = W_uv (sum_t p_t c_t)

and attention runs as one shared kv head (multi-query) of keys [c | k_pe] and values c, with
queries [q_nope W_uk | q_pe] and the same softmax scale; W_uv takes each head's output back from
the latent (DeepSeek-V2 paper, section 2.1.2: the up-projections absorbed).

The MLP of the first first_k_dense_replace layers is dense; the others are a mixture of experts:
a router `gate`, softmax over the routed experts, top-k (greedy, or group_limited_greedy: only
the topk_group groups of experts with the best single expert compete), weights times
routed_scaling_factor and not renormalized, the selected experts' silu-gated MLPs (stacked as
experts.gate_up_proj / experts.down_proj), plus `shared_experts`, one dense MLP of
n_shared_experts * moe_intermediate_size that every token goes through."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.models.deepseek_v2.config import DeepseekV2Config

# The latent norms use RMSNorm's default epsilon, not rms_norm_eps (as DeepSeek's code does).
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: DeepseekV2Config) -> float:
    scale = 1.0 / math.sqrt(cfg.qk_head_dim)
    params = cfg.rope
    all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and all_dim:
        factor = float(params["factor"])
        mscale = 0.1 * float(all_dim) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    def __init__(self, cfg: DeepseekV2Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.n_heads * self.qk_dim)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RmsNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * self.qk_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RmsNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_rank, self.n_heads * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(self.n_heads * self.v_dim, hidden, bias=bias)
        self.rope = build_rope(self.rope_dim, cfg.rope, traditional=True)
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=1, head_dim=self.kv_rank + self.rope_dim,
            scale=softmax_scale(cfg), value_dim=self.kv_rank,
        )

    def queries(self, x: mx.array) -> mx.array:
        if "q_proj" in self:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        h, nope, rank = self.n_heads, self.nope_dim, self.kv_rank
        q = reshape(self.queries(x), b, length, h, self.qk_dim).swapaxes(1, 2)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = reshape(self.kv_a_layernorm(compressed[..., :rank]), b, 1, length, rank)
        k_pe = reshape(compressed[..., rank:], b, 1, length, self.rope_dim)
        offset = cache.offset if cache is not None else 0
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)
        w = reshape(self.kv_b_proj.dense_weight(x.dtype), h, nope + self.v_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        queries = mx.concatenate([q_nope @ w_uk, q_pe], axis=-1)
        keys = mx.concatenate([latent, k_pe], axis=-1)
        out = self.attention.attend(queries, keys, latent, cache) @ w_uv.swapaxes(1, 2)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class DeepseekV2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV2Experts(nn.Module):
    def __init__(self, cfg: DeepseekV2Config) -> None:
        super().__init__()
        n, hidden, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


def group_limited_greedy(
    logits: mx.array, top_k: int, n_group: int, topk_group: int
) -> tuple[mx.array, mx.array]:
    """Softmax over the experts (float32); each group of experts scores its best expert, the
    topk_group best groups stay, and the top_k experts of those are chosen, with their
    softmax probabilities as weights (not renormalized). -> (weights, ids) [..., top_k]."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    n_experts = probs.shape[-1]
    grouped = reshape(probs, *probs.shape[:-1], n_group, n_experts // n_group)
    best = grouped.max(axis=-1)
    groups = mx.argpartition(-best, kth=topk_group - 1, axis=-1)[..., :topk_group]
    keep = mx.put_along_axis(
        mx.zeros(best.shape, dtype=mx.bool_), groups, mx.array(True), axis=-1
    )
    masked = mx.where(mx.expand_dims(keep, -1), grouped, 0.0)
    masked = reshape(masked, *probs.shape)
    ids = mx.argpartition(-masked, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(masked, ids, axis=-1)
    return weights.astype(logits.dtype), ids


class DeepseekV2Moe(nn.Module):
    def __init__(self, cfg: DeepseekV2Config) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.grouped = cfg.topk_method == "group_limited_greedy"
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        self.gate = Linear(cfg.hidden_size, cfg.n_routed_experts)
        self.route = Route(cfg.n_routed_experts, self.top_k, order="softmax_topk", normalize=False)
        self.experts = DeepseekV2Experts(cfg)
        self.shared_experts = DeepseekV2MLP(
            cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.mlp_bias
        )

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.gate(x)
        if self.grouped:
            weights, ids = group_limited_greedy(logits, self.top_k, self.n_group, self.topk_group)
        else:
            weights, ids = self.route(logits)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return self.experts(x, ids, weights) + self.shared_experts(x)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV2Config, index: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV2Attention(cfg)
        self.mlp = (
            DeepseekV2Moe(cfg) if cfg.sparse(index)
            else DeepseekV2MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        )
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg: DeepseekV2Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DeepseekV2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[KVCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, cfg: DeepseekV2Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV2Model(cfg)
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
