"""MistralConfig from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class MistralConfig:
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
    # Every layer attends over the last `sliding_window` positions (Mistral 7B v0.1: 4096);
    # None (v0.2 and later, NeMo) is full causal attention. transformers ignores layer_types here.
    sliding_window: int | None
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> MistralConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"mistral: hidden_act {act!r} is not supported (only silu)")
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
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window is not None else None,
            rope=rope_parameters(config),
        )
