"""How gemma3_text checkpoints become a Gemma3ForCausalLM: config and tensor names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.models.gemma3_text.config import Gemma3TextConfig
from mlx_omnia.engine.models.gemma3_text.model import Gemma3ForCausalLM


class Gemma3TextCheckpoint:
    model_types = ("gemma3_text",)

    def build(self, config: Mapping[str, Any]) -> Gemma3ForCausalLM:
        return Gemma3ForCausalLM(Gemma3TextConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Gemma3TextConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop tensors that are derived, not learned (rotary inv_freq) and, when tied (every
        released Gemma 3), a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("inv_freq")}
        if config.get("tie_word_embeddings", True):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return kept


CHECKPOINT = Gemma3TextCheckpoint()
