"""Named real model shapes, and random-weight checkpoints of them built on the spot.

The shapes are the public config.json values of the released checkpoints; only the weights are
random, which is all a speed measurement needs (every arm computes the same arithmetic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_omnia.bench.measure import evaluate

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "rope_scaling": None,
}
_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-4B
    "qwen3-4b": {
        **_QWEN3_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": {
        **_LLAMA_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": {
        **_LLAMA_COMMON,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    # For tests: every dimension a multiple of 64, so 4-bit g64 quantizes every matrix; untied
    # so lm_head is its own matrix.
    "tiny": {
        **_QWEN3_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rope_theta": 1000000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "tiny-llama": {
        **_LLAMA_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}

DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a llama/qwen3 checkpoint of this config, by its HF name."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
        if config["model_type"] == "qwen3":
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
    return shapes


def write_tokenizer(path: Path) -> None:
    """A small word-level tokenizer (no hub, no training): the bench feeds token ids directly,
    so the tokenizer only has to exist and load; its vocab may be smaller than the model's."""
    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, w in enumerate(words[:4])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)},
                  "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
    }))


def build_checkpoint(shape: str, path: Path, *, dtype: str, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of the named shape into `path` (config.json,
    model.safetensors, tokenizer files): weights ~ normal(0, 0.02), norms 1, drawn with
    mx.random on the default device (seconds even for billions of weights on a GPU)."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)} (or pass a path)")
    config = dict(SHAPES[shape]) | {"torch_dtype": dtype}
    want = DTYPES[dtype]
    path.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    weights: dict[str, mx.array] = {}
    for i, (name, dims) in enumerate(shapes.items()):
        if len(dims) == 1:
            weights[name] = mx.ones(dims, dtype=want)
        else:
            weights[name] = mx.random.normal(dims, dtype=want, scale=0.02, key=keys[i])
        evaluate(weights[name])
    mx.save_safetensors(  # pyright: ignore[reportUnknownMemberType]  # stub: return untyped
        str(path / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    del weights
    mx.clear_cache()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return path
