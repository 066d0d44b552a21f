"""Qwen3NextConfig from config.json (transformers 5 `layer_types`, `rope_parameters` with
partial_rotary_factor; transformers 4 and the hub's: `full_attention_interval`, top-level
rope_theta and partial_rotary_factor)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_KINDS = ("linear_attention", "full_attention")
DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' default for Qwen3-Next


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"qwen3_next: {what}")


def _int_list(value: Any) -> tuple[int, ...]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(int(v) for v in cast(Sequence[Any], value))
    return ()


def layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types`, or every full_attention_interval-th layer (default 4) full attention and
    the others linear (gated DeltaNet), as transformers derives them."""
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
class Qwen3NextConfig:
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
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
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen3NextConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or 256)
        rope = rope_parameters(config)
        partial = float(rope.get("partial_rotary_factor",
                                 config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
        key_heads = int(config.get("linear_num_key_heads", 16))
        value_heads = int(config.get("linear_num_value_heads", 32))
        if value_heads % key_heads:
            raise _refuse(f"linear_num_value_heads {value_heads} is not a multiple of "
                          f"linear_num_key_heads {key_heads}")
        experts = config.get("num_experts", config.get("num_local_experts"))
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size", 512)),
            num_experts=int(experts) if experts is not None else 0,
            num_experts_per_tok=int(config.get("num_experts_per_tok", 10)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
            mlp_only_layers=_int_list(config.get("mlp_only_layers")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dims=int(head_dim * partial),
            linear_conv_kernel_dim=int(config.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(config.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(config.get("linear_value_head_dim", 128)),
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            layer_types=layer_types(config, layers),
            rope=rope,
        )

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the experts MLP, as transformers decides."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )
