"""How exaone4 checkpoints become a Exaone4ForCausalLM: config and tensor names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.models.exaone4.config import Exaone4Config
from mlx_omnia.engine.models.exaone4.model import Exaone4ForCausalLM


class Exaone4Checkpoint:
    model_types = ("exaone4",)

    def build(self, config: Mapping[str, Any]) -> Exaone4ForCausalLM:
        return Exaone4ForCausalLM(Exaone4Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Exaone4Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop tensors that are derived, not learned (rotary inv_freq) and, when tied, a saved
        copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return kept


CHECKPOINT = Exaone4Checkpoint()
