"""KimiLinearForCausalLM, module for module as the hub's checkpoints name it (the names
transformers' save_pretrained writes too; checkpoint.py reads the others).

Every layer is input_layernorm, its `self_attn`, post_attention_layernorm and its `mlp`, each
added to the residual. `self_attn` is by `layer_types` one of:

  linear_attention   Kimi Delta Attention (KDA). q_proj, k_proj, v_proj, each through a short
                     causal convolution (q_conv1d, k_conv1d, v_conv1d, then silu); a decay per
                     key channel g = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)
                     (A_log one a head; softplus as transformers spells it, x itself above 20);
                     beta = sigmoid(b_proj(x)); the gated delta rule with that channel decay
                     (core ChannelGatedDeltaRule: l2-normed q and k, q / sqrt(head_dim)); each
                     head's output RMS-normed in float32 (o_norm) times
                     sigmoid(g_b_proj(g_a_proj(x))), then o_proj.
  full_attention     multi-head latent attention without positions (NoPE): queries from q_proj,
                     or q_a_proj, q_a_layernorm, q_b_proj where q_lora_rank is set, as
                     [nope | rope] features a head; kv_a_proj_with_mqa compresses the token to a
                     latent of kv_lora_rank (kv_a_layernorm) and one key of qk_rope_head_dim
                     shared by the heads, which no rope turns; kv_b_proj expands the latent to
                     each head's [k_nope | v]. Softmax scale qk_head_dim^-1/2. The cache holds
                     the latent and the shared key, with kv_b_proj absorbed as in deepseek_v2
                     (q_nope . W_uk c = (q_nope W_uk) . c, and W_uv after the weighted sum).

`mlp` is by `mlp_layer_types` a dense silu-gated MLP or the experts' block: the router `gate`
(float32) scores sigmoid(logits); experts are chosen by score + e_score_correction_bias (the
bias picks, it does not weigh) among the topk_group of n_group groups whose best two biased
scores sum highest; the chosen scores, renormalized when norm_topk_prob (/ (sum + 1e-20)) and
times routed_scaling_factor, weigh the chosen experts' silu-gated MLPs (stacked as
experts.gate_up_proj / experts.down_proj), plus `shared_experts`, one MLP of
n_shared_experts * moe_intermediate_size every token goes through.

`lm_head` is a matrix of its own even where the config says tie_word_embeddings: transformers
ties nothing in this family."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, sigmoid_group_topk
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.recurrent import ChannelGatedDeltaRule, ShortConv, State
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.kimi_linear.config import LINEAR, SPARSE, KimiLinearConfig

LayerCache = KVCache | State  # a latent-attention layer's, a KDA layer's
# The latent norms use RMSNorm's default epsilon, not rms_norm_eps (as transformers builds them).
LATENT_NORM_EPS = 1e-6
SOFTPLUS_LINEAR_ABOVE = 20.0  # transformers' softplus is x itself above this


class KimiLinearAttention(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.qk_dim, self.v_dim = cfg.qk_head_dim, cfg.v_head_dim
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
        self.attention = AttentionStep(
            n_heads=self.n_heads, n_kv_heads=1, head_dim=self.kv_rank + self.rope_dim,
            scale=self.qk_dim**-0.5, value_dim=self.kv_rank,
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
        w = reshape(self.kv_b_proj.dense_weight(x.dtype), h, nope + self.v_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        queries = mx.concatenate([q_nope @ w_uk, q_pe], axis=-1)
        keys = mx.concatenate([latent, k_pe], axis=-1)
        out = self.attention.attend(queries, keys, latent, cache) @ w_uv.swapaxes(1, 2)
        return self.o_proj(reshape(out.swapaxes(1, 2), b, length, -1))


class KimiLinearDeltaAttention(nn.Module):
    A_log: mx.array
    dt_bias: mx.array

    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.linear_num_heads, cfg.linear_head_dim
        hidden, dim, width = cfg.hidden_size, self.head_dim, self.heads * self.head_dim
        kernel = cfg.linear_conv_kernel_dim
        self.q_proj = Linear(hidden, width)
        self.k_proj = Linear(hidden, width)
        self.v_proj = Linear(hidden, width)
        self.q_conv1d = ShortConv(width, kernel, activation="silu", name="q_conv1d")
        self.k_conv1d = ShortConv(width, kernel, activation="silu", name="k_conv1d")
        self.v_conv1d = ShortConv(width, kernel, activation="silu", name="v_conv1d")
        self.f_a_proj = Linear(hidden, dim)
        self.f_b_proj = Linear(dim, width)
        self.A_log = mx.zeros((1, 1, self.heads, 1))
        self.dt_bias = mx.zeros((width,))
        self.b_proj = Linear(hidden, self.heads)
        self.g_a_proj = Linear(hidden, dim)
        self.g_b_proj = Linear(dim, width)
        self.o_norm = RmsNorm(dim, cfg.rms_norm_eps)
        self.o_proj = Linear(width, hidden)
        self.delta_rule = ChannelGatedDeltaRule(heads=self.heads, key_dim=dim, value_dim=dim)

    def decay(self, x: mx.array) -> mx.array:
        """g [B, L, heads, head_dim] (float32, <= 0): each key channel's log-decay."""
        f32 = mx.float32
        g = self.f_b_proj(self.f_a_proj(x)).astype(f32) + self.dt_bias.astype(f32)
        g = reshape(g, *x.shape[:2], self.heads, self.head_dim)
        softplus = mx.where(g > SOFTPLUS_LINEAR_ABOVE, g, mx.log(1.0 + mx.exp(g)))
        return -mx.exp(self.A_log.astype(f32)) * softplus

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, length, _ = x.shape
        heads = (b, length, self.heads, self.head_dim)
        q = reshape(self.q_conv1d(self.q_proj(x), state), *heads)
        k = reshape(self.k_conv1d(self.k_proj(x), state), *heads)
        v = reshape(self.v_conv1d(self.v_proj(x), state), *heads)
        beta = mx.sigmoid(self.b_proj(x))
        out = self.delta_rule(q, k, v, self.decay(x), beta, state)
        gate = reshape(self.g_b_proj(self.g_a_proj(x)), *heads)
        f32 = mx.float32
        out = (self.o_norm(out.astype(f32)) * mx.sigmoid(gate.astype(f32))).astype(x.dtype)
        return self.o_proj(reshape(out, b, length, -1))


class KimiLinearMLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner)
        self.up_proj = Linear(hidden, inner)
        self.down_proj = Linear(inner, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class KimiLinearTopkRouter(nn.Module):
    """Router logits in float32 -> (weights, ids) [..., num_experts_per_tok], as the module
    docstring says; the weights stay float32."""

    weight: mx.array
    e_score_correction_bias: mx.array

    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.weight = mx.zeros((cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = mx.zeros((cfg.num_experts,))
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scale = cfg.routed_scaling_factor

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        f32 = mx.float32
        return sigmoid_group_topk(
            x.astype(f32) @ self.weight.astype(f32).T, self.e_score_correction_bias, top_k=self.top_k,
            n_group=self.n_group, topk_group=self.topk_group, normalize=self.normalize,
            scale=self.scale,
        )


class KimiLinearExperts(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class KimiLinearMoE(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.gate = KimiLinearTopkRouter(cfg)
        self.experts = KimiLinearExperts(cfg)
        self.shared_experts = KimiLinearMLP(
            cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        )

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.gate(x)
        return self.experts(x, ids, weights) + self.shared_experts(x)


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, index: int) -> None:
        super().__init__()
        self.self_attn = (
            KimiLinearDeltaAttention(cfg) if cfg.layer_types[index] == LINEAR
            else KimiLinearAttention(cfg)
        )
        self.mlp = (
            KimiLinearMoE(cfg) if cfg.mlp_layer_types[index] == SPARSE
            else KimiLinearMLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        normed, attn = self.input_layernorm(x), self.self_attn
        if isinstance(attn, KimiLinearDeltaAttention):
            h = x + attn(normed, cast(State | None, cache))
        else:
            h = x + attn(normed, cast(KVCache | None, cache))
        return h + self.mlp(self.post_attention_layernorm(h))

    def make_cache(self) -> KVCache | RecurrentState:
        attn = self.self_attn
        if not isinstance(attn, KimiLinearDeltaAttention):
            return KVCache()
        convs = (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
        return RecurrentState((*(c.name for c in convs), attn.delta_rule.name))


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [KimiLinearDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = KimiLinearModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[LayerCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache | RecurrentState]:
        """The latent and shared key for each full-attention layer, a RecurrentState (the three
        convolutions' windows and the delta rule's state) for each KDA layer."""
        return [layer.make_cache() for layer in self.model.layers]
