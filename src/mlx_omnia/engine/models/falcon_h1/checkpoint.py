"""How falcon_h1 checkpoints become a FalconH1ForCausalLM: config and tensor names (as saved).

mlx-lm converts Falcon-H1 by folding the multipliers into the weights (and storing conv1d as
[channels, kernel, 1]); such a checkpoint computes another model than its config.json says, so
it is refused by name rather than run with every multiplier applied twice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.models.falcon_h1.config import FalconH1Config
from mlx_omnia.engine.models.falcon_h1.model import FalconH1ForCausalLM


class FalconH1Checkpoint:
    model_types = ("falcon_h1",)

    def build(self, config: Mapping[str, Any]) -> FalconH1ForCausalLM:
        return FalconH1ForCausalLM(FalconH1Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return FalconH1Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Refuse mlx-lm's folded conversion; drop a saved copy of the embedding as lm_head
        when tied."""
        for name, tensor in weights.items():
            if name.endswith("mamba.conv1d.weight") and tensor.ndim == 3 and tensor.shape[1] != 1:
                raise UnsupportedModelError(
                    f"falcon_h1: checkpoints converted by mlx-lm are not supported ({name} is "
                    "stored [channels, kernel, 1], the multipliers folded into the weights); "
                    "load the original transformers checkpoint (tiiuae's) instead"
                )
        if FalconH1Config.from_dict(config).tie_word_embeddings:
            return {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights


CHECKPOINT = FalconH1Checkpoint()
