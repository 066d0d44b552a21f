"""How qwen3_moe checkpoints become a Qwen3MoeForCausalLM: config and tensor names.

Expert weights are stacked at load by core.experts.stack_experts (layouts listed there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.models.qwen3_moe.config import Qwen3MoeConfig
from mlx_omnia.engine.models.qwen3_moe.model import Qwen3MoeForCausalLM


class Qwen3MoeCheckpoint:
    model_types = ("qwen3_moe",)

    def build(self, config: Mapping[str, Any]) -> Qwen3MoeForCausalLM:
        return Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Qwen3MoeConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Stack the experts' tensors (see the module docstring); drop tensors that are derived,
        not learned (rotary inv_freq) and, when tied, a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return stack_experts(kept)


CHECKPOINT = Qwen3MoeCheckpoint()
