"""Gemma2Config from config.json (transformers 4 and 5 schemas).

transformers 5 writes `layer_types`; transformers 4 configs have none and alternate the layers,
sliding-window first (layer 0 sliding, 1 global, ...), which is also what transformers 5 assumes
when `layer_types` is absent."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    value = config.get("layer_types")
    if isinstance(value, Sequence) and not isinstance(value, str):
        kinds = tuple(str(t) for t in cast(Sequence[Any], value))
        if len(kinds) != layers:
            raise UnsupportedModelError(
                f"gemma2: layer_types names {len(kinds)} layers, num_hidden_layers is {layers}"
            )
        other = sorted(set(kinds) - set(LAYER_TYPES))
        if other:
            raise UnsupportedModelError(
                f"gemma2: layer_types names {', '.join(other)}; supported: {', '.join(LAYER_TYPES)}"
            )
        return kinds
    return tuple(LAYER_TYPES[0] if (i + 1) % 2 else LAYER_TYPES[1] for i in range(layers))


def _optional_float(value: Any) -> float | None:
    return float(value) if value is not None else None


@dataclass(frozen=True)
class Gemma2Config:
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
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Gemma2Config:
        act = config.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(
                f"gemma2: hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"
            )
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "gemma2: use_bidirectional_attention is true (an encoder); only causal decoders "
                "are supported"
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
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=_optional_float(config.get("attn_logit_softcapping", 50.0)),
            final_logit_softcapping=_optional_float(config.get("final_logit_softcapping", 30.0)),
            sliding_window=int(window) if window is not None else None,
            layer_types=_layer_types(config, layers),
            rope=rope_parameters(config),
        )
