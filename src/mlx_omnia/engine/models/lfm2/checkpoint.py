"""How lfm2 checkpoints become an Lfm2ForCausalLM: config and tensor names (as saved).

mlx-lm's layout (what `mlx_lm.convert` and mlx-community publish, float or quantized) stores the
short convolution's weight channels-last [C, K, 1] (the hub's is [C, 1, K]); it is read back
by its shape (for K > 1). Its other names are the hub's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.mlx_layout import torch_convs
from mlx_omnia.engine.models.lfm2.config import Lfm2Config
from mlx_omnia.engine.models.lfm2.model import Lfm2ForCausalLM


def is_conv(name: str) -> bool:
    return name.endswith(".conv.conv.weight")


class Lfm2Checkpoint:
    model_types = ("lfm2",)

    def build(self, config: Mapping[str, Any]) -> Lfm2ForCausalLM:
        return Lfm2ForCausalLM(Lfm2Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Lfm2Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop derived tensors (rotary inv_freq) and, when tied, a saved copy of the embedding
        as lm_head; the convolution as torch stores it."""
        cfg = Lfm2Config.from_dict(config)
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return torch_convs(kept, is_conv, cfg.conv_kernel)[0]


CHECKPOINT = Lfm2Checkpoint()
