"""Gpt2Config from config.json (GPT-2's names: n_embd, n_layer, n_head, n_positions, n_inner;
the same in transformers 4 and 5, which have no rope here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.errors import UnsupportedModelError

# Both are GELU with the tanh approximation.
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Gpt2Config:
    n_embd: int
    n_inner: int
    n_layer: int
    n_head: int
    vocab_size: int
    n_positions: int
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    # Scores scaled by head_dim ** -0.5 (scale_attn_weights), and further by 1 / (layer + 1)
    # (scale_attn_by_inverse_layer_idx: Stanford CRFM's GPT-2s).
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def attention_scale(self, layer: int) -> float:
        scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        return scale

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Gpt2Config:
        act = config.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"gpt2: activation_function {act!r} is not supported (only {', '.join(ACTIVATIONS)})"
            )
        if config.get("add_cross_attention"):
            raise UnsupportedModelError(
                "gpt2: add_cross_attention is true (an encoder-decoder's decoder); only causal "
                "language models are supported"
            )
        embd = int(config.get("n_embd") or config["hidden_size"])
        heads = int(config.get("n_head") or config["num_attention_heads"])
        if embd % heads:
            raise UnsupportedModelError(f"gpt2: n_embd {embd} is not a multiple of n_head {heads}")
        inner = config.get("n_inner")
        return cls(
            n_embd=embd,
            n_inner=int(inner) if inner is not None else 4 * embd,
            n_layer=int(config.get("n_layer") or config["num_hidden_layers"]),
            n_head=heads,
            vocab_size=int(config["vocab_size"]),
            n_positions=int(config.get("n_positions") or config.get("max_position_embeddings") or 1024),
            layer_norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            scale_attn_weights=bool(config.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(config.get("scale_attn_by_inverse_layer_idx", False)),
        )
