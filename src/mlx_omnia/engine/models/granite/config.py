"""GraniteConfig from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class GraniteConfig:
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
    # Granite's scalars: embeddings times embedding_multiplier, attention scores times
    # attention_multiplier (instead of 1/sqrt(head_dim)), each block's output times
    # residual_multiplier before the residual add, logits divided by logits_scaling.
    embedding_multiplier: float
    attention_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GraniteConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"granite: hidden_act {act!r} is not supported (only silu)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
            attention_multiplier=float(config.get("attention_multiplier", 1.0)),
            residual_multiplier=float(config.get("residual_multiplier", 1.0)),
            logits_scaling=float(config.get("logits_scaling", 1.0)),
            rope=rope_parameters(config),
        )
