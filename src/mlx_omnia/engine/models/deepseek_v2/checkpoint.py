"""How deepseek_v2 checkpoints become a DeepseekV2ForCausalLM: config and tensor names.

Routed experts (mlp.experts.<e>.{gate,up,down}_proj) are stacked at load by
core.experts.stack_experts (layouts listed there); the shared experts (mlp.shared_experts.*) and
the attention's tensors load as named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.models.deepseek_v2.config import DeepseekV2Config
from mlx_omnia.engine.models.deepseek_v2.model import DeepseekV2ForCausalLM


class DeepseekV2Checkpoint:
    model_types = ("deepseek_v2",)

    def build(self, config: Mapping[str, Any]) -> DeepseekV2ForCausalLM:
        return DeepseekV2ForCausalLM(DeepseekV2Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return DeepseekV2Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Stack the experts' tensors (see the module docstring); drop tensors that are derived,
        not learned (rotary inv_freq) and, when tied, a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return stack_experts(kept)


CHECKPOINT = DeepseekV2Checkpoint()
