"""GemmaConfig from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

# Both name the tanh approximation for Gemma: released configs say hidden_act "gelu" (a legacy
# value transformers reads as gelu_pytorch_tanh) and, later ones, hidden_activation.
TANH_GELU_NAMES = ("gelu", "gelu_pytorch_tanh")


def _check_activation(config: Mapping[str, Any]) -> None:
    activation = config.get("hidden_activation")
    if activation is not None and activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(
            f"gemma: hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)"
        )
    act = config.get("hidden_act", "gelu_pytorch_tanh")
    if act not in TANH_GELU_NAMES:
        raise UnsupportedModelError(
            f"gemma: hidden_act {act!r} is not supported (only gelu_pytorch_tanh)"
        )


@dataclass(frozen=True)
class GemmaConfig:
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
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GemmaConfig:
        _check_activation(config)
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "gemma: use_bidirectional_attention is true (an encoder); only causal decoders "
                "are supported"
            )
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
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            rope=rope_parameters(config),
        )
