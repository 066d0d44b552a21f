"""Mamba2ForCausalLM, module for module as the checkpoint names it (`backbone.*`).

A block is `norm`, then the `mixer`, added to the residual stream (kept in float32 when
residual_in_fp32). The mixer: in_proj gives [z | xBC | dt] (z the gate, intermediate_size;
xBC the convolved features, intermediate_size + 2 n_groups state_size; dt one a head); xBC
passes a short causal convolution (conv1d, then silu) and splits into x, B, C; the selective
scan (core SelectiveScan) runs with dt = softplus(dt + dt_bias),
A = -exp(A_log) and the skip D (time_step_limit (0, inf): no clamp); then `norm` gates and normalizes: RMS over groups of
intermediate_size / n_groups features of y * silu(z), times weight; then out_proj. The final
norm is `norm_f`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.layers import Embedding, Linear, RmsNorm
from mlx_omnia.engine.core.mxcompat import reshape, silu
from mlx_omnia.engine.core.recurrent import SelectiveScan, ShortConv, State
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.models.mamba2.config import Mamba2Config


class MambaRMSNormGated(nn.Module):
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


class Mamba2Mixer(nn.Module):
    A_log: mx.array
    D: mx.array
    dt_bias: mx.array

    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.inner, self.heads, self.head_dim = cfg.intermediate_size, cfg.num_heads, cfg.head_dim
        self.groups, self.state_size = cfg.n_groups, cfg.state_size
        conv_dim = self.inner + 2 * self.groups * self.state_size
        self.in_proj = Linear(cfg.hidden_size, self.inner + conv_dim + self.heads, bias=cfg.use_bias)
        self.conv1d = ShortConv(conv_dim, cfg.conv_kernel, bias=cfg.use_conv_bias, activation="silu")
        self.dt_bias = mx.ones((self.heads,))
        self.A_log = mx.zeros((self.heads,))
        self.D = mx.ones((self.heads,))  # pyright: ignore[reportConstantRedefinition]  # the checkpoint's name
        self.scan = SelectiveScan(heads=self.heads, head_dim=self.head_dim,
                                  state_size=self.state_size, groups=self.groups)
        self.norm = MambaRMSNormGated(self.inner, self.groups, cfg.layer_norm_epsilon)
        self.out_proj = Linear(self.inner, cfg.hidden_size, bias=cfg.use_bias)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        b, length, _ = x.shape
        projected = self.in_proj(x)
        inner, groups_n = self.inner, self.groups * self.state_size
        z = projected[..., :inner]
        xbc = self.conv1d(projected[..., inner : -self.heads], state)
        dt = projected[..., -self.heads :].astype(mx.float32) + self.dt_bias.astype(mx.float32)
        dt = mx.logaddexp(dt, 0.0)  # softplus
        hs = reshape(xbc[..., :inner], b, length, self.heads, self.head_dim)
        bm = reshape(xbc[..., inner : inner + groups_n], b, length, self.groups, self.state_size)
        cm = reshape(xbc[..., inner + groups_n :], b, length, self.groups, self.state_size)
        a = -mx.exp(self.A_log.astype(mx.float32))
        y = self.scan(hs, dt, a, bm, cm, self.D, state)
        y = self.norm(reshape(y, b, length, inner), z)
        return self.out_proj(y.astype(x.dtype))


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RmsNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(cfg)

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        h = self.mixer(self.norm(x.astype(self.norm.weight.dtype)), state)
        return (x.astype(mx.float32) if self.residual_in_fp32 else x) + h

    def make_cache(self) -> RecurrentState:
        return RecurrentState((self.mixer.conv1d.name, self.mixer.scan.name))


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Mamba2Block(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm_f = RmsNorm(cfg.hidden_size, cfg.layer_norm_epsilon)

    def __call__(self, ids: mx.array, cache: list[State] | None) -> mx.array:
        h = self.embeddings(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm_f(h.astype(self.norm_f.weight.dtype))


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = Mamba2Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self, ids: mx.array, cache: list[State] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.backbone(ids, cache)
        if last_only:
            h = h[:, -1:]
        if self.config.tie_word_embeddings:
            return self.backbone.embeddings.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[RecurrentState]:
        """A RecurrentState a layer (its convolution's window and its scan's state)."""
        return [layer.make_cache() for layer in self.backbone.layers]
