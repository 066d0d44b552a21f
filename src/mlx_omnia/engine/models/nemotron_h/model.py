"""NemotronHForCausalLM, module for module as the checkpoint names it (`backbone.*`, `lm_head`).

Every block is `norm`, then its `mixer`, added to the residual: h = x + mixer(norm(x)). The
mixer is the block's kind (`layer_types`; hybrid_override_pattern's letter):

  M  Mamba-2: in_proj gives [z | xBC | dt] (z the gate; xBC the convolved features,
     mamba_num_heads * mamba_head_dim + 2 n_groups ssm_state_size; dt one a head); xBC passes a
     causal depthwise convolution (conv1d, then silu) and splits into x, B, C; the selective
     scan (core SelectiveScan) runs with dt = max(softplus(dt + dt_bias), time_step_min),
     A = -exp(A_log) and the skip D; `norm` normalizes y * silu(z) by RMS over n_groups groups
     of features, times weight; then out_proj.
  *  attention: q/k/v/o projections without bias, grouped-query, causal, and no positional
     encoding (the Mamba layers carry the order).
  -  MLP: down_proj(relu(up_proj(x))^2).
  E  experts: the router `gate` (float32) scores sigmoid(logits); experts are chosen by
     score + e_score_correction_bias (the bias picks, it does not weigh) among the topk_group of
     n_group groups whose two best biased scores sum highest; the chosen scores, renormalized
     when norm_topk_prob (/ (sum + 1e-20)) and times routed_scaling_factor, weigh the chosen
     experts' MLPs down(relu(up x)^2) (stacked as experts.up_proj / experts.down_proj), which run
     at moe_latent_size features where set (fc1_latent_proj in, fc2_latent_proj out); plus
     `shared_experts`, an MLP of the block's input.

The final norm is `norm_f`. `lm_head` is a matrix of its own even where the config says
tie_word_embeddings: transformers ties nothing in this family and saves the head.

The clamp at time_step_min is transformers' chunked (prompt) form; its one-token step leaves it
out, so transformers' prefill and decode differ where a step falls below time_step_min (0.001
in released configs). Here both clamp: a prompt gives the same logits fed whole or a token at
a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.moe import DownCombine, ExpertLinear, sigmoid_group_topk
from mlx_omnia.engine.core.mxcompat import reshape, silu
from mlx_omnia.engine.core.recurrent import SelectiveScan, ShortConv, State
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.nemotron_h.config import ATTENTION, MAMBA, MLP, NemotronHConfig

LayerCache = KVCache | State  # an attention block's, a Mamba block's


def relu2(x: mx.array) -> mx.array:
    """relu(x)^2, transformers' "relu2"."""
    return mx.square(mx.maximum(x, 0))


class NemotronHRMSNormGated(nn.Module):
    """RMS norm over groups of `group_size` features of x * silu(gate), times weight (float32
    inside)."""

    weight: mx.array

    def __init__(self, dims: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group_size, self.eps = group_size, eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        f32 = mx.float32
        h = x.astype(f32) * silu(gate.astype(f32))
        grouped = reshape(h, *h.shape[:-1], h.shape[-1] // self.group_size, self.group_size)
        grouped = grouped * mx.rsqrt((grouped * grouped).mean(axis=-1, keepdims=True) + self.eps)
        return self.weight * reshape(grouped, *h.shape).astype(x.dtype)


class NemotronHMamba2Mixer(nn.Module):
    A_log: mx.array
    D: mx.array
    dt_bias: mx.array

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.inner = inner = cfg.mamba_intermediate_size
        self.groups, self.state_size = cfg.n_groups, cfg.ssm_state_size
        self.time_step_min = cfg.time_step_min
        conv_dim = inner + 2 * self.groups * self.state_size
        self.in_proj = Linear(cfg.hidden_size, inner + conv_dim + self.heads, bias=cfg.use_bias)
        self.conv1d = ShortConv(conv_dim, cfg.conv_kernel, bias=cfg.use_conv_bias, activation="silu")
        self.dt_bias = mx.ones((self.heads,))
        self.A_log = mx.zeros((self.heads,))
        self.D = mx.ones((self.heads,))  # pyright: ignore[reportConstantRedefinition]  # the checkpoint's name
        self.scan = SelectiveScan(heads=self.heads, head_dim=self.head_dim,
                                  state_size=self.state_size, groups=self.groups,
                                  chunk=cfg.chunk_size)
        self.norm = NemotronHRMSNormGated(inner, inner // self.groups, cfg.layer_norm_epsilon)
        self.out_proj = Linear(inner, cfg.hidden_size, bias=cfg.use_bias)
        self._split = (inner, 2 * inner + 2 * self.groups * self.state_size)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, length, _ = x.shape
        f32 = mx.float32
        z, xbc, dt = mx.split(self.in_proj(x), self._split, axis=-1)
        xbc = self.conv1d(xbc, state)
        hs, bm, cm = mx.split(xbc, (self.inner, self.inner + self.groups * self.state_size), axis=-1)
        dt = mx.logaddexp(dt.astype(f32) + self.dt_bias.astype(f32), 0.0)  # softplus
        dt = mx.maximum(dt, self.time_step_min)
        a = -mx.exp(self.A_log.astype(f32))
        y = self.scan(
            reshape(hs, b, length, self.heads, self.head_dim), dt, a,
            reshape(bm, b, length, self.groups, self.state_size),
            reshape(cm, b, length, self.groups, self.state_size), self.D, state,
        )
        y = self.norm(reshape(y, b, length, self.inner), z)
        return self.out_proj(y.astype(x.dtype))


class NemotronHAttention(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
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


class NemotronHMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHTopkRouter(nn.Module):
    """Router logits in float32 -> (weights, ids) [..., num_experts_per_tok], as the module
    docstring says; the weights stay float32 (transformers sums the experts in float32)."""

    weight: mx.array
    e_score_correction_bias: mx.array

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.weight = mx.zeros((cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = mx.zeros((cfg.n_routed_experts,))
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


class NemotronHExpertsUp(ExpertLinear):
    """The selected experts' up projections, without a gate: x [..., in], ids [..., k] ->
    x @ U[e].T [..., k, out] for each selected expert e. Core's GateUp computes gated experts
    only (silu(gate) * up); these are core's products of stacked, possibly quantized,
    matrices (ExpertLinear), declared here for the non-gated MLP."""

    def __init__(self, n_experts: int, input_dims: int, output_dims: int) -> None:
        super().__init__(n_experts, input_dims, output_dims)
        self._bound: Callable[[mx.array, mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array, mx.array], mx.array]:
        return self.products()

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        return self._bound(x, ids)


class NemotronHExperts(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        n, inner = cfg.n_routed_experts, cfg.moe_intermediate_size
        width = cfg.moe_latent_size if cfg.moe_latent_size is not None else cfg.hidden_size
        self.up_proj = NemotronHExpertsUp(n, width, inner)
        self.down_proj = DownCombine(n, inner, width)

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self.down_proj(relu2(self.up_proj(x, ids)), ids, weights)


class NemotronHMoE(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        hidden, latent = cfg.hidden_size, cfg.moe_latent_size
        self.gate = NemotronHTopkRouter(cfg)
        self.experts = NemotronHExperts(cfg)
        self.shared_experts = NemotronHMLP(hidden, cfg.moe_shared_expert_intermediate_size,
                                           cfg.mlp_bias)
        self.latent = latent is not None
        if latent is not None:
            self.fc1_latent_proj = Linear(hidden, latent, bias=cfg.mlp_bias)
            self.fc2_latent_proj = Linear(latent, hidden, bias=cfg.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.gate(x)
        if self.latent:
            routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), ids, weights))
        else:
            routed = self.experts(x, ids, weights)
        return routed + self.shared_experts(x)


Mixer = NemotronHMamba2Mixer | NemotronHAttention | NemotronHMLP | NemotronHMoE


def _mixer(cfg: NemotronHConfig, kind: str) -> Mixer:
    if kind == MAMBA:
        return NemotronHMamba2Mixer(cfg)
    if kind == ATTENTION:
        return NemotronHAttention(cfg)
    if kind == MLP:
        return NemotronHMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
    return NemotronHMoE(cfg)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: NemotronHConfig, kind: str) -> None:
        super().__init__()
        self.norm = RmsNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer: Mixer = _mixer(cfg, kind)
        self.cached = kind in (MAMBA, ATTENTION)  # whether the block has a cache of its own

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        h, mixer = self.norm(x), self.mixer
        if isinstance(mixer, NemotronHMamba2Mixer):
            return x + mixer(h, cast(State | None, cache))
        if isinstance(mixer, NemotronHAttention):
            return x + mixer(h, cast(KVCache | None, cache))
        return x + mixer(h)

    def make_cache(self) -> KVCache | RecurrentState | None:
        mixer = self.mixer
        if isinstance(mixer, NemotronHMamba2Mixer):
            return RecurrentState((mixer.conv1d.name, mixer.scan.name))
        return KVCache() if isinstance(mixer, NemotronHAttention) else None


class NemotronHModel(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [NemotronHBlock(cfg, kind) for kind in cfg.layer_types]
        self.norm_f = RmsNorm(cfg.hidden_size, cfg.layer_norm_epsilon)

    def __call__(self, ids: mx.array, cache: list[LayerCache] | None) -> mx.array:
        """`cache` holds the attention and Mamba blocks' caches, in block order (the MLP and
        experts blocks carry nothing from token to token)."""
        h = self.embeddings(ids)
        caches = iter(cache) if cache is not None else None
        for layer in self.layers:
            h = layer(h, next(caches) if caches is not None and layer.cached else None)
        return self.norm_f(h)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = NemotronHModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[LayerCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.backbone(ids, cache)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache | RecurrentState]:
        """Keys and values for each attention block, a RecurrentState (the convolution's window
        and the scan's state) for each Mamba block; nothing for the MLP and experts blocks."""
        caches = (layer.make_cache() for layer in self.backbone.layers)
        return [c for c in caches if c is not None]
