"""Lfm2MoeConfig from config.json: transformers 5 (`layer_types`, `rope_parameters`) and the
hub's spellings (`full_attn_idxs`, top-level `rope_theta`, `tie_embedding`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_KINDS = ("conv", "full_attention")
DEFAULT_ROPE_THETA = 1_000_000.0  # transformers' Lfm2Config default


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"lfm2_moe: {what}")


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


@dataclass(frozen=True)
class Lfm2MoeConfig:
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_dense_layers: int
    num_experts: int
    num_experts_per_tok: int
    use_expert_bias: bool
    routed_scaling_factor: float
    norm_topk_prob: bool
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
    def from_dict(cls, config: Mapping[str, Any]) -> Lfm2MoeConfig:
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        rope = rope_parameters(config)
        if "rope_theta" not in config and not isinstance(config.get("rope_parameters"), Mapping):
            rope["rope_theta"] = DEFAULT_ROPE_THETA
        if rope["rope_type"] != "default":
            raise _refuse(f"rope_type {rope['rope_type']!r} is not supported (only default)")
        if config.get("use_pos_enc") is False:
            raise _refuse("use_pos_enc false is not supported (released checkpoints: true)")
        tied = config.get("tie_embedding", config.get("tie_word_embeddings", True))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size", 7168)),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 1792)),
            num_dense_layers=int(config.get("num_dense_layers", 2)),
            num_experts=int(config.get("num_experts", 32)),
            num_experts_per_tok=int(config.get("num_experts_per_tok", 4)),
            use_expert_bias=bool(config.get("use_expert_bias", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
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
