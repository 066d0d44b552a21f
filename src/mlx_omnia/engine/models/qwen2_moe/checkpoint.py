"""How qwen2_moe checkpoints become a Qwen2MoeForCausalLM: config and tensor names.

Expert weights are stacked at load by core.experts.stack_experts (layouts listed there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.models.qwen2_moe.config import Qwen2MoeConfig
from mlx_omnia.engine.models.qwen2_moe.model import Qwen2MoeForCausalLM


class Qwen2MoeCheckpoint:
    model_types = ("qwen2_moe",)

    def build(self, config: Mapping[str, Any]) -> Qwen2MoeForCausalLM:
        return Qwen2MoeForCausalLM(Qwen2MoeConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Qwen2MoeConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Stack the experts' tensors (see the module docstring); drop tensors that are derived,
        not learned (rotary inv_freq) and, when tied, a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return stack_experts(kept)


CHECKPOINT = Qwen2MoeCheckpoint()
