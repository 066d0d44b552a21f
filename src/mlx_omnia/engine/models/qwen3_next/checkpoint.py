"""How qwen3_next checkpoints become a Qwen3NextForCausalLM: config and tensor names.

Routed experts are stacked at load by core.experts.stack_experts (per-expert tensors as the
hub's checkpoints hold them, transformers 5's fused ones, mlx-community's switch_mlp). The
multi-token-prediction head (`mtp.*`, for speculative decoding) is not part of this network:
its tensors are dropped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.models.qwen3_next.config import Qwen3NextConfig
from mlx_omnia.engine.models.qwen3_next.model import Qwen3NextForCausalLM


class Qwen3NextCheckpoint:
    model_types = ("qwen3_next",)

    def build(self, config: Mapping[str, Any]) -> Qwen3NextForCausalLM:
        return Qwen3NextForCausalLM(Qwen3NextConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Qwen3NextConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        kept = {
            k: v for k, v in weights.items()
            if not k.endswith("rotary_emb.inv_freq") and not k.startswith("mtp.")
        }
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return stack_experts(kept)


CHECKPOINT = Qwen3NextCheckpoint()
