"""SmolLM3Config from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


def _uses_rope(config: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Per layer, whether it applies rope: `no_rope_layers[i]` is 1 for a rope layer and 0 for
    a NoPE layer (transformers' naming); when absent, every `no_rope_layer_interval`-th layer
    is NoPE."""
    given = config.get("no_rope_layers")
    if isinstance(given, Sequence) and not isinstance(given, str):
        flags = [bool(int(v)) for v in cast(Sequence[Any], given)]
        if len(flags) < layers:
            raise UnsupportedModelError(
                f"smollm3: no_rope_layers has {len(flags)} entries for {layers} layers"
            )
        return tuple(flags[:layers])
    interval = int(config.get("no_rope_layer_interval", 4))
    return tuple((i + 1) % interval != 0 for i in range(layers))


@dataclass(frozen=True)
class SmolLM3Config:
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
    use_rope: tuple[bool, ...]
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> SmolLM3Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"smollm3: hidden_act {act!r} is not supported (only silu)")
        if config.get("use_sliding_window", False):
            raise UnsupportedModelError(
                "smollm3: use_sliding_window is true in config.json; sliding-window attention "
                "is not supported yet (released SmolLM3 checkpoints set it to false)"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            use_rope=_uses_rope(config, layers),
            rope=rope_parameters(config),
        )
