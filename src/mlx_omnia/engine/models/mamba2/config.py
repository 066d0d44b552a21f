"""Mamba2Config from config.json (transformers 4 and 5 name its fields alike)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.errors import UnsupportedModelError


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"mamba2: {what}")


def _float(value: Any) -> float:
    """A number as config.json holds it: transformers 5 writes infinity as
    {"__float__": "Infinity"}, older configs as the bare token Infinity."""
    if isinstance(value, Mapping):
        return float(cast(Mapping[str, Any], value)["__float__"])
    return float(value)


@dataclass(frozen=True)
class Mamba2Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    use_bias: bool
    use_conv_bias: bool
    num_hidden_layers: int
    vocab_size: int
    layer_norm_epsilon: float
    residual_in_fp32: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Mamba2Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        hidden = int(config["hidden_size"])
        expand = int(config.get("expand", 2))
        heads, head_dim = int(config["num_heads"]), int(config.get("head_dim", 64))
        if hidden * expand != heads * head_dim:
            raise _refuse(f"hidden_size * expand ({hidden * expand}) != num_heads * head_dim "
                          f"({heads * head_dim})")
        groups = int(config.get("n_groups", 8))
        if heads % groups:
            raise _refuse(f"num_heads {heads} is not a multiple of n_groups {groups}")
        limit = cast(Sequence[Any], config.get("time_step_limit") or (0.0, math.inf))
        if (_float(limit[0]), _float(limit[1])) != (0.0, math.inf):
            # the reference clamps the steps in its chunked prefill but not in its decode step,
            # so its prefill and its decode compute two models; released checkpoints do not clamp
            raise _refuse(f"time_step_limit {[_float(v) for v in limit]} is not supported "
                          "(only (0, inf): released checkpoints)")
        return cls(
            hidden_size=hidden,
            intermediate_size=hidden * expand,
            num_heads=heads,
            head_dim=head_dim,
            state_size=int(config.get("state_size", 128)),
            n_groups=groups,
            conv_kernel=int(config.get("conv_kernel", 4)),
            use_bias=bool(config.get("use_bias", False)),
            use_conv_bias=bool(config.get("use_conv_bias", True)),
            num_hidden_layers=int(config["num_hidden_layers"]),
            vocab_size=int(config["vocab_size"]),
            layer_norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
            residual_in_fp32=bool(config.get("residual_in_fp32", True)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # a state space model has no position limit; the context a request may fill
            max_position_embeddings=int(config.get("max_position_embeddings") or 1 << 20),
        )
