"""How qwen3_5 checkpoints become a Qwen3_5ForCausalLM: config and tensor names.

The image-text checkpoints (model_type qwen3_5 / qwen3_5_moe) hold the text model under
`model.language_model.*` beside the vision tower's `model.visual.*`: the text model's tensors
are renamed to this network's `model.*`, the vision tower's are not read (images are not an
input of this family yet). Routed experts are stacked by core.experts.stack_experts; the
multi-token-prediction head (`mtp.*`) is dropped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.models.qwen3_5.config import Qwen3_5Config
from mlx_omnia.engine.models.qwen3_5.model import Qwen3_5ForCausalLM

TEXT_PREFIX = "model.language_model."
DROPPED = ("model.visual.", "mtp.")


class Qwen3_5Checkpoint:
    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

    def build(self, config: Mapping[str, Any]) -> Qwen3_5ForCausalLM:
        return Qwen3_5ForCausalLM(Qwen3_5Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Qwen3_5Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        kept: dict[str, mx.array] = {}
        for name, tensor in weights.items():
            if name.startswith(DROPPED) or name.endswith("rotary_emb.inv_freq"):
                continue
            if name.startswith(TEXT_PREFIX):
                name = "model." + name.removeprefix(TEXT_PREFIX)
            kept[name] = tensor
        if Qwen3_5Config.from_dict(config).tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return stack_experts(kept)


CHECKPOINT = Qwen3_5Checkpoint()
