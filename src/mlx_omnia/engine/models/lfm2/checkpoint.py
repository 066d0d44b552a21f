"""How lfm2 checkpoints become an Lfm2ForCausalLM: config and tensor names (as saved)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.models.lfm2.config import Lfm2Config
from mlx_omnia.engine.models.lfm2.model import Lfm2ForCausalLM


class Lfm2Checkpoint:
    model_types = ("lfm2",)

    def build(self, config: Mapping[str, Any]) -> Lfm2ForCausalLM:
        return Lfm2ForCausalLM(Lfm2Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Lfm2Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop derived tensors (rotary inv_freq) and, when tied, a saved copy of the embedding
        as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if Lfm2Config.from_dict(config).tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return kept


CHECKPOINT = Lfm2Checkpoint()
