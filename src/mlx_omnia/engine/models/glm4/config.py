"""Glm4Config from config.json (transformers 4 and 5 schemas).

The rotated fraction of each head, `partial_rotary_factor` (0.5 in released GLM-4-0414), is a
top-level key in transformers 4 configs and part of `rope_parameters` in transformers 5."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # transformers' Glm4Config default


@dataclass(frozen=True)
class Glm4Config:
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
    rotary_dims: int
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Glm4Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"glm4: hidden_act {act!r} is not supported (only silu)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        rope = rope_parameters(config)
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        if factor is None:
            factor = DEFAULT_PARTIAL_ROTARY_FACTOR
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1.5625e-07)),
            max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", True)),
            rotary_dims=int(head_dim * float(factor)),
            rope=rope,
        )
