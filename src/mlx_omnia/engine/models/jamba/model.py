"""JambaForCausalLM, module for module as the checkpoint names it.

A decoder layer is `input_layernorm`, its mixer, a residual, then `pre_ff_layernorm`, its
`feed_forward` and a residual. The mixer is attention (`self_attn`: grouped-query attention
with no positional encoding at all) every attn_layer_period-th layer from attn_layer_offset,
and a Mamba-1 mixer (`mamba`) elsewhere:

    x, z       = in_proj(h) split in two                    (intermediate = expand * hidden)
    x          = silu(conv1d(x))                            (causal, depthwise: core ShortConv)
    t, B, C    = x_proj(x) split into dt_rank, d_state, d_state; each RMS-normed
                 (dt_layernorm, b_layernorm, c_layernorm)
    dt         = softplus(dt_proj(t))                       (dt_proj's bias inside)
    y          = selective scan of x with A = -exp(A_log) [intermediate, d_state], dt, B, C and
                 the skip D (core DiagonalSelectiveScan)
    mamba(h)   = out_proj(y * silu(z))

The feed-forward is a SwiGLU MLP (down(silu(gate x) * up x)), or every expert_layer_period-th
layer from expert_layer_offset a mixture of experts: a softmax `router` over every expert,
the top k probabilities taken as they are (not renormalized), the selected experts' SwiGLU
MLPs stacked as experts.gate_up_proj / experts.down_proj. The final norm is
`final_layernorm`; RMS norms scale by weight."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.recurrent import DiagonalSelectiveScan, ShortConv, State
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.jamba.config import ATTENTION, JambaConfig

LayerCache = KVCache | State  # an attention layer's, a Mamba layer's


class JambaAttention(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        heads, kv_heads, dims = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, heads * dims)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * dims)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * dims)
        self.o_proj = Linear(heads * dims, cfg.hidden_size)
        self.attention = AttentionStep(n_heads=heads, n_kv_heads=kv_heads, head_dim=dims)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attention(q, k, v, cache))


class JambaMambaMixer(nn.Module):
    A_log: mx.array
    D: mx.array

    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        inner, state, rank = cfg.mamba_inner, cfg.mamba_d_state, cfg.mamba_dt_rank
        self.split = (rank, rank + state)
        self.in_proj = Linear(cfg.hidden_size, 2 * inner, bias=cfg.mamba_proj_bias)
        self.conv1d = ShortConv(inner, cfg.mamba_d_conv, bias=cfg.mamba_conv_bias, activation="silu")
        self.x_proj = Linear(inner, rank + 2 * state)
        self.dt_proj = Linear(rank, inner, bias=True)
        self.A_log = mx.zeros((inner, state))
        self.D = mx.ones((inner,))  # pyright: ignore[reportConstantRedefinition]  # the checkpoint's name
        self.scan = DiagonalSelectiveScan(channels=inner, state_size=state)
        self.out_proj = Linear(inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)
        self.dt_layernorm = RmsNorm(rank, cfg.rms_norm_eps)
        self.b_layernorm = RmsNorm(state, cfg.rms_norm_eps)
        self.c_layernorm = RmsNorm(state, cfg.rms_norm_eps)

    def __call__(self, h: mx.array, state: State | None) -> mx.array:
        f32 = mx.float32
        x, z = mx.split(self.in_proj(h), 2, axis=-1)
        x = self.conv1d(x, state)
        t, b, c = mx.split(self.x_proj(x), self.split, axis=-1)
        t, b, c = self.dt_layernorm(t), self.b_layernorm(b), self.c_layernorm(c)
        dt = mx.logaddexp(self.dt_proj(t).astype(f32), 0.0)  # softplus
        a = -mx.exp(self.A_log.astype(f32))
        y = self.scan(x, dt, a, b, c, self.D, state)
        return self.out_proj((y.astype(f32) * silu(z.astype(f32))).astype(h.dtype))

    def make_cache(self) -> RecurrentState:
        return RecurrentState((self.conv1d.name, self.scan.name))


class JambaMLP(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class JambaExperts(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = GateUp(n, hidden, inner)
        self.down_proj = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(self.gate_up_proj(x, ids), ids, weights)


class JambaSparseMoeBlock(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.router = Linear(cfg.hidden_size, cfg.num_experts)
        self.route = Route(cfg.num_experts, cfg.num_experts_per_tok, order="softmax_topk")
        self.experts = JambaExperts(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.route(self.router(x))
        return self.experts(x, ids, weights)


class JambaDecoderLayer(nn.Module):
    def __init__(self, cfg: JambaConfig, index: int) -> None:
        super().__init__()
        self.attends = cfg.layers_block_type[index] == ATTENTION
        if self.attends:
            self.self_attn = JambaAttention(cfg)
        else:
            self.mamba = JambaMambaMixer(cfg)
        self.feed_forward = JambaSparseMoeBlock(cfg) if cfg.layers_sparse[index] else JambaMLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        normed = self.input_layernorm(x)
        if self.attends:
            h = x + self.self_attn(normed, cast(KVCache | None, cache))
        else:
            h = x + self.mamba(normed, cast(State | None, cache))
        return h + self.feed_forward(self.pre_ff_layernorm(h))

    def make_cache(self) -> KVCache | RecurrentState:
        return KVCache() if self.attends else self.mamba.make_cache()


class JambaModel(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [JambaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.final_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.final_layernorm(h)


class JambaForCausalLM(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = JambaModel(cfg)
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
        """Keys and values for each attention layer, a RecurrentState (the convolution's window
        and the scan's state) for each Mamba layer."""
        return [layer.make_cache() for layer in self.model.layers]
