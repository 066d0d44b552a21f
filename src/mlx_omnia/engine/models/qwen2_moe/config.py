"""Qwen2MoeConfig from config.json (transformers 4 and 5 schemas: both name num_experts;
transformers 5 adds qkv_bias, transformers 4 always had q/k/v bias)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError


def _check_full_attention(config: Mapping[str, Any]) -> None:
    """Only full causal attention is implemented: refuse sliding-window layers by name
    (released Qwen-MoE checkpoints set use_sliding_window false; then sliding_window and
    max_window_layers are ignored, and transformers 5's layer_types are all full_attention)."""
    if config.get("use_sliding_window", False):
        raise UnsupportedModelError(
            "qwen2_moe: use_sliding_window is true in config.json; sliding-window attention is "
            "not supported yet (released Qwen-MoE checkpoints set it to false)"
        )
    layer_types = config.get("layer_types")
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
        other = sorted({str(t) for t in cast(Sequence[Any], layer_types)} - {"full_attention"})
        if other:
            raise UnsupportedModelError(
                f"qwen2_moe: layer_types names {', '.join(other)}; only full_attention layers "
                "are supported"
            )


def _int_list(value: Any) -> tuple[int, ...]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(int(v) for v in cast(Sequence[Any], value))
    return ()


@dataclass(frozen=True)
class Qwen2MoeConfig:
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
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen2MoeConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"qwen2_moe: hidden_act {act!r} is not supported (only silu)")
        _check_full_attention(config)
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        experts = config.get("num_experts", config.get("num_local_experts"))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(config["shared_expert_intermediate_size"]),
            num_experts=int(experts) if experts is not None else 0,
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
            mlp_only_layers=_int_list(config.get("mlp_only_layers")),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("qkv_bias", True)),
            rope=rope_parameters(config),
        )

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the sparse (experts) MLP, as transformers decides."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )
