"""GraniteMoeHybridForCausalLM (IBM Granite 4.0), module for module as the checkpoint names it.

A decoder layer is `input_layernorm`, then its mixer, `mamba` (Mamba-2) or `self_attn` as
`layer_types` says, then `post_attention_layernorm` and the feed-forward: `shared_mlp`, plus the
experts `block_sparse_moe` where num_local_experts > 0. Granite's scalars: the embeddings times
embedding_multiplier; the mixer's and the feed-forward's outputs times residual_multiplier before
each residual add; attention scores times attention_multiplier (not 1/sqrt(head_dim)); logits
divided by logits_scaling.

Attention: grouped-query, rope at the cache's offset only where position_embedding_type is
"rope" (Granite 4.0-H's attention has no positions: the Mamba layers carry order).

Mamba-2 mixer: in_proj gives [z | xBC | dt] (z the gate, mamba_intermediate_size; xBC the
convolved features, mamba_intermediate_size + 2 n_groups d_state; dt one a head); xBC passes a
short causal convolution (conv1d, then silu) and splits into x, B, C; the selective scan (core
SelectiveScan) runs with dt = softplus(dt + dt_bias), A = -exp(A_log) and the skip D
(time_step_limit (0, inf): no clamp); `norm` is RMS over groups of mamba_intermediate_size /
n_groups features of y * silu(z), times weight; then out_proj.

Feed-forward: shared_mlp's input_linear gives [gate | up], output_linear(silu(gate) * up). The
experts: `router.layer` logits, the top k logits softmaxed into weights, each selected expert's
input_linear [gate | up] rows and output_linear (stacked [experts, out, in], as the checkpoint
stores them)."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.activations import silu
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, GateUp, Route
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.core.recurrent import SelectiveScan, ShortConv, State
from mlx_omnia.engine.core.rope import build_rope
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.granitemoehybrid.config import MAMBA, GraniteMoeHybridConfig

LayerCache = KVCache | State  # an attention layer's, a Mamba layer's


class GraniteMoeHybridAttention(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        heads, kv_heads, dims = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, heads * dims, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * dims, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * dims, bias=bias)
        self.o_proj = Linear(heads * dims, cfg.hidden_size, bias=bias)
        if cfg.rope is not None:
            self.rope = build_rope(dims, cfg.rope)
        self.attention = AttentionStep(
            n_heads=heads, n_kv_heads=kv_heads, head_dim=dims, scale=cfg.attention_multiplier,
            rope=self.rope if cfg.rope is not None else None,
        )

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attention(q, k, v, cache))


class GraniteMoeHybridRMSNormGated(nn.Module):
    """RMS norm over groups of features of x * silu(gate), times weight (float32 inside)."""

    weight: mx.array

    def __init__(self, dims: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.groups, self.eps = groups, eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        f32 = mx.float32
        h = x.astype(f32) * silu(gate.astype(f32))
        grouped = reshape(h, *h.shape[:-1], self.groups, h.shape[-1] // self.groups)
        grouped = grouped * mx.rsqrt((grouped * grouped).mean(axis=-1, keepdims=True) + self.eps)
        return self.weight * reshape(grouped, *h.shape).astype(x.dtype)


class GraniteMoeHybridMambaLayer(nn.Module):
    A_log: mx.array
    D: mx.array
    dt_bias: mx.array

    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.inner = cfg.mamba_intermediate_size
        self.heads, self.head_dim = cfg.mamba_n_heads, cfg.mamba_d_head
        self.groups, self.state_size = cfg.mamba_n_groups, cfg.mamba_d_state
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        bias = cfg.mamba_proj_bias
        self.in_proj = Linear(cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias=bias)
        self.conv1d = ShortConv(self.conv_dim, cfg.mamba_d_conv, bias=cfg.mamba_conv_bias,
                                activation="silu")
        self.dt_bias = mx.ones((self.heads,))
        self.A_log = mx.zeros((self.heads,))
        self.D = mx.ones((self.heads,))  # pyright: ignore[reportConstantRedefinition]  # the checkpoint's name
        self.scan = SelectiveScan(heads=self.heads, head_dim=self.head_dim,
                                  state_size=self.state_size, groups=self.groups)
        self.norm = GraniteMoeHybridRMSNormGated(self.inner, self.groups, cfg.rms_norm_eps)
        self.out_proj = Linear(self.inner, cfg.hidden_size, bias=bias)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, length, _ = x.shape
        inner, conv_dim, groups_n = self.inner, self.conv_dim, self.groups * self.state_size
        projected = self.in_proj(x)
        z = projected[..., :inner]
        xbc = self.conv1d(projected[..., inner : inner + conv_dim], state)
        dt = projected[..., inner + conv_dim :].astype(mx.float32) + self.dt_bias.astype(mx.float32)
        dt = mx.logaddexp(dt, 0.0)  # softplus
        hs = reshape(xbc[..., :inner], b, length, self.heads, self.head_dim)
        bm = reshape(xbc[..., inner : inner + groups_n], b, length, self.groups, self.state_size)
        cm = reshape(xbc[..., inner + groups_n :], b, length, self.groups, self.state_size)
        a = -mx.exp(self.A_log.astype(mx.float32))
        y = self.scan(hs, dt, a, bm, cm, self.D, state)
        y = self.norm(reshape(y, b, length, inner), z)
        return self.out_proj(y.astype(x.dtype))


class GraniteMoeHybridMLP(nn.Module):
    """The shared MLP: input_linear gives [gate | up] side by side."""

    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.inner = cfg.shared_intermediate_size
        self.input_linear = Linear(cfg.hidden_size, 2 * self.inner)
        self.output_linear = Linear(self.inner, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self.input_linear(x)
        return self.output_linear(silu(gate_up[..., : self.inner]) * gate_up[..., self.inner :])


class GraniteMoeHybridTopKRouter(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.layer = Linear(cfg.hidden_size, cfg.num_local_experts)
        self.route = Route(cfg.num_local_experts, cfg.num_experts_per_tok, order="topk_softmax")

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(weights, ids) [..., k]: the k largest logits, softmaxed over those k."""
        return self.route(self.layer(x))


class GraniteMoeHybridMoE(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        n, hidden, inner = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.router = GraniteMoeHybridTopKRouter(cfg)
        self.input_linear = GateUp(n, hidden, inner)
        self.output_linear = DownCombine(n, inner, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.router(x)
        return self.output_linear(self.input_linear(x, ids), ids, weights)


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig, kind: str) -> None:
        super().__init__()
        self.is_mamba = kind == MAMBA
        if self.is_mamba:
            self.mamba = GraniteMoeHybridMambaLayer(cfg)
        else:
            self.self_attn = GraniteMoeHybridAttention(cfg)
        self.has_experts = cfg.num_local_experts > 0
        if self.has_experts:
            self.block_sparse_moe = GraniteMoeHybridMoE(cfg)
        self.shared_mlp = GraniteMoeHybridMLP(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = cfg.residual_multiplier

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        normed = self.input_layernorm(x)
        if self.is_mamba:
            mixed = self.mamba(normed, cast(State | None, cache))
        else:
            mixed = self.self_attn(normed, cast(KVCache | None, cache))
        h = x + mixed * self.residual_multiplier
        normed = self.post_attention_layernorm(h)
        out = self.shared_mlp(normed)
        if self.has_experts:
            out = self.block_sparse_moe(normed) + out
        return h + out * self.residual_multiplier

    def make_cache(self) -> KVCache | RecurrentState:
        if not self.is_mamba:
            return KVCache()
        return RecurrentState((self.mamba.conv1d.name, self.mamba.scan.name))


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [GraniteMoeHybridDecoderLayer(cfg, kind) for kind in cfg.layer_types]
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_multiplier = cfg.embedding_multiplier

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        h = self.embed_tokens(ids) * self.embedding_multiplier
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class GraniteMoeHybridForCausalLM(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = GraniteMoeHybridModel(cfg)
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
        return logits / self.config.logits_scaling

    def make_cache(self) -> list[KVCache | RecurrentState]:
        """Keys and values for each attention layer, a RecurrentState (convolution window and
        scan state) for each Mamba layer."""
        return [layer.make_cache() for layer in self.model.layers]
