"""Gemma3TextConfig from config.json (transformers 4 and 5 schemas).

Layers are sliding-window or global (`layer_types` in transformers 5; transformers 4 configs
give `sliding_window_pattern`, every pattern-th layer global, default 6). Each kind has its own
rope: transformers 5 writes `rope_parameters` per layer type; transformers 4 wrote `rope_theta`
and `rope_scaling` for the global layers and `rope_local_base_freq` for the sliding ones (whose
rope is never scaled)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' Gemma3TextConfig defaults.
GLOBAL_THETA, LOCAL_THETA, SLIDING_WINDOW_PATTERN = 1_000_000.0, 10_000.0, 6


def _layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    value = config.get("layer_types")
    if isinstance(value, Sequence) and not isinstance(value, str):
        kinds = tuple(str(t) for t in cast(Sequence[Any], value))
        if len(kinds) != layers:
            raise UnsupportedModelError(
                f"gemma3_text: layer_types names {len(kinds)} layers, num_hidden_layers is {layers}"
            )
        other = sorted(set(kinds) - set(LAYER_TYPES))
        if other:
            raise UnsupportedModelError(
                f"gemma3_text: layer_types names {', '.join(other)}; supported: "
                f"{', '.join(LAYER_TYPES)}"
            )
        return kinds
    pattern = int(config.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN)
    return tuple(LAYER_TYPES[0] if (i + 1) % pattern else LAYER_TYPES[1] for i in range(layers))


def layer_rope(config: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
    """The rope parameters of `layer_type` layers, from either schema."""
    per_type = config.get("rope_parameters")
    if isinstance(per_type, Mapping) and isinstance(
        cast(Mapping[str, Any], per_type).get(layer_type), Mapping
    ):
        return rope_parameters(config, layer_type)
    if layer_type == "sliding_attention":
        theta = config.get("rope_local_base_freq")
        return {"rope_type": "default", "rope_theta": float(theta or LOCAL_THETA)}
    theta = config.get("rope_theta")
    return rope_parameters({**config, "rope_theta": float(theta or GLOBAL_THETA)})


def _optional_float(value: Any) -> float | None:
    return float(value) if value is not None else None


@dataclass(frozen=True)
class Gemma3TextConfig:
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
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5).
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope: Mapping[str, Mapping[str, Any]]  # layer type -> rope parameters

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Gemma3TextConfig:
        act = config.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(
                f"gemma3_text: hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"
            )
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "gemma3_text: use_bidirectional_attention is true (an embedding encoder); only "
                "causal decoders are supported"
            )
        if config.get("attn_logit_softcapping") is not None:
            # transformers' Gemma 3 attention ignores it; released checkpoints set null.
            raise UnsupportedModelError(
                "gemma3_text: attn_logit_softcapping is set; Gemma 3 attention has no "
                "soft-capping (released checkpoints set it to null)"
            )
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        window = config.get("sliding_window")
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or 256),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=_optional_float(config.get("final_logit_softcapping")),
            sliding_window=int(window) if window is not None else None,
            layer_types=_layer_types(config, layers),
            rope={kind: layer_rope(config, kind) for kind in LAYER_TYPES},
        )
