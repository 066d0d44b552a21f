"""Qwen3_5Config from config.json: the text model's config, top level (qwen3_5_text,
qwen3_5_moe_text) or as the image-text checkpoints nest it (qwen3_5, qwen3_5_moe: `text_config`,
beside a vision tower's config this family does not read); transformers 5 `layer_types` and
`rope_parameters`, or `full_attention_interval` and top-level rope_theta /
partial_rotary_factor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_KINDS = ("linear_attention", "full_attention")
DEFAULT_PARTIAL_ROTARY = 0.25
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"qwen3_5: {what}")


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's settings: `text_config` when nested (a top-level tie_word_embeddings
    applies to it), else the config itself."""
    nested = config.get("text_config")
    if not isinstance(nested, Mapping):
        return dict(config)
    text = dict(cast(Mapping[str, Any], nested))
    if "tie_word_embeddings" in config:
        text.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
    return text


def layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types`, or every full_attention_interval-th layer (default 4) full attention."""
    given = config.get("layer_types")
    if given is not None:
        kinds = tuple(str(k) for k in cast(Sequence[Any], given))
        if len(kinds) != layers:
            raise _refuse(f"layer_types names {len(kinds)} layers, num_hidden_layers is {layers}")
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown:
            raise _refuse(f"layer_types {', '.join(unknown)} not supported ({', '.join(LAYER_KINDS)})")
        return kinds
    interval = int(config.get("full_attention_interval") or 4)
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    )


@dataclass(frozen=True)
class Qwen3_5Config:
    moe: bool
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dims: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen3_5Config:
        moe = str(config.get("model_type")) in MOE_TYPES
        text = text_config(config)
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or 256)
        rope = rope_parameters(text)
        if rope["rope_type"] != "default":
            raise _refuse(f"rope_type {rope['rope_type']!r} is not supported (only default)")
        partial = float(rope.get("partial_rotary_factor",
                                 text.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
        key_heads = int(text.get("linear_num_key_heads", 16))
        value_heads = int(text.get("linear_num_value_heads", 32))
        if value_heads % key_heads:
            raise _refuse(f"linear_num_value_heads {value_heads} is not a multiple of "
                          f"linear_num_key_heads {key_heads}")
        return cls(
            moe=moe,
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size", 0)),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)),
            num_experts=int(text.get("num_experts", 0)) if moe else 0,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dims=int(head_dim * partial),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            vocab_size=int(text["vocab_size"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            layer_types=layer_types(text, layers),
            rope=rope,
        )
