"""How lfm2 checkpoints become an Lfm2MoeForCausalLM: config and tensor names (as saved)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import ExpertKeys, stack_experts
from mlx_omnia.engine.models.lfm2_moe.config import Lfm2MoeConfig
from mlx_omnia.engine.models.lfm2_moe.model import Lfm2MoeForCausalLM

EXPERT_KEYS = ExpertKeys(block="feed_forward", gate="w1", up="w3", down="w2")


class Lfm2MoeCheckpoint:
    model_types = ("lfm2_moe",)

    def build(self, config: Mapping[str, Any]) -> Lfm2MoeForCausalLM:
        return Lfm2MoeForCausalLM(Lfm2MoeConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Lfm2MoeConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop derived tensors (rotary inv_freq) and, when tied, a saved copy of the embedding
        as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if Lfm2MoeConfig.from_dict(config).tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return stack_experts(kept, EXPERT_KEYS)


CHECKPOINT = Lfm2MoeCheckpoint()
