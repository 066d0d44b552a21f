"""How mixtral checkpoints become a MixtralForCausalLM: config and tensor names.

Expert weights are stacked at load by core.experts.stack_experts (layouts listed there) under
mixtral's names: block_sparse_moe.experts.<e>.{w1,w3,w2} (gate, up, down). Transformers 5's
stacked in-memory layout calls the block mlp (mlp.experts.gate_up_proj, mlp.gate.weight): it is
renamed block_sparse_moe first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import ExpertKeys, stack_experts
from mlx_omnia.engine.models.mixtral.config import MixtralConfig
from mlx_omnia.engine.models.mixtral.model import MixtralForCausalLM

EXPERT_KEYS = ExpertKeys(block="block_sparse_moe", gate="w1", up="w3", down="w2")
V5_BLOCK = re.compile(r"^(model\.layers\.\d+)\.mlp\.")


class MixtralCheckpoint:
    model_types = ("mixtral",)

    def build(self, config: Mapping[str, Any]) -> MixtralForCausalLM:
        return MixtralForCausalLM(MixtralConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return MixtralConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Stack the experts' tensors (see the module docstring); drop tensors that are derived,
        not learned (rotary inv_freq) and, when tied, a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        kept = {V5_BLOCK.sub(r"\1.block_sparse_moe.", k): v for k, v in kept.items()}
        return stack_experts(kept, EXPERT_KEYS)


CHECKPOINT = MixtralCheckpoint()
