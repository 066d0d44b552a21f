"""BailingHybridForCausalLM (Ling 3.0), module for module as the checkpoint names it:
`model.word_embeddings`, `model.layers.<i>.attention` of either kind, `mlp`, the two norms,
`model.norm`, `lm_head` (never tied: transformers ties nothing in this family).

Layers alternate by `layer_types`. `linear_attention` is a delta attention with a forget gate
per key channel: q_proj, k_proj, v_proj, each through its own short causal convolution
(q_conv1d, k_conv1d, v_conv1d, then silu); the forget gate's log decay per head and channel,
from f = f_proj(x) + dt_bias and rate = exp(A_log) per head, is kda_lower_bound *
sigmoid(rate f) (kda_safe_gate) or -rate * softplus(f); beta = sigmoid(b_proj(x)); the
gated delta rule with that decay (core ChannelGatedDeltaRule) over l2-normed q, k; each
head's output RMS-normed in float32 (`o_norm`, weight) times sigmoid(g_proj(x)), then `dense`.

`full_attention` is multi-head latent attention with an output gate per head: q_proj gives
each head [nope | rope] features; kv_a_proj_with_mqa compresses the token to a latent of
kv_lora_rank (kv_a_layernorm) and one rope key shared by the heads; kv_b_proj expands the
latent to each head's [k_nope | v]. The rope turns interleaved pairs (x[2i], x[2i+1]) of the
qk_rope_head_dim features; the softmax scale is qk_head_dim^-1/2, times mscale(factor,
mscale_all_dim)^2 under yarn. Each head's output is scaled by sigmoid(g_proj(x)) before `dense`.
The cache holds the latent and the rope key, not the heads: kv_b_proj's rows are, per head,
W_uk then W_uv, so q_nope . (W_uk c) = (q_nope W_uk) . c and sum_t p_t W_uv c_t = W_uv sum_t
p_t c_t, and attention runs as one shared head of keys [c | k_rope] and values c (the
up-projections absorbed, as DeepSeek-V2's paper writes it).

The MLP is `dense` (a silu-gated MLP) or `sparse` by `mlp_layer_types`: the router `gate`
scores sigmoid(x W^T) in float32; experts are chosen by score + expert_bias (the bias picks, it
does not weigh) among the topk_group of n_group groups whose two best biased scores sum highest;
the chosen scores, renormalized when norm_topk_prob (/ (sum + 1e-20)) and times
routed_scaling_factor, weigh the chosen experts' silu-gated MLPs (stacked as
experts.gate_up_proj / experts.down_proj); plus `shared_experts`, one MLP of
num_shared_experts * moe_intermediate_size."""

from __future__ import annotations

import math
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, sigmoid_group_topk
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.recurrent import ChannelGatedDeltaRule, ShortConv, State
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.bailing_hybrid.config import BailingHybridConfig

LayerCache = KVCache | State  # a full-attention layer's, a linear-attention layer's
# kv_a_layernorm is built with RMSNorm's default epsilon, not rms_norm_eps (as transformers).
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: BailingHybridConfig) -> float:
    scale = 1.0 / math.sqrt(cfg.qk_head_dim)
    params = cfg.rope
    all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and all_dim:
        factor = float(params["factor"])
        mscale = 0.1 * float(all_dim) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class BailingHybridLatentAttention(nn.Module):
    def __init__(self, cfg: BailingHybridConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.qk_dim, self.v_dim = cfg.qk_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(hidden, self.n_heads * self.qk_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RmsNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_rank, self.n_heads * (self.nope_dim + self.v_dim))
        self.dense = Linear(self.n_heads * self.v_dim, hidden, bias=bias)
        self.g_proj = Linear(hidden, self.n_heads)
        self.rope = build_rope(self.rope_dim, cfg.rope, traditional=True)
        self.latent_attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=1, head_dim=self.kv_rank + self.rope_dim,
            scale=softmax_scale(cfg), value_dim=self.kv_rank,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        h, nope, rank = self.n_heads, self.nope_dim, self.kv_rank
        q = reshape(self.q_proj(x), b, length, h, self.qk_dim).swapaxes(1, 2)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = reshape(self.kv_a_layernorm(compressed[..., :rank]), b, 1, length, rank)
        k_rope = reshape(compressed[..., rank:], b, 1, length, self.rope_dim)
        offset = cache.offset if cache is not None else 0
        q_rope, k_rope = self.rope(q_rope, offset), self.rope(k_rope, offset)
        w = reshape(self.kv_b_proj.dense_weight(x.dtype), h, nope + self.v_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        queries = mx.concatenate([q_nope @ w_uk, q_rope], axis=-1)
        keys = mx.concatenate([latent, k_rope], axis=-1)
        out = self.latent_attention.attend(queries, keys, latent, cache) @ w_uv.swapaxes(1, 2)
        gate = mx.sigmoid(self.g_proj(x).astype(mx.float32)).astype(x.dtype)  # [B, L, H]
        out = out.swapaxes(1, 2) * gate[..., None]
        return self.dense(reshape(out, b, length, h * self.v_dim))


class BailingHybridGatedNorm(nn.Module):
    """RMS norm of each head's output in float32, times weight, times sigmoid(gate)."""

    weight: mx.array

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        f32 = mx.float32
        normed = mx.fast.rms_norm(x.astype(f32), self.weight.astype(f32), self.eps)
        return (normed * mx.sigmoid(gate.astype(f32))).astype(x.dtype)


class BailingHybridDeltaAttention(nn.Module):
    A_log: mx.array
    dt_bias: mx.array

    def __init__(self, cfg: BailingHybridConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.linear_num_heads, cfg.linear_head_dim
        width, hidden, kernel = self.heads * self.head_dim, cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.safe_gate, self.lower_bound = cfg.kda_safe_gate, cfg.kda_lower_bound
        self.q_proj = Linear(hidden, width)
        self.k_proj = Linear(hidden, width)
        self.v_proj = Linear(hidden, width)
        self.q_conv1d = ShortConv(width, kernel, activation="silu", name="q_conv")
        self.k_conv1d = ShortConv(width, kernel, activation="silu", name="k_conv")
        self.v_conv1d = ShortConv(width, kernel, activation="silu", name="v_conv")
        self.A_log = mx.zeros((self.heads,))
        self.dt_bias = mx.zeros((width,))
        self.f_proj = Linear(hidden, width)
        self.b_proj = Linear(hidden, self.heads)
        self.g_proj = Linear(hidden, width)
        self.o_norm = BailingHybridGatedNorm(self.head_dim, cfg.rms_norm_eps)
        self.dense = Linear(width, hidden)
        self.delta_rule = ChannelGatedDeltaRule(
            heads=self.heads, key_dim=self.head_dim, value_dim=self.head_dim
        )

    def state_names(self) -> tuple[str, ...]:
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return (*(c.name for c in convs), self.delta_rule.name)

    def forget_gate(self, x: mx.array) -> mx.array:
        """The log decay per head and key channel [B, L, H, D], in x's dtype (transformers'
        rounding); float32 inside."""
        b, length, _ = x.shape
        f32 = mx.float32
        f = self.f_proj(x).astype(f32) + self.dt_bias.astype(f32)
        f = reshape(f, b, length, self.heads, self.head_dim)
        rate = mx.exp(self.A_log.astype(f32))[:, None]
        if self.safe_gate:
            decay = self.lower_bound * mx.sigmoid(rate * f)
        else:
            decay = -rate * mx.logaddexp(f, 0.0)  # softplus
        return decay.astype(x.dtype)

    def convolved(self, conv: ShortConv, x: mx.array, state: State | None) -> mx.array:
        """A projection's short convolution and silu in float32, back in x's dtype
        (transformers keeps the convolutions' weights in float32)."""
        return conv(x.astype(mx.float32), state).astype(x.dtype)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, length, _ = x.shape
        heads = (b, length, self.heads, self.head_dim)
        q = reshape(self.convolved(self.q_conv1d, self.q_proj(x), state), *heads)
        k = reshape(self.convolved(self.k_conv1d, self.k_proj(x), state), *heads)
        v = reshape(self.convolved(self.v_conv1d, self.v_proj(x), state), *heads)
        beta = mx.sigmoid(self.b_proj(x))
        out = self.delta_rule(q, k, v, self.forget_gate(x), beta, state)
        out = self.o_norm(out, reshape(self.g_proj(x), *heads))
        return self.dense(reshape(out, b, length, -1))


class BailingHybridMLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner)
        self.up_proj = Linear(hidden, inner)
        self.down_proj = Linear(inner, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class BailingHybridRouter(nn.Module):
    """Router logits in float32 -> (weights, ids) [..., num_experts_per_tok], as the module
    docstring says; the weights stay float32 (transformers weighs the experts in float32)."""

    weight: mx.array
    expert_bias: mx.array

    def __init__(self, cfg: BailingHybridConfig) -> None:
        super().__init__()
        self.weight = mx.zeros((cfg.num_experts, cfg.hidden_size))
        self.expert_bias = mx.zeros((cfg.num_experts,))
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scale = cfg.routed_scaling_factor

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        f32 = mx.float32
        return sigmoid_group_topk(
            x.astype(f32) @ self.weight.astype(f32).T, self.expert_bias, top_k=self.top_k,
            n_group=self.n_group, topk_group=self.topk_group, normalize=self.normalize,
            scale=self.scale,
        )


class BailingHybridExperts(nn.Module):
    def __init__(self, cfg: BailingHybridConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class BailingHybridMoE(nn.Module):
    def __init__(self, cfg: BailingHybridConfig) -> None:
        super().__init__()
        self.gate = BailingHybridRouter(cfg)
        self.experts = BailingHybridExperts(cfg)
        self.shared_experts = BailingHybridMLP(
            cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts
        )

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.gate(x)
        return self.experts(x, ids, weights) + self.shared_experts(x)


class BailingHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: BailingHybridConfig, index: int) -> None:
        super().__init__()
        self.attention = (
            BailingHybridDeltaAttention(cfg) if cfg.layer_types[index] == "linear_attention"
            else BailingHybridLatentAttention(cfg)
        )
        self.mlp = (
            BailingHybridMoE(cfg) if cfg.mlp_layer_types[index] == "sparse"
            else BailingHybridMLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        normed = self.input_layernorm(x)
        if isinstance(self.attention, BailingHybridDeltaAttention):
            h = x + self.attention(normed, cast(State | None, cache))
        else:
            h = x + self.attention(normed, cast(KVCache | None, cache))
        return h + self.mlp(self.post_attention_layernorm(h))

    def make_cache(self) -> KVCache | RecurrentState:
        if isinstance(self.attention, BailingHybridDeltaAttention):
            return RecurrentState(self.attention.state_names())
        return KVCache()


class BailingHybridModel(nn.Module):
    def __init__(self, cfg: BailingHybridConfig) -> None:
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [BailingHybridDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.word_embeddings(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class BailingHybridForCausalLM(nn.Module):
    def __init__(self, cfg: BailingHybridConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = BailingHybridModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[LayerCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache | RecurrentState]:
        """Keys and values (the latent and the rope key) for each full-attention layer, a
        RecurrentState (three convolutions and the delta-rule state) for each linear one."""
        return [layer.make_cache() for layer in self.model.layers]
