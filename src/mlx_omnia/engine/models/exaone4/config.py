"""Exaone4Config from config.json (transformers 4 and 5 schemas).

Both schemas write `layer_types` (EXAONE 4.0 appeared in transformers 4.54, with layer types);
without them the layers follow `sliding_window_pattern`: an int n makes every n-th layer global
(transformers' rule), a string such as "LLLG" names local (L) and global (G) layers, repeated
from layer 0, with the last layer always global. No `sliding_window` means no sliding layers.

Rope: with a sliding window, only the sliding layers rotate q/k; the global layers use no
position embedding (NoPE). Without a sliding window every layer uses rope."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """The attention kind of each layer (see the module docstring)."""
    value = config.get("layer_types")
    if isinstance(value, Sequence) and not isinstance(value, str):
        kinds = tuple(str(t) for t in cast(Sequence[Any], value))
        if len(kinds) != layers:
            raise UnsupportedModelError(
                f"exaone4: layer_types names {len(kinds)} layers, num_hidden_layers is {layers}"
            )
        other = sorted(set(kinds) - set(LAYER_TYPES))
        if other:
            raise UnsupportedModelError(
                f"exaone4: layer_types names {', '.join(other)}; supported: {', '.join(LAYER_TYPES)}"
            )
        return kinds
    pattern = config.get("sliding_window_pattern", 4)
    if config.get("sliding_window") is None or not pattern:
        return (LAYER_TYPES[1],) * layers
    if isinstance(pattern, str):
        if not pattern or set(pattern.upper()) - {"L", "G"}:
            raise UnsupportedModelError(
                f"exaone4: sliding_window_pattern {pattern!r} is not a string of L and G"
            )
        local = [pattern.upper()[i % len(pattern)] == "L" for i in range(layers)]
        local[-1] = False
    else:
        n = int(pattern)
        local = [(i + 1) % n != 0 for i in range(layers)]
    return tuple(LAYER_TYPES[0] if is_local else LAYER_TYPES[1] for is_local in local)


@dataclass(frozen=True)
class Exaone4Config:
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
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Exaone4Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"exaone4: hidden_act {act!r} is not supported (only silu)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        window = config.get("sliding_window")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window is not None else None,
            layer_types=layer_types(config, layers),
            rope=rope_parameters(config),
        )

    def uses_rope(self, layer_type: str) -> bool:
        """Global layers of a hybrid (windowed) model use no position embedding."""
        return self.sliding_window is None or layer_type == "sliding_attention"
