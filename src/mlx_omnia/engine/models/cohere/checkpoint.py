"""How cohere checkpoints become a CohereForCausalLM: config and tensor names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.models.cohere.config import CohereConfig
from mlx_omnia.engine.models.cohere.model import CohereForCausalLM


class CohereCheckpoint:
    model_types = ("cohere",)

    def build(self, config: Mapping[str, Any]) -> CohereForCausalLM:
        return CohereForCausalLM(CohereConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return CohereConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop tensors that are derived, not learned (rotary inv_freq) and, when tied (every
        released Command R), a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", True):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return kept


CHECKPOINT = CohereCheckpoint()
