"""CohereConfig from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class CohereConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    layer_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # Logits are multiplied by it (Command R: 0.0625, R+: 0.8333).
    logit_scale: float
    # A LayerNorm per head over head_dim on queries and keys (Command R+).
    use_qk_norm: bool
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> CohereConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"cohere: hidden_act {act!r} is not supported (only silu)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        scale = config.get("logit_scale", 0.0625)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            layer_norm_eps=float(config.get("layer_norm_eps") or 1e-5),
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            logit_scale=float(scale) if scale is not None else 1.0,
            use_qk_norm=bool(config.get("use_qk_norm", False)),
            rope=rope_parameters(config),
        )
