"""FalconH1Config from config.json: transformers 5 (`rope_parameters`) and transformers 4 / the
hub's (top-level `rope_theta`, `rope_scaling`); the mamba and multiplier fields are spelled
alike in both."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"falcon_h1: {what}")


def _float(value: Any) -> float:
    """A number as config.json holds it: transformers 5 writes infinity as
    {"__float__": "Infinity"}, older configs as the bare token Infinity."""
    if isinstance(value, Mapping):
        return float(cast(Mapping[str, Any], value)["__float__"])
    return float(value)


def _multiplier(config: Mapping[str, Any], key: str) -> float:
    """A scalar multiplier (1 when absent); null is refused: transformers multiplies by it."""
    value = config.get(key, 1.0)
    if value is None:
        raise _refuse(f"{key} null is not supported (a number, 1 when absent)")
    return float(value)


def _multipliers(config: Mapping[str, Any], key: str, count: int) -> tuple[float, ...]:
    """A list of `count` multipliers (all 1 when absent or null, as transformers fills them)."""
    value = config.get(key)
    if value is None:
        return (1.0,) * count
    values = tuple(float(v) for v in cast(Sequence[Any], value))
    if len(values) != count:
        raise _refuse(f"{key} has {len(values)} values, not {count}")
    return values


@dataclass(frozen=True)
class FalconH1Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: Mapping[str, Any]
    # the mamba mixer
    mamba_d_ssm: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    mamba_rms_norm: bool
    mamba_norm_before_gate: bool
    projectors_bias: bool
    # the multipliers (muP): each scales one input or output as its name says
    embedding_multiplier: float
    lm_head_multiplier: float
    key_multiplier: float
    attention_in_multiplier: float
    attention_out_multiplier: float
    ssm_in_multiplier: float
    ssm_out_multiplier: float
    ssm_multipliers: tuple[float, ...]  # in_proj's z, x, B, C, dt
    mlp_multipliers: tuple[float, ...]  # gate_proj's output, down_proj's output

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> FalconH1Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = config.get("num_key_value_heads", 8)
        kv_heads = heads if kv_heads is None else int(kv_heads)
        if heads % kv_heads:
            raise _refuse(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                          f"{kv_heads}")
        d_ssm = config.get("mamba_d_ssm", 1024)
        d_ssm = int(config.get("mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
        ssm_heads = int(config.get("mamba_n_heads", 128))
        if d_ssm % ssm_heads:
            raise _refuse(f"mamba_n_heads {ssm_heads} does not divide mamba_d_ssm {d_ssm}")
        d_head = config.get("mamba_d_head", "auto")
        d_head = d_ssm // ssm_heads if d_head in ("auto", None) else int(d_head)
        if d_head * ssm_heads != d_ssm:
            raise _refuse(f"mamba_d_head * mamba_n_heads ({d_head * ssm_heads}) != mamba_d_ssm "
                          f"({d_ssm})")
        groups = int(config.get("mamba_n_groups", 1))
        if ssm_heads % groups:
            raise _refuse(f"mamba_n_heads {ssm_heads} is not a multiple of mamba_n_groups {groups}")
        limit = cast(Sequence[Any], config.get("time_step_limit") or (0.0, math.inf))
        if (_float(limit[0]), _float(limit[1])) != (0.0, math.inf):
            # the reference clamps the steps in its chunked prefill but not in its decode step,
            # so its prefill and its decode compute two models; released checkpoints do not clamp
            raise _refuse(f"time_step_limit {[_float(v) for v in limit]} is not supported "
                          "(only (0, inf): released checkpoints)")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size", 14336)),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # released configs give head_dim apart from hidden_size / heads
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope=rope_parameters(config),
            mamba_d_ssm=d_ssm,
            mamba_n_heads=ssm_heads,
            mamba_d_head=d_head,
            mamba_n_groups=groups,
            mamba_d_state=int(config.get("mamba_d_state", 256)),
            mamba_d_conv=int(config.get("mamba_d_conv", 4)),
            mamba_conv_bias=bool(config.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
            mamba_rms_norm=bool(config.get("mamba_rms_norm", False)),
            mamba_norm_before_gate=bool(config.get("mamba_norm_before_gate", True)),
            projectors_bias=bool(config.get("projectors_bias", False)),
            embedding_multiplier=_multiplier(config, "embedding_multiplier"),
            lm_head_multiplier=_multiplier(config, "lm_head_multiplier"),
            key_multiplier=_multiplier(config, "key_multiplier"),
            attention_in_multiplier=_multiplier(config, "attention_in_multiplier"),
            attention_out_multiplier=_multiplier(config, "attention_out_multiplier"),
            ssm_in_multiplier=_multiplier(config, "ssm_in_multiplier"),
            ssm_out_multiplier=_multiplier(config, "ssm_out_multiplier"),
            ssm_multipliers=_multipliers(config, "ssm_multipliers", 5),
            mlp_multipliers=_multipliers(config, "mlp_multipliers", 2),
        )
