"""FalconH1ForCausalLM, module for module as the checkpoint names it.

Every decoder layer runs attention and a Mamba-2 mixer side by side on the same normed input,
each scaled by its multipliers (muP), then a gated MLP:

    n = input_layernorm(x)
    h = x + mamba(n) * ssm_out_multiplier
          + self_attn(n * attention_in_multiplier) * attention_out_multiplier
    y = h + feed_forward(pre_ff_layernorm(h))

The embedding's rows are scaled by embedding_multiplier, the logits by lm_head_multiplier, and
the final norm is `final_layernorm`.

Attention: grouped-query attention with rope over head_dim features (given apart from
hidden_size / heads in released configs); the keys are scaled by key_multiplier.

The mixer: in_proj(x * ssm_in_multiplier), times the muP vector (ssm_multipliers' five values
over its [z | x | B | C | dt] parts), gives the gate z (mamba_d_ssm), the convolved features
xBC and dt (one a head); xBC passes a short causal convolution (conv1d, then silu) and splits
into x, B, C; the selective scan (core SelectiveScan) runs with dt = softplus(dt + dt_bias),
A = -exp(A_log) and the skip D (time_step_limit (0, inf): no clamp). Its output is gated by
silu(z), or with mamba_rms_norm passes `norm`, an RMS norm over mamba_n_groups groups of
features, times weight, gated by silu(z) before (mamba_norm_before_gate false) or after it;
then out_proj.

MLP: down_proj(up_proj(x) * silu(gate_proj(x) * gate multiplier)) * down multiplier.

A layer carries two caches, its attention's keys and values and its mixer's RecurrentState;
the network's cache list holds them side by side (2 i, 2 i + 1 for layer i), so every decode
path (the compiled step, a batch's rows, the prefix cache) sees one of each kind."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.recurrent import SelectiveScan, ShortConv, State
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.falcon_h1.config import FalconH1Config

LayerCache = KVCache | State  # an attention's keys and values, a mixer's state


class FalconH1Attention(nn.Module):
    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        heads, kv_heads, dims = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.key_multiplier = cfg.key_multiplier
        self.q_proj = Linear(cfg.hidden_size, heads * dims, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * dims, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * dims, bias=bias)
        self.o_proj = Linear(heads * dims, cfg.hidden_size, bias=bias)
        self.rope = build_rope(dims, cfg.rope)
        self.attention = AttentionStep(
            n_heads=heads, n_kv_heads=kv_heads, head_dim=dims, rope=self.rope
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x) * self.key_multiplier, self.v_proj(x)
        return self.o_proj(self.attention(q, k, v, cache))


class FalconH1RMSNormGated(nn.Module):
    """RMS norm over `groups` groups of features, times weight, gated by silu(gate) after the
    norm (`norm_before_gate`) or before it (float32 inside)."""

    weight: mx.array

    def __init__(self, dims: int, groups: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        f32 = mx.float32
        h = x.astype(f32)
        if not self.norm_before_gate:
            h = h * silu(gate.astype(f32))
        grouped = reshape(h, *h.shape[:-1], self.groups, h.shape[-1] // self.groups)
        grouped = grouped * mx.rsqrt((grouped * grouped).mean(axis=-1, keepdims=True) + self.eps)
        h = self.weight.astype(f32) * reshape(grouped, *h.shape)
        if self.norm_before_gate:
            h = h * silu(gate.astype(f32))
        return h.astype(x.dtype)


class FalconH1Mixer(nn.Module):
    A_log: mx.array
    D: mx.array
    dt_bias: mx.array

    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        self.inner, self.heads, self.head_dim = cfg.mamba_d_ssm, cfg.mamba_n_heads, cfg.mamba_d_head
        self.groups, self.state_size = cfg.mamba_n_groups, cfg.mamba_d_state
        self.ssm_in_multiplier = cfg.ssm_in_multiplier
        grouped = self.groups * self.state_size
        conv_dim = self.inner + 2 * grouped
        self.in_proj = Linear(cfg.hidden_size, self.inner + conv_dim + self.heads,
                              bias=cfg.mamba_proj_bias)
        # muP: each of in_proj's parts [z | x | B | C | dt] scaled by its multiplier. Derived
        # from the config, never loaded (kept out of the parameter tree).
        parts = (self.inner, self.inner, grouped, grouped, self.heads)
        self._mup_vector = mx.concatenate(
            [mx.full((n,), m, mx.float32) for n, m in zip(parts, cfg.ssm_multipliers, strict=True)]
        )
        self.conv1d = ShortConv(conv_dim, cfg.mamba_d_conv, bias=cfg.mamba_conv_bias,
                                activation="silu")
        self.dt_bias = mx.ones((self.heads,))
        self.A_log = mx.zeros((self.heads,))
        self.D = mx.ones((self.heads,))  # pyright: ignore[reportConstantRedefinition]  # the checkpoint's name
        self.scan = SelectiveScan(heads=self.heads, head_dim=self.head_dim,
                                  state_size=self.state_size, groups=self.groups)
        self.mamba_rms_norm = cfg.mamba_rms_norm
        if self.mamba_rms_norm:
            self.norm = FalconH1RMSNormGated(self.inner, self.groups, cfg.rms_norm_eps,
                                             cfg.mamba_norm_before_gate)
        self.out_proj = Linear(self.inner, cfg.hidden_size, bias=cfg.projectors_bias)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, length, _ = x.shape
        projected = self.in_proj(x * self.ssm_in_multiplier)
        projected = projected * self._mup_vector.astype(projected.dtype)
        inner, grouped = self.inner, self.groups * self.state_size
        z = projected[..., :inner]
        xbc = self.conv1d(projected[..., inner : -self.heads], state)
        dt = projected[..., -self.heads :].astype(mx.float32) + self.dt_bias.astype(mx.float32)
        dt = mx.logaddexp(dt, 0.0)  # softplus
        hs = reshape(xbc[..., :inner], b, length, self.heads, self.head_dim)
        bm = reshape(xbc[..., inner : inner + grouped], b, length, self.groups, self.state_size)
        cm = reshape(xbc[..., inner + grouped :], b, length, self.groups, self.state_size)
        a = -mx.exp(self.A_log.astype(mx.float32))
        y = reshape(self.scan(hs, dt, a, bm, cm, self.D, state), b, length, inner)
        y = self.norm(y, z) if self.mamba_rms_norm else y * silu(z)
        return self.out_proj(y.astype(x.dtype))


class FalconH1MLP(nn.Module):
    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.up_proj(x) * silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        self.attention_in_multiplier = cfg.attention_in_multiplier
        self.attention_out_multiplier = cfg.attention_out_multiplier
        self.ssm_out_multiplier = cfg.ssm_out_multiplier
        self.feed_forward = FalconH1MLP(cfg)
        self.mamba = FalconH1Mixer(cfg)
        self.self_attn = FalconH1Attention(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, kv: KVCache | None, state: State | None) -> mx.array:
        n = self.input_layernorm(x)
        mixed = self.mamba(n, state) * self.ssm_out_multiplier
        attended = self.self_attn(n * self.attention_in_multiplier, kv)
        h = x + (mixed + attended * self.attention_out_multiplier)
        return h + self.feed_forward(self.pre_ff_layernorm(h))

    def make_cache(self) -> tuple[KVCache, RecurrentState]:
        return KVCache(), RecurrentState((self.mamba.conv1d.name, self.mamba.scan.name))


class FalconH1Model(nn.Module):
    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        self.embedding_multiplier = cfg.embedding_multiplier
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [FalconH1DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.final_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.embed_tokens(ids) * self.embedding_multiplier
        for i, layer in enumerate(self.layers):
            if cache is None:
                h = layer(h, None, None)
            else:
                h = layer(h, cast(KVCache, cache[2 * i]), cast(State, cache[2 * i + 1]))
        return self.final_layernorm(h)


class FalconH1ForCausalLM(nn.Module):
    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = FalconH1Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[LayerCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return logits * self.config.lm_head_multiplier

    def make_cache(self) -> list[KVCache | RecurrentState]:
        """Each layer's keys and values, then its mixer's RecurrentState (its convolution's
        window and its scan's state): two entries a layer."""
        return [c for layer in self.model.layers for c in layer.make_cache()]
