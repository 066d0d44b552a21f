"""GptOssConfig from config.json (transformers 4 and 5 schemas).

Both schemas write `layer_types` and `num_local_experts` for gpt-oss; transformers 4 (4.55+,
the released openai/gpt-oss configs) writes the yarn rope as top-level rope_theta/rope_scaling
and no swiglu_alpha (fixed 1.702), transformers 5 writes rope_parameters. Without layer_types,
layers alternate sliding / full, sliding first (transformers' default)."""

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
                f"gpt_oss: layer_types names {len(kinds)} layers, num_hidden_layers is {layers}"
            )
        other = sorted(set(kinds) - set(LAYER_TYPES))
        if other:
            raise UnsupportedModelError(
                f"gpt_oss: layer_types names {', '.join(other)}; supported: {', '.join(LAYER_TYPES)}"
            )
        return kinds
    return tuple(LAYER_TYPES[0] if (i + 1) % 2 else LAYER_TYPES[1] for i in range(layers))


def _check_quantization(config: Mapping[str, Any]) -> None:
    """Checkpoints ship their experts in MXFP4 (quant_method "mxfp4"); MLX-layout quantization
    entries (no quant_method) are read from the tensors. Other methods are refused by name."""
    spec = config.get("quantization_config")
    if isinstance(spec, Mapping):
        method = cast(Mapping[str, Any], spec).get("quant_method")
        if method is not None and method != "mxfp4":
            raise UnsupportedModelError(
                f"gpt_oss: quantization_config quant_method {method!r} is not supported (the "
                "MXFP4 experts openai ships are; or load the bf16 checkpoint)"
            )


@dataclass(frozen=True)
class GptOssConfig:
    hidden_size: int
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    swiglu_alpha: float
    swiglu_limit: float
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GptOssConfig:
        _check_quantization(config)
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        experts = config.get("num_local_experts", config.get("num_experts"))
        if experts is None:
            raise UnsupportedModelError("gpt_oss: config.json names no num_local_experts")
        top_k = config.get("num_experts_per_tok", config.get("experts_per_token", 4))
        window = config.get("sliding_window", 128)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_local_experts=int(experts),
            num_experts_per_tok=int(top_k),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", True)),
            sliding_window=int(window) if window is not None else None,
            layer_types=_layer_types(config, layers),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            rope=rope_parameters(config),
        )
