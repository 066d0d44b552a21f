"""Qwen3_5ForCausalLM, module for module as the checkpoint names it (an image-text checkpoint's
`model.language_model.*` is this `model.*`).

Layers alternate by `layer_types`: `linear_attn`, a gated DeltaNet, or `self_attn`, gated
attention; each is followed by an MLP: dense (qwen3_5) or a mixture of experts in every layer
(qwen3_5_moe). The RMS
norms around them (input_layernorm, post_attention_layernorm, norm, q_norm, k_norm) scale by
1 + weight in float32 (OffsetRmsNorm).

Gated attention: q_proj gives each head its query and an output gate side by side; per-head
q_norm / k_norm, rope on the first `rotary_dims` features of a head (partial_rotary_factor),
grouped-query attention, then the heads' output times sigmoid(gate) before o_proj.

Gated DeltaNet: in_proj_qkv gives [q | k | v] (every head's q, then every k, then every v),
in_proj_z the output gates, in_proj_b and in_proj_a a value per value head. q, k, v pass a short causal convolution (conv1d, then silu), then the gated delta rule (core
GatedDeltaRule) with beta = sigmoid(b) and decay g = -exp(A_log) * softplus(a + dt_bias); each
value head's output is RMS-normed (weight, not 1 + weight) and gated by silu(z) (`norm`),
then out_proj.

The experts' block: a softmax router `gate`, top-k always renormalized, the
selected experts' silu-gated MLPs (stacked as experts.gate_up_proj / experts.down_proj), plus
`shared_expert` scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    Embedding,
    Linear,
    OffsetRmsNorm,
    RmsNorm,
)
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.recurrent import GatedDeltaRule, ShortConv, State
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.qwen3_5.config import Qwen3_5Config

LayerCache = KVCache | State  # a full-attention layer's, a DeltaNet layer's


class Qwen3_5Attention(nn.Module):
    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = dims = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * dims * 2, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * dims, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * dims, bias=bias)
        self.o_proj = Linear(self.n_heads * dims, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRmsNorm(dims, cfg.rms_norm_eps)
        self.k_norm = OffsetRmsNorm(dims, cfg.rms_norm_eps)
        self.rope = build_rope(cfg.rotary_dims, cfg.rope)
        self.attention = AttentionStep(n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=dims)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        b, length, _ = x.shape
        h, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        q_gate = reshape(self.q_proj(x), b, length, h, 2 * d)
        q, gate = q_gate[..., :d], reshape(q_gate[..., d:], b, length, h * d)
        q = self.q_norm(q).swapaxes(1, 2)
        k = self.k_norm(reshape(self.k_proj(x), b, length, kv, d)).swapaxes(1, 2)
        v = reshape(self.v_proj(x), b, length, kv, d).swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        out = reshape(self.attention.attend(q, k, v, cache).swapaxes(1, 2), b, length, h * d)
        return self.o_proj(out * mx.sigmoid(gate))


class Qwen3_5GatedDeltaNet(nn.Module):
    A_log: mx.array
    dt_bias: mx.array

    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.key_heads, self.value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.in_proj_qkv = Linear(cfg.hidden_size, 2 * keys + values)
        self.in_proj_z = Linear(cfg.hidden_size, values)
        self.in_proj_b = Linear(cfg.hidden_size, self.value_heads)
        self.in_proj_a = Linear(cfg.hidden_size, self.value_heads)
        self.conv1d = ShortConv(2 * keys + values, cfg.linear_conv_kernel_dim, activation="silu")
        self.A_log = mx.zeros((self.value_heads,))
        self.dt_bias = mx.ones((self.value_heads,))
        self.delta_rule = GatedDeltaRule(
            key_heads=self.key_heads, value_heads=self.value_heads,
            key_dim=self.key_dim, value_dim=self.value_dim,
        )
        self.norm = RmsNorm(self.value_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(values, cfg.hidden_size)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, length, _ = x.shape
        nk, nv, dv = self.key_heads, self.value_heads, self.value_dim
        mixed = self.conv1d(self.in_proj_qkv(x), state)
        keys = nk * self.key_dim
        q = reshape(mixed[..., :keys], b, length, nk, self.key_dim)
        k = reshape(mixed[..., keys : 2 * keys], b, length, nk, self.key_dim)
        v = reshape(mixed[..., 2 * keys :], b, length, nv, dv)
        beta = mx.sigmoid(self.in_proj_b(x))
        f32 = mx.float32
        softplus = mx.logaddexp(self.in_proj_a(x).astype(f32) + self.dt_bias.astype(f32), 0.0)
        decay = -mx.exp(self.A_log.astype(f32)) * softplus  # log(1 + e^x) above
        out = self.delta_rule(q, k, v, decay, beta, state)
        gate = silu(reshape(self.in_proj_z(x), b, length, nv, dv).astype(f32))
        out = (self.norm(out).astype(f32) * gate).astype(x.dtype)
        return self.out_proj(reshape(out, b, length, nv * dv))


class Qwen3_5MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner)
        self.up_proj = Linear(hidden, inner)
        self.down_proj = Linear(inner, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3_5Experts(nn.Module):
    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class Qwen3_5SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.route = Route(
            cfg.num_experts, cfg.num_experts_per_tok, order="softmax_topk", normalize=True
        )
        self.experts = Qwen3_5Experts(cfg)
        self.shared_expert = Qwen3_5MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.route(self.gate(x))
        shared = mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, ids, weights) + shared


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3_5Config, index: int) -> None:
        super().__init__()
        self.linear = cfg.layer_types[index] == "linear_attention"
        if self.linear:
            self.linear_attn = Qwen3_5GatedDeltaNet(cfg)
        else:
            self.self_attn = Qwen3_5Attention(cfg)
        self.mlp = (
            Qwen3_5SparseMoeBlock(cfg) if cfg.moe
            else Qwen3_5MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = OffsetRmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        normed = self.input_layernorm(x)
        if self.linear:
            h = x + self.linear_attn(normed, cast(State | None, cache))
        else:
            h = x + self.self_attn(normed, cast(KVCache | None, cache))
        return h + self.mlp(self.post_attention_layernorm(h))

    def make_cache(self) -> KVCache | RecurrentState:
        if not self.linear:
            return KVCache()
        return RecurrentState((self.linear_attn.conv1d.name, self.linear_attn.delta_rule.name))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen3_5DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = OffsetRmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3_5Model(cfg)
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

    def make_cache(self) -> list[KVCache | RecurrentState]:
        """Keys and values for each full-attention layer, a RecurrentState (convolution and
        delta-rule state) for each DeltaNet layer."""
        return [layer.make_cache() for layer in self.model.layers]
