"""Phi3Config from config.json (transformers 4 and 5 schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """Rope parameters as transformers' Phi3Config reads them: "su" is the old name of
    longrope; a top-level original_max_position_embeddings (Phi-3 configs carry one) wins over
    the rope dict's; partial_rotary_factor from the rope dict, else the top level."""
    params = rope_parameters(config)
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    if params["rope_type"] not in ("default", "longrope"):
        raise UnsupportedModelError(
            f"phi3: rope type {params['rope_type']!r} is not supported (default and longrope are)"
        )
    max_len = int(config.get("max_position_embeddings", 4096))
    if config.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = int(config["original_max_position_embeddings"])
    params.setdefault("original_max_position_embeddings", max_len)
    params["max_position_embeddings"] = max_len
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return params


@dataclass(frozen=True)
class Phi3Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dims: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Every layer attends over the last `sliding_window` positions (Phi-3-mini-4k: 2047).
    sliding_window: int | None
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Phi3Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"phi3: hidden_act {act!r} is not supported (only silu)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        rope = _rope(config)
        window = config.get("sliding_window")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dims=int(head_dim * float(rope["partial_rotary_factor"])),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window is not None else None,
            rope=rope,
        )
