"""Lfm2Config from config.json: transformers 5 (`layer_types`, `rope_parameters`) and the
transformers-4 / hub spellings (`full_attn_idxs`, top-level `rope_theta`, `block_ff_dim`,
`tie_embedding`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_KINDS = ("conv", "full_attention")
DEFAULT_ROPE_THETA = 1_000_000.0  # transformers' Lfm2Config default


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"lfm2: {what}")


def _layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's kind: `layer_types` when given, else attention at `full_attn_idxs` (every
    layer when neither is given, as transformers does) and convolution elsewhere."""
    given = config.get("layer_types")
    if given is not None:
        kinds = tuple(str(k) for k in cast(Sequence[Any], given))
        if len(kinds) != layers:
            raise _refuse(f"layer_types names {len(kinds)} layers, num_hidden_layers is {layers}")
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown:
            raise _refuse(f"layer_types {', '.join(unknown)} not supported ({', '.join(LAYER_KINDS)})")
        return kinds
    indices = config.get("full_attn_idxs")
    full = set(range(layers)) if indices is None else {int(i) for i in cast(Sequence[Any], indices)}
    return tuple("full_attention" if i in full else "conv" for i in range(layers))


def feed_forward_size(config: Mapping[str, Any]) -> int:
    """The MLP's inner size: intermediate_size (or block_ff_dim), taken to two thirds and rounded
    up to block_multiple_of when block_auto_adjust_ff_dim says so (transformers' rule)."""
    size = int(config.get("block_ff_dim", config.get("intermediate_size", 12288)))
    if not config.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return size
    size = int(float(multiplier) * size)
    multiple = int(config.get("block_multiple_of", 256))
    return multiple * ((size + multiple - 1) // multiple)


@dataclass(frozen=True)
class Lfm2Config:
    hidden_size: int
    feed_forward_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    conv_bias: bool
    conv_kernel: int
    layer_types: tuple[str, ...]
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Lfm2Config:
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        rope = rope_parameters(config)
        if "rope_theta" not in config and not isinstance(config.get("rope_parameters"), Mapping):
            rope["rope_theta"] = DEFAULT_ROPE_THETA
        if rope["rope_type"] != "default":
            raise _refuse(f"rope_type {rope['rope_type']!r} is not supported (only default)")
        if config.get("block_use_swiglu") is False:
            raise _refuse("block_use_swiglu false is not supported (released checkpoints: true)")
        if config.get("use_pos_enc") is False:
            raise _refuse("use_pos_enc false is not supported (released checkpoints: true)")
        tied = config.get("tie_embedding", config.get("tie_word_embeddings", True))
        return cls(
            hidden_size=hidden,
            feed_forward_size=feed_forward_size(config),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("norm_eps", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings", 128_000)),
            tie_word_embeddings=bool(tied),
            conv_bias=bool(config.get("conv_bias", False)),
            conv_kernel=int(config.get("conv_L_cache", 3)),
            layer_types=_layer_types(config, layers),
            rope=rope,
        )
