"""Starcoder2Config from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class Starcoder2Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    norm_epsilon: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    use_bias: bool
    # Every layer attends over the last `sliding_window` positions (released: 4096).
    sliding_window: int | None
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Starcoder2Config:
        act = config.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"starcoder2: hidden_act {act!r} is not supported (only {', '.join(ACTIVATIONS)})"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        window = config.get("sliding_window")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            norm_epsilon=float(config.get("norm_epsilon", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            use_bias=bool(config.get("use_bias", True)),
            sliding_window=int(window) if window is not None else None,
            rope=rope_parameters(config),
        )
