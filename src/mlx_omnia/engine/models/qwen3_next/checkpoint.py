"""How qwen3_next checkpoints become a Qwen3NextForCausalLM: config and tensor names.

Routed experts are stacked at load by core.experts.stack_experts (per-expert tensors as the
hub's checkpoints hold them, transformers 5's fused ones, mlx-community's switch_mlp). The
multi-token-prediction head (`mtp.*`, for speculative decoding) is not part of this network:
its tensors are dropped.

mlx-lm's layout (what `mlx_lm.convert` and mlx-community publish, float or quantized) differs in
two more ways, both undone here: the DeltaNet's conv1d weight is channels-last [C, K, 1] (the
hub's is [C, 1, K]), and the (1 + weight) norms hold 1 + weight. mlx-lm's sanitize makes both
changes in one step, so the convolution's shape tells the layouts apart (for K > 1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.core.mlx_layout import torch_convs, zero_centred
from mlx_omnia.engine.models.qwen3_next.config import Qwen3NextConfig
from mlx_omnia.engine.models.qwen3_next.model import Qwen3NextForCausalLM

# The OffsetRmsNorm weights: every layer's two norms, attention's q/k norms, the final norm (not
# the DeltaNet's gated `norm`, which scales by its weight in both layouts).
OFFSET_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight",
    ".self_attn.q_norm.weight", ".self_attn.k_norm.weight",
)
FINAL_NORM = "model.norm.weight"


def is_conv(name: str) -> bool:
    return name.endswith(".linear_attn.conv1d.weight")


def is_offset_norm(name: str) -> bool:
    return name == FINAL_NORM or name.endswith(OFFSET_NORMS)


class Qwen3NextCheckpoint:
    model_types = ("qwen3_next",)

    def build(self, config: Mapping[str, Any]) -> Qwen3NextForCausalLM:
        return Qwen3NextForCausalLM(Qwen3NextConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Qwen3NextConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        cfg = Qwen3NextConfig.from_dict(config)
        kept = {
            k: v for k, v in weights.items()
            if not k.endswith("rotary_emb.inv_freq") and not k.startswith("mtp.")
        }
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        kept, mlx_lm = torch_convs(kept, is_conv, cfg.linear_conv_kernel_dim)
        if mlx_lm:
            kept = {k: zero_centred(v) if is_offset_norm(k) else v for k, v in kept.items()}
        return stack_experts(kept)


CHECKPOINT = Qwen3NextCheckpoint()
