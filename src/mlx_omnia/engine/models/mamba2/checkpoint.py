"""How mamba2 checkpoints become a Mamba2ForCausalLM: config and tensor names (as saved; the
original state-spaces checkpoints' `embedding.` is transformers' `embeddings.`).

mlx-lm's layout (what `mlx_lm.convert` and mlx-community publish, float or quantized) stores the
mixer's conv1d weight channels-last [C, K, 1] (the hub's is [C, 1, K]); it is read back by its
shape (for K > 1). Its other names are the hub's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.mlx_layout import torch_convs
from mlx_omnia.engine.models.mamba2.config import Mamba2Config
from mlx_omnia.engine.models.mamba2.model import Mamba2ForCausalLM


def is_conv(name: str) -> bool:
    return name.endswith(".mixer.conv1d.weight")


class Mamba2Checkpoint:
    model_types = ("mamba2",)

    def build(self, config: Mapping[str, Any]) -> Mamba2ForCausalLM:
        return Mamba2ForCausalLM(Mamba2Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Mamba2Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        cfg = Mamba2Config.from_dict(config)
        kept = {
            k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in weights.items()
        }
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return torch_convs(kept, is_conv, cfg.conv_kernel)[0]


CHECKPOINT = Mamba2Checkpoint()
