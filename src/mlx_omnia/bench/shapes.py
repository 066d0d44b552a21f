"""Named real model shapes, and random-weight checkpoints of them built on the spot.

The shapes are the public config.json values of the released checkpoints; only the weights are
random, which is all a speed measurement needs (every arm computes the same arithmetic). A
shape can be cut to its first layers (`cut`), so that a model too large for one process next to
the other arm still runs its real layer dimensions."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

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

_QWEN3_MOE_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "rope_scaling": None,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# Granite 4.0-H's 40 layers: Mamba-2, with attention at layers 5, 15, 25 and 35.
_GRANITE_4_H_LAYERS = (
    ["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9
    + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4
)

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
    # Qwen/Qwen3-30B-A3B: every layer sparse (intermediate_size is unused, but the config has it)
    "qwen3-30b-a3b": {
        **_QWEN3_MOE_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    # allenai/OLMoE-1B-7B-0924: q_norm/k_norm over the whole projections, no qkv clipping
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_act": "silu",
        "attention_bias": False,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "clip_qkv": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct: three gated-DeltaNet layers to one of gated attention
    # (full_attention_interval), every layer 512 experts (top 10) and a gated shared expert.
    # The hub's config.json but its token ids; its multi-token-prediction head (mtp.*, ~1.6B)
    # is not drawn: neither engine loads it.
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # ibm-granite/granite-4.0-h-tiny: 36 Mamba-2 layers and 4 of attention without positions,
    # each followed by 64 experts (top 6) beside a shared MLP; tied head. The hub's config.json
    # but its token ids.
    "granite-4.0-h-tiny": {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_multiplier": 0.0078125,
        "embedding_multiplier": 12,
        "hidden_act": "silu",
        "hidden_size": 1536,
        "init_method": "mup",
        "initializer_range": 0.1,
        "intermediate_size": 512,
        "layer_types": _GRANITE_4_H_LAYERS,
        "logits_scaling": 6,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 48,
        "mamba_proj_bias": False,
        "max_position_embeddings": 131072,
        "normalization_function": "rmsnorm",
        "num_attention_heads": 12,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 40,
        "num_key_value_heads": 4,
        "num_local_experts": 64,
        "output_router_logits": False,
        "position_embedding_type": "nope",
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000,
        "router_aux_loss_coef": 0.0,
        "shared_intermediate_size": 1024,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 100352,
    },
    # nvidia/Nemotron-H-8B-Base-8K: 24 Mamba-2 blocks, 24 relu² MLP blocks and 4 of attention
    # without positions (hybrid_override_pattern). The hub's config.json (transformers
    # 4.48-era field names: conv_kernel, n_groups, use_conv_bias...) but its token ids and its
    # auto_map; it names no time_step_limit (no clamp) and attention_head_dim, not head_dim.
    "nemotron-h-8b": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_head_dim": 128,
        "chunk_size": 128,
        "conv_kernel": 4,
        "expand": 2,
        "hidden_dropout": 0.0,
        "hidden_size": 4096,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "initializer_range": 0.02,
        "intermediate_size": 21504,
        "layer_norm_epsilon": 1e-5,
        "mamba_head_dim": 64,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": 128,
        "mamba_proj_bias": False,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "n_groups": 8,
        "num_attention_heads": 32,
        "num_hidden_layers": 52,
        "num_key_value_heads": 8,
        "num_logits_to_keep": 1,
        "rescale_prenorm_residual": True,
        "residual_in_fp32": False,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "ssm_state_size": 128,
        "tie_word_embeddings": False,
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mamba_kernels": True,
        "vocab_size": 131072,
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
    # For tests: a qwen3_moe of 4 experts, top 2 (multiples of 64 as `tiny`, router included).
    "tiny-moe": {
        **_QWEN3_MOE_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}


def shrunk(shape: str, **dims: Any) -> dict[str, Any]:
    """The named shape with some of its dimensions replaced by smaller ones and every other
    field as it is (layer pattern, gates, shared experts, Granite's scalars), so a test runs
    its structure on a CPU in seconds."""
    base = SHAPES[shape]
    unknown = sorted(set(dims) - set(base))
    if unknown:
        raise ValueError(f"{shape} has no {', '.join(unknown)} to shrink")
    return base | dims


# For tests: the hybrids at multiples of 64 (4-bit g64 reaches every matrix), a few heads and
# experts each. Cut with `layers` to the first whole pattern: 4, 6 and 8 layers.
SHAPES.update({
    "tiny-qwen3-next": shrunk(
        "qwen3-next-80b-a3b", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        vocab_size=512, max_position_embeddings=4096,
    ),
    "tiny-granite-4.0-h": shrunk(
        "granite-4.0-h-tiny", hidden_size=64, intermediate_size=64, shared_intermediate_size=64,
        num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        vocab_size=512, max_position_embeddings=4096,
    ),
    "tiny-nemotron-h": shrunk(
        "nemotron-h-8b", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, attention_head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, vocab_size=512, max_position_embeddings=4096,
    ),
})

DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}


def cut(config: dict[str, Any], layers: int | None) -> dict[str, Any]:
    """The config of the model's first `layers` layers (all of them for None): the layer count,
    and each layer list or pattern it holds cut to match (layer_types, layers_block_type,
    hybrid_override_pattern, mlp_only_layers); an interval (full_attention_interval,
    decoder_sparse_step) keeps its meaning as it is."""
    total = int(config["num_hidden_layers"])
    if layers is None:
        return dict(config)
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers {layers}: this shape has {total} layers; give 1 to {total}")
    out: dict[str, Any] = {**config, "num_hidden_layers": layers}
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
        if out.get(key) is not None:
            out[key] = out[key][:layers]
    if out.get("mlp_only_layers"):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    return out


def shape_config(shape: str, layers: int | None = None) -> dict[str, Any]:
    """The named shape's config, cut to its first `layers` layers."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)} (or pass a path)")
    return cut(SHAPES[shape], layers)


# The recurrent layers' time steps at a zero input, softplus(dt_bias), spread evenly in log
# over the heads: inside both engines' clamps (Nemotron-H's time_step_min 0.001, mlx-lm's
# Granite default (0.001, 100)) with room for the random projections' spread.
DT_STEPS = (0.01, 0.1)


@dataclass(frozen=True)
class Draw:
    """One random tensor drawn at once: `name` itself, or with `experts` > 0 the stack
    [experts, *dims] of the per-expert tensors `name.format(e)` (name holds `experts.{}.`).
    `fill`: "normal" (0.02), "ones", "zeros", "a_log" (log 1..n: decays of 1 to n a step),
    "dt_bias" (time steps DT_STEPS); None: normal for matrices, ones for vectors (norms)."""

    name: str
    dims: tuple[int, ...]
    experts: int = 0
    fill: str | None = None

    def names(self) -> list[str]:
        return [self.name.format(e) for e in range(self.experts)] if self.experts else [self.name]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.experts, *self.dims) if self.experts else self.dims


def _sparse(config: dict[str, Any], layer: int) -> bool:
    """Whether `layer` has the sparse MLP (qwen3_moe's and qwen3_next's decoder_sparse_step and
    mlp_only_layers; every olmoe layer)."""
    if config["model_type"] == "olmoe":
        return True
    experts = int(config.get("num_experts") or 0)
    if config["model_type"] not in ("qwen3_moe", "qwen3_next") or not experts:
        return False
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def _gated_mlp(p: str, hidden: int, inner: int) -> list[Draw]:
    return [
        Draw(f"{p}.gate_proj.weight", (inner, hidden)),
        Draw(f"{p}.up_proj.weight", (inner, hidden)),
        Draw(f"{p}.down_proj.weight", (hidden, inner)),
    ]


def _experts(p: str, hidden: int, inner: int, experts: int) -> list[Draw]:
    """Per-expert gated MLPs `<p>.experts.<e>.{gate,up,down}_proj.weight`, one stack each."""
    return [
        Draw(p + ".experts.{}.gate_proj.weight", (inner, hidden), experts),
        Draw(p + ".experts.{}.up_proj.weight", (inner, hidden), experts),
        Draw(p + ".experts.{}.down_proj.weight", (hidden, inner), experts),
    ]


def _decoder(config: dict[str, Any]) -> list[Draw]:
    """llama, qwen3, qwen3_moe and olmoe: attention and an MLP (or experts) per layer."""
    kind = config["model_type"]
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or 0)
    kv = kv or heads
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    out = [Draw("model.embed_tokens.weight", (vocab, hidden)), Draw("model.norm.weight", (hidden,))]
    if not config.get("tie_word_embeddings", False):
        out.append(Draw("lm_head.weight", (vocab, hidden)))
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        out += [
            Draw(f"{p}.input_layernorm.weight", (hidden,)),
            Draw(f"{p}.post_attention_layernorm.weight", (hidden,)),
            Draw(f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            Draw(f"{p}.self_attn.k_proj.weight", (kv * head_dim, hidden)),
            Draw(f"{p}.self_attn.v_proj.weight", (kv * head_dim, hidden)),
            Draw(f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
        ]
        if _sparse(config, i):
            experts = int(config["num_experts"])
            moe = int(config.get("moe_intermediate_size") or inter)
            out.append(Draw(f"{p}.mlp.gate.weight", (experts, hidden)))
            out += _experts(f"{p}.mlp", hidden, moe, experts)
        else:
            out += _gated_mlp(f"{p}.mlp", hidden, inter)
        if kind in ("qwen3", "qwen3_moe"):
            out.append(Draw(f"{p}.self_attn.q_norm.weight", (head_dim,)))
            out.append(Draw(f"{p}.self_attn.k_norm.weight", (head_dim,)))
        elif kind == "olmoe":  # over the whole projections
            out.append(Draw(f"{p}.self_attn.q_norm.weight", (heads * head_dim,)))
            out.append(Draw(f"{p}.self_attn.k_norm.weight", (kv * head_dim,)))
    return out


def _qwen3_next_linear(config: dict[str, Any], layer: int) -> bool:
    """Whether `layer` is a gated DeltaNet: as `layer_types` says, else all but every
    full_attention_interval-th layer (how transformers and mlx-lm read the hub's config)."""
    kinds = config.get("layer_types")
    if kinds is not None:
        return kinds[layer] == "linear_attention"
    return (layer + 1) % int(config.get("full_attention_interval") or 4) != 0


def _qwen3_next(config: dict[str, Any]) -> list[Draw]:
    """qwen3_next: gated DeltaNet or gated attention, then experts with a gated shared expert.
    Its (1 + weight) norms are drawn as the hub stores a fresh model's: zeros (a scale of 1)."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    keys = key_heads * int(config["linear_key_head_dim"])
    value_dim = int(config["linear_value_head_dim"])
    values = value_heads * value_dim
    kernel = int(config["linear_conv_kernel_dim"])
    out = [Draw("model.embed_tokens.weight", (vocab, hidden)),
           Draw("model.norm.weight", (hidden,), fill="zeros")]
    if not config.get("tie_word_embeddings", False):
        out.append(Draw("lm_head.weight", (vocab, hidden)))
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        out += [Draw(f"{p}.input_layernorm.weight", (hidden,), fill="zeros"),
                Draw(f"{p}.post_attention_layernorm.weight", (hidden,), fill="zeros")]
        if _qwen3_next_linear(config, i):
            a = f"{p}.linear_attn"
            out += [
                Draw(f"{a}.in_proj_qkvz.weight", (2 * keys + 2 * values, hidden)),
                Draw(f"{a}.in_proj_ba.weight", (2 * value_heads, hidden)),
                Draw(f"{a}.conv1d.weight", (2 * keys + values, 1, kernel)),
                Draw(f"{a}.A_log", (value_heads,), fill="a_log"),
                Draw(f"{a}.dt_bias", (value_heads,), fill="dt_bias"),
                Draw(f"{a}.norm.weight", (value_dim,)),
                Draw(f"{a}.out_proj.weight", (hidden, values)),
            ]
        else:
            a = f"{p}.self_attn"
            out += [  # q_proj gives each head its query and its output gate
                Draw(f"{a}.q_proj.weight", (2 * heads * head_dim, hidden)),
                Draw(f"{a}.k_proj.weight", (kv * head_dim, hidden)),
                Draw(f"{a}.v_proj.weight", (kv * head_dim, hidden)),
                Draw(f"{a}.o_proj.weight", (hidden, heads * head_dim)),
                Draw(f"{a}.q_norm.weight", (head_dim,), fill="zeros"),
                Draw(f"{a}.k_norm.weight", (head_dim,), fill="zeros"),
            ]
        if _sparse(config, i):
            experts = int(config["num_experts"])
            out.append(Draw(f"{p}.mlp.gate.weight", (experts, hidden)))
            out += _experts(f"{p}.mlp", hidden, int(config["moe_intermediate_size"]), experts)
            out += _gated_mlp(f"{p}.mlp.shared_expert", hidden,
                              int(config["shared_expert_intermediate_size"]))
            out.append(Draw(f"{p}.mlp.shared_expert_gate.weight", (1, hidden)))
        else:
            out += _gated_mlp(f"{p}.mlp", hidden, int(config["intermediate_size"]))
    return out


def _mamba2(p: str, hidden: int, *, heads: int, head_dim: int, groups: int, state: int,
            kernel: int, conv_bias: bool, proj_bias: bool) -> list[Draw]:
    """A Mamba-2 mixer as Granite 4.0-H and Nemotron-H name it: in_proj [z | xBC | dt], the
    depthwise conv1d over xBC (torch's [C, 1, K]), A_log, D, dt_bias, the gated norm, out_proj."""
    inner = heads * head_dim
    conv = inner + 2 * groups * state
    out = [
        Draw(f"{p}.in_proj.weight", (inner + conv + heads, hidden)),
        Draw(f"{p}.conv1d.weight", (conv, 1, kernel)),
        Draw(f"{p}.A_log", (heads,), fill="a_log"),
        Draw(f"{p}.D", (heads,)),
        Draw(f"{p}.dt_bias", (heads,), fill="dt_bias"),
        Draw(f"{p}.norm.weight", (inner,)),
        Draw(f"{p}.out_proj.weight", (hidden, inner)),
    ]
    if conv_bias:
        out.append(Draw(f"{p}.conv1d.bias", (conv,), fill="zeros"))
    if proj_bias:
        out += [Draw(f"{p}.in_proj.bias", (inner + conv + heads,), fill="zeros"),
                Draw(f"{p}.out_proj.bias", (hidden,), fill="zeros")]
    return out


def _attention(p: str, hidden: int, heads: int, kv: int, head_dim: int, bias: bool) -> list[Draw]:
    """Grouped-query attention's q/k/v/o projections (and their biases, zeros, where it has them)."""
    out: list[Draw] = []
    for proj, dims in (("q", (heads * head_dim, hidden)), ("k", (kv * head_dim, hidden)),
                       ("v", (kv * head_dim, hidden)), ("o", (hidden, heads * head_dim))):
        out.append(Draw(f"{p}.{proj}_proj.weight", dims))
        if bias:
            out.append(Draw(f"{p}.{proj}_proj.bias", (dims[0],), fill="zeros"))
    return out


def _granite_hybrid(config: dict[str, Any]) -> list[Draw]:
    """granitemoehybrid: a Mamba-2 or attention mixer, then the shared MLP ([gate; up] in one
    input_linear) and, where the model has them, the experts stacked as the hub stores them."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    mamba_heads = int(config["mamba_n_heads"])
    d_head = config.get("mamba_d_head", "auto")
    d_head = int(config.get("mamba_expand", 2)) * hidden // mamba_heads if d_head == "auto" else int(d_head)
    experts, inter = int(config.get("num_local_experts") or 0), int(config["intermediate_size"])
    shared = int(config["shared_intermediate_size"])
    kinds = config.get("layer_types") or ["mamba"] * int(config["num_hidden_layers"])
    out = [Draw("model.embed_tokens.weight", (vocab, hidden)), Draw("model.norm.weight", (hidden,))]
    if not config.get("tie_word_embeddings", False):
        out.append(Draw("lm_head.weight", (vocab, hidden)))
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}"
        out += [Draw(f"{p}.input_layernorm.weight", (hidden,)),
                Draw(f"{p}.post_attention_layernorm.weight", (hidden,))]
        if kind in ("mamba", "linear_attention"):
            out += _mamba2(f"{p}.mamba", hidden, heads=mamba_heads, head_dim=d_head,
                           groups=int(config["mamba_n_groups"]), state=int(config["mamba_d_state"]),
                           kernel=int(config["mamba_d_conv"]),
                           conv_bias=bool(config.get("mamba_conv_bias", True)),
                           proj_bias=bool(config.get("mamba_proj_bias", False)))
        else:
            out += _attention(f"{p}.self_attn", hidden, heads, kv, head_dim,
                              bool(config.get("attention_bias", False)))
        if experts:
            m = f"{p}.block_sparse_moe"
            out += [Draw(f"{m}.router.layer.weight", (experts, hidden)),
                    Draw(f"{m}.input_linear.weight", (experts, 2 * inter, hidden)),
                    Draw(f"{m}.output_linear.weight", (experts, hidden, inter))]
        out += [Draw(f"{p}.shared_mlp.input_linear.weight", (2 * shared, hidden)),
                Draw(f"{p}.shared_mlp.output_linear.weight", (hidden, shared))]
    return out


# Nemotron-H's block kinds: hybrid_override_pattern's letters, and the names of
# layers_block_type (transformers 4 and 5)
_NEMOTRON_LETTERS = {"mamba": "M", "linear_attention": "M", "attention": "*",
                     "full_attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_h(config: dict[str, Any]) -> list[Draw]:
    """nemotron_h (`backbone.*`): each block a norm and one mixer, Mamba-2 (M), attention (*)
    or a relu² MLP (-). Its expert blocks (E) are not drawn: no shape here has them."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config.get("attention_head_dim") or hidden // heads)
    given = config.get("layers_block_type", config.get("layer_types"))
    pattern = ("".join(_NEMOTRON_LETTERS[k] for k in given) if given is not None
               else str(config["hybrid_override_pattern"]))
    if "E" in pattern:
        raise SystemExit("nemotron_h expert blocks (E) are not drawn: bench/shapes.py draws "
                         "Mamba-2, attention and MLP blocks")
    out = [Draw("backbone.embeddings.weight", (vocab, hidden)),
           Draw("backbone.norm_f.weight", (hidden,)),
           Draw("lm_head.weight", (vocab, hidden))]  # its own matrix even where tied
    inter = int(config["intermediate_size"])
    for i, letter in enumerate(pattern):
        p = f"backbone.layers.{i}"
        out.append(Draw(f"{p}.norm.weight", (hidden,)))
        if letter == "M":
            out += _mamba2(f"{p}.mixer", hidden, heads=int(config["mamba_num_heads"]),
                           head_dim=int(config["mamba_head_dim"]), groups=int(config["n_groups"]),
                           state=int(config["ssm_state_size"]), kernel=int(config["conv_kernel"]),
                           conv_bias=bool(config.get("use_conv_bias", True)),
                           proj_bias=bool(config.get("mamba_proj_bias", False)))
        elif letter == "*":
            out += _attention(f"{p}.mixer", hidden, heads, kv, head_dim,
                              bool(config.get("attention_bias", False)))
        else:
            out += [Draw(f"{p}.mixer.up_proj.weight", (inter, hidden)),
                    Draw(f"{p}.mixer.down_proj.weight", (hidden, inter))]
            if config.get("mlp_bias", False):
                out += [Draw(f"{p}.mixer.up_proj.bias", (inter,), fill="zeros"),
                        Draw(f"{p}.mixer.down_proj.bias", (hidden,), fill="zeros")]
    return out


FAMILIES: dict[str, Callable[[dict[str, Any]], list[Draw]]] = {
    "llama": _decoder, "qwen3": _decoder, "qwen3_moe": _decoder, "olmoe": _decoder,
    "qwen3_next": _qwen3_next, "granitemoehybrid": _granite_hybrid, "nemotron_h": _nemotron_h,
}


def draws(config: dict[str, Any]) -> list[Draw]:
    """The tensors of a checkpoint of this config as the hub names and shapes them, in drawing
    order (a family of FAMILIES); routed experts per expert where the hub stores them so
    (mlp.experts.<e>.{gate,up,down}_proj.weight), stacked where it does (Granite's
    block_sparse_moe.input_linear)."""
    kind = config["model_type"]
    if kind not in FAMILIES:
        raise SystemExit(f"bench/shapes.py draws no {kind} checkpoint ({', '.join(FAMILIES)})")
    return FAMILIES[kind](config)


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of this config, by its hub name."""
    return {name: d.dims for d in draws(config) for name in d.names()}


@dataclass(frozen=True)
class Part:
    """One tensor of mlx-lm's layout (what mlx_lm.convert writes) made from a drawn one: its
    name and shape, and how it comes from the drawn array."""

    name: str
    shape: tuple[int, ...]
    take: Callable[[mx.array], mx.array]


def _same(w: mx.array) -> mx.array:
    return w


# qwen3_next's (1 + weight) norms, which mlx-lm stores as 1 + weight
_QWEN3_NEXT_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                            ".q_norm.weight", ".k_norm.weight")


def mlx_parts(d: Draw, config: dict[str, Any]) -> list[Part]:
    """The tensors mlx-lm's layout holds for a drawn one: experts stacked as
    `switch_mlp.<proj>` (Granite's [gate; up] split in two), depthwise convolutions
    channels-last ([C, K, 1]), qwen3_next's (1 + weight) norms as 1 + weight, a Granite
    without experts' shared MLP as `mlp.{gate,up,down}_proj`."""
    kind, name = config["model_type"], d.name
    if d.experts:
        return [Part(name.replace(".experts.{}.", ".switch_mlp."), d.shape, _same)]
    if name.endswith(".conv1d.weight"):
        channels, one, kernel = d.dims
        return [Part(name, (channels, kernel, one), lambda w: w.swapaxes(1, 2))]
    if kind == "qwen3_next" and (name == "model.norm.weight" or name.endswith(_QWEN3_NEXT_OFFSET_NORMS)):
        return [Part(name, d.shape, lambda w: w + 1)]
    if kind == "granitemoehybrid":
        stacked = name.endswith(".block_sparse_moe.input_linear.weight")
        dense = not config.get("num_local_experts") and ".shared_mlp." in name
        if stacked or (dense and name.endswith(".input_linear.weight")):
            at = name.removesuffix("input_linear.weight")
            at = at.replace(".block_sparse_moe.", ".block_sparse_moe.switch_mlp.").replace(
                ".shared_mlp.", ".mlp.")
            *lead, rows, cols = d.shape
            half = (*lead, rows // 2, cols)
            return [Part(f"{at}gate_proj.weight", half, lambda w: w[..., : rows // 2, :]),
                    Part(f"{at}up_proj.weight", half, lambda w: w[..., rows // 2 :, :])]
        if name.endswith(".block_sparse_moe.output_linear.weight"):
            at = name.removesuffix("output_linear.weight")
            return [Part(f"{at}switch_mlp.down_proj.weight", d.shape, _same)]
        if dense and name.endswith(".output_linear.weight"):
            return [Part(name.replace(".shared_mlp.output_linear.", ".mlp.down_proj."), d.shape,
                         _same)]
    return [Part(name, d.shape, _same)]


def _quantizable(shape: tuple[int, ...], group_size: int) -> bool:
    """What both arms quantize: every matrix (Linear, Embedding, expert stack) whose input
    dimension is a multiple of the group size; norms, convolutions and vectors stay as they are."""
    return len(shape) >= 2 and shape[-1] % group_size == 0


def checkpoint_bytes(
    shape: str, *, dtype: str, quantize: tuple[int, int] | None = None, layers: int | None = None
) -> int:
    """The bytes of weights build_checkpoint writes for the named shape (on disk, ~exactly:
    safetensors headers aside)."""
    config = shape_config(shape, layers)
    item = DTYPES[dtype].size
    total = 0
    for d in draws(config):
        if quantize is None:
            total += math.prod(d.shape) * item
            continue
        bits, group_size = quantize
        for part in mlx_parts(d, config):
            count = math.prod(part.shape)
            if _quantizable(part.shape, group_size):
                total += count * bits // 8 + 2 * (count // group_size) * item
            else:
                total += count * item
    return total


def _fill(d: Draw, dtype: mx.Dtype, key: mx.array) -> mx.array:
    fill = d.fill or ("ones" if len(d.dims) == 1 else "normal")
    if fill == "normal":
        return mx.random.normal(d.shape, dtype=dtype, scale=0.02, key=key)
    if fill == "ones":
        return mx.ones(d.shape, dtype=dtype)
    if fill == "zeros":
        return mx.zeros(d.shape, dtype=dtype)
    (n,) = d.shape
    if fill == "a_log":
        return mx.log(mx.arange(1, n + 1, dtype=mx.float32)).astype(dtype)
    if fill == "dt_bias":  # softplus(dt_bias) = the steps: dt_bias = log(e^step - 1)
        low, high = (math.log(s) for s in DT_STEPS)
        steps = mx.exp(mx.linspace(low, high, n, dtype=mx.float32))
        return mx.log(mx.expm1(steps)).astype(dtype)
    raise ValueError(f"{d.name}: unknown fill {fill!r}")


class _ShardWriter:
    """Writes tensors into safetensors shards of about `shard_bytes` each; one shard is
    model.safetensors, more are model-0000k-of-0000n.safetensors with an index (the hub's
    names, which this engine and mlx-lm both read)."""

    def __init__(self, path: Path, shard_bytes: int) -> None:
        self.path, self.shard_bytes = path, shard_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}  # name -> shard number
        self.total = 0

    def add(self, name: str, tensor: mx.array) -> None:
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        self.weight_map[name] = len(self.files)
        self.total += tensor.nbytes

    def flush(self, *, force: bool = False) -> None:
        if not self.pending or (self.pending_bytes < self.shard_bytes and not force):
            return
        file = self.path / f"shard-{len(self.files):05d}.safetensors"
        mx.save_safetensors(  # pyright: ignore[reportUnknownMemberType]  # stub: return untyped
            str(file), self.pending, metadata={"format": "mlx"}
        )
        self.files.append(file)
        self.pending, self.pending_bytes = {}, 0
        mx.clear_cache()

    def close(self) -> None:
        self.flush(force=True)
        n = len(self.files)
        if n == 1:
            self.files[0].rename(self.path / "model.safetensors")
            return
        names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for file, name in zip(self.files, names, strict=True):
            file.rename(self.path / name)
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())},
        }
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _written(d: Draw, w: mx.array, config: dict[str, Any],
             quantize: tuple[int, int] | None) -> dict[str, mx.array]:
    """The tensors a drawn array is written as: the hub's layout unquantized (experts per
    expert), mlx-lm's quantized (`mlx_parts`, each matrix as weight / scales / biases)."""
    if quantize is None:
        return {name: w[e] for e, name in enumerate(d.names())} if d.experts else {d.name: w}
    bits, group_size = quantize
    parts: dict[str, mx.array] = {}
    for part in mlx_parts(d, config):
        tensor = part.take(w)
        if _quantizable(part.shape, group_size):
            wq, scales, biases = mx.quantize(tensor, group_size=group_size, bits=bits)
            base = part.name.removesuffix(".weight")
            parts |= {f"{base}.weight": wq, f"{base}.scales": scales, f"{base}.biases": biases}
        else:
            parts[part.name] = tensor
    return parts


def build_checkpoint(
    shape: str,
    path: Path,
    *,
    dtype: str,
    seed: int = 0,
    quantize: tuple[int, int] | None = None,
    shard_bytes: int = 4 * 2**30,
    layers: int | None = None,
) -> Path:
    """Write a random-weight checkpoint of the named shape into `path` (config.json, the
    safetensors, tokenizer files), of its first `layers` layers when given (`cut`): weights ~
    normal(0, 0.02), norms 1 (qwen3_next's zero-centred ones 0), recurrent decays and time
    steps as `Draw.fill` says, drawn with mx.random on the default device (seconds even for
    billions of weights on a GPU), experts a whole stack per projection and layer at once.

    Unquantized, tensors are written as hub checkpoints hold them (experts per expert,
    mlp.experts.<e>.<proj>.weight; torch's convolution layout). With `quantize` (bits,
    group_size) the matrices are affine-quantized before writing, in mlx-lm's layout (`mlx_parts`:
    weight/scales/biases and config "quantization"; experts stacked as mlx-community's
    switch_mlp.<proj>), so a 30B MoE takes ~17 GB, not ~61 GB; both the engine and mlx-lm load
    that as it is."""
    config = shape_config(shape, layers) | {"torch_dtype": dtype}
    if quantize is not None:
        config["quantization"] = {"group_size": quantize[1], "bits": quantize[0]}
    want = DTYPES[dtype]
    path.mkdir(parents=True, exist_ok=True)
    need = checkpoint_bytes(shape, dtype=dtype, quantize=quantize, layers=layers)
    free = shutil.disk_usage(path).free
    if need > free:
        raise SystemExit(
            f"a random {shape} checkpoint at {dtype} takes {need / 1e9:,.1f} GB but {path} has "
            f"{free / 1e9:,.1f} GB free: pass --workdir on a larger disk, write it quantized "
            "(--quantize 4 --prequantize), or cut it (--layers N)"
        )
    plan = draws(config)
    keys = mx.random.split(mx.random.key(seed), len(plan))
    writer = _ShardWriter(path, shard_bytes)
    for i, d in enumerate(plan):
        w = _fill(d, want, keys[i])
        parts = _written(d, w, config, quantize)
        evaluate(list(parts.values()))
        for name, tensor in parts.items():
            writer.add(name, tensor)
        del w, parts
        writer.flush()
    writer.close()
    mx.clear_cache()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, int(config["vocab_size"]))
    return path


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's and SmolLM2-Instruct's templates write a plain conversation (no tools, no
# thinking), so `agent-replay` can send a Chat to the engine and messages to mlx_lm.server.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_symbols() -> list[str]:
    """The printable stand-in of each of the 256 bytes, as byte-level BPE vocabularies write
    them: printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def bpe_vocabulary(vocab_size: int, seed: int = 0) -> tuple[list[str], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of `vocab_size` ids, the last ones the special tokens: the
    256 bytes, then words (a space and a letter run) grown a letter at a time from random
    earlier words; no training needed. A word's merges are its prefixes' chain and no two
    letters merge alone, so a decoded word encodes back to the same token."""
    normal = vocab_size - len(SPECIAL_TOKENS)
    symbols = byte_symbols()
    if normal < len(symbols) + 26:
        raise ValueError(f"a byte-level vocabulary needs at least {len(symbols) + 29} ids")
    letters = [symbols[b] for b in b"etaoinshrdlucmfwypvbgkqjxz"]
    space = symbols[ord(" ")]
    rng = np.random.default_rng(seed)
    tokens, seen = list(symbols), set(symbols)
    merges: list[tuple[str, str]] = []
    words: list[str] = []
    for letter in letters:
        if len(tokens) < normal:
            merges.append((space, letter))
            tokens.append(space + letter)
            seen.add(space + letter)
            words.append(space + letter)
    while len(tokens) < normal:
        a = words[int(rng.integers(len(words)))]
        b = letters[int(rng.integers(len(letters)))]
        if a + b in seen:
            continue
        tokens.append(a + b)
        seen.add(a + b)
        words.append(a + b)
        merges.append((a, b))
    return tokens + list(SPECIAL_TOKENS), merges


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer covering every id of the model (no hub, no training), so a
    free generation from random weights detokenizes as a real model's would; ChatML as its
    chat template."""
    tokens, merges = bpe_vocabulary(vocab_size)
    first_special = len(tokens) - len(SPECIAL_TOKENS)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": first_special + i, "content": w, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i, w in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {w: i for i, w in enumerate(tokens)},
                  "merges": [[a, b] for a, b in merges]},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }))
