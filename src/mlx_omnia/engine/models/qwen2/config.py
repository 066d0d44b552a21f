"""Qwen2Config from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


def _check_full_attention(config: Mapping[str, Any]) -> None:
    """Only full causal attention is implemented: refuse sliding-window layers by name.

    Released Qwen2 checkpoints carry `sliding_window`/`max_window_layers` with
    `use_sliding_window: false` (then both are ignored, as transformers ignores them);
    transformers 5 also writes `layer_types`, all "full_attention" in that case."""
    if config.get("use_sliding_window", False):
        raise UnsupportedModelError(
            "qwen2: use_sliding_window is true in config.json; sliding-window attention is not "
            "supported yet (released Qwen2 checkpoints set it to false)"
        )
    layer_types = config.get("layer_types")
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
        kinds = {str(t) for t in cast(Sequence[Any], layer_types)}
        other = sorted(kinds - {"full_attention"})
        if other:
            raise UnsupportedModelError(
                f"qwen2: layer_types names {', '.join(other)}; only full_attention layers are "
                "supported (sliding-window attention is not supported yet)"
            )


@dataclass(frozen=True)
class Qwen2Config:
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
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen2Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"qwen2: hidden_act {act!r} is not supported (only silu)")
        _check_full_attention(config)
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
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope=rope_parameters(config),
        )
