"""How mamba2 checkpoints become a Mamba2ForCausalLM: config and tensor names (as saved; the
original state-spaces checkpoints' `embedding.` is transformers' `embeddings.`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.models.mamba2.config import Mamba2Config
from mlx_omnia.engine.models.mamba2.model import Mamba2ForCausalLM


class Mamba2Checkpoint:
    model_types = ("mamba2",)

    def build(self, config: Mapping[str, Any]) -> Mamba2ForCausalLM:
        return Mamba2ForCausalLM(Mamba2Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Mamba2Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        kept = {
            k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in weights.items()
        }
        if Mamba2Config.from_dict(config).tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return kept


CHECKPOINT = Mamba2Checkpoint()
