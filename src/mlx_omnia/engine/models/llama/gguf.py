"""GGUF files of llama architecture: metadata to config.json, llama.cpp names to ours.

llama.cpp's converter permutes q/k rows to interleaved rotary pairs; we undo it so the module
computes rope in the checkpoint's (rotate-half) layout like every HF llama."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.errors import UnsupportedModelError

NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)$")
PLAIN = re.compile(r"^(\w+)\.(weight|scales|biases|bias)$")


def _num(metadata: Mapping[str, Any], key: str, default: float | None = None) -> float | None:
    value = metadata.get(key)
    if value is None:
        return default
    return float(value.item() if hasattr(value, "item") else value)


def config_from_gguf(metadata: Mapping[str, Any], tensors: Mapping[str, mx.array]) -> dict[str, Any]:
    def need(key: str) -> int:
        value = _num(metadata, f"llama.{key}")
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks llama.{key}")
        return int(value)

    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError(
            "this GGUF carries llama3 rope_freqs factors, not supported yet from GGUF; load "
            "the HF checkpoint directory instead"
        )
    heads = need("attention.head_count")
    hidden = need("embedding_length")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = _num(metadata, "llama.vocab_size") or (len(tokens) if tokens is not None else 0)
    head_dim = _num(metadata, "llama.attention.key_length") or hidden // heads
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_num(metadata, "llama.attention.head_count_kv", heads) or heads),
        "head_dim": int(head_dim),
        "vocab_size": int(vocab),
        "rms_norm_eps": _num(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _num(metadata, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": int(_num(metadata, "llama.context_length", 2048) or 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row order: each head's rows are interleaved pairs [h, d/2, 2] in the
    file; HF's rotate-half layout wants [h, 2, d/2]. Also applies to packed weights, scales and
    biases, whose rows are the same output features."""
    rows = w.shape[0]
    rest = w.shape[1:]
    pairs = reshape(w, n_heads, rows // n_heads // 2, 2, *rest)
    return reshape(pairs.swapaxes(1, 2), *w.shape)


def weights_from_gguf(
    tensors: Mapping[str, mx.array], config: Mapping[str, Any]
) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name, tensor in tensors.items():
        if m := BLOCK.match(name):
            layer, part, kind = m.groups()
            if part not in NAMES:
                raise UnsupportedModelError(f"GGUF tensor {name} has no place in a llama model")
            if part == "attn_q":
                tensor = _unpermute(tensor, int(config["num_attention_heads"]))
            elif part == "attn_k":
                tensor = _unpermute(tensor, int(config["num_key_value_heads"]))
            out[f"model.layers.{layer}.{NAMES[part]}.{kind}"] = tensor
        elif (m := PLAIN.match(name)) and m.group(1) in TOP:
            out[f"{TOP[m.group(1)]}.{m.group(2)}"] = tensor
        else:
            raise UnsupportedModelError(f"GGUF tensor {name} has no place in a llama model")
    return out
