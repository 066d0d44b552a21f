"""How llama checkpoints become a LlamaForCausalLM: config, tensor names, foreign formats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.models.llama.config import LlamaConfig
from mlx_omnia.engine.models.llama.gguf import config_from_gguf, weights_from_gguf
from mlx_omnia.engine.models.llama.model import LlamaForCausalLM


class LlamaCheckpoint:
    model_types = ("llama",)
    gguf_architecture = "llama"

    def build(self, config: Mapping[str, Any]) -> LlamaForCausalLM:
        return LlamaForCausalLM(LlamaConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return LlamaConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop tensors that are derived, not learned (old checkpoints saved rotary inv_freq)."""
        dropped = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            dropped = {k: v for k, v in dropped.items() if not k.startswith("lm_head.")}
        return dropped

    def gguf_config(
        self, metadata: Mapping[str, Any], tensors: Mapping[str, mx.array]
    ) -> dict[str, Any]:
        return config_from_gguf(metadata, tensors)

    def gguf_weights(
        self, tensors: Mapping[str, mx.array], config: Mapping[str, Any]
    ) -> dict[str, mx.array]:
        return weights_from_gguf(tensors, config)


CHECKPOINT = LlamaCheckpoint()
