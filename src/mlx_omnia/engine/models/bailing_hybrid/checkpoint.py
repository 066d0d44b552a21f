"""How bailing_hybrid checkpoints become a BailingHybridForCausalLM: config and tensor names.

The network is named as the hub's checkpoints (and transformers 5's save_pretrained) name the
tensors: `word_embeddings`, `attention.*` with `dense` as the output projection and one
convolution a projection (q_conv1d, k_conv1d, v_conv1d), the router's `expert_bias`. Routed
experts are stacked at load by core.experts.stack_experts (layouts listed there). Layers past
num_hidden_layers are the multi-token-prediction head (for speculative decoding), not part of
this network: their tensors are dropped.

model_type bailing_hybrid also names Ling 2.5, whose linear layers are lightning attention
(`attention.query_key_value`, a fixed decay a head: what mlx-lm's bailing_hybrid and
mlx-community's conversions are). transformers' bailing_hybrid is Ling 3.0's delta attention,
so those checkpoints are refused by that tensor's name."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.models.bailing_hybrid.config import BailingHybridConfig
from mlx_omnia.engine.models.bailing_hybrid.model import BailingHybridForCausalLM

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
LIGHTNING = ".attention.query_key_value."


def beyond(name: str, layers: int) -> bool:
    """Whether `name` is a tensor of a layer past the network's `layers` (the MTP head's)."""
    m = LAYER.match(name)
    return m is not None and int(m.group(1)) >= layers


class BailingHybridCheckpoint:
    model_types = ("bailing_hybrid",)

    def build(self, config: Mapping[str, Any]) -> BailingHybridForCausalLM:
        return BailingHybridForCausalLM(BailingHybridConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return BailingHybridConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        lightning = next((k for k in weights if LIGHTNING in k), None)
        if lightning is not None:
            raise UnsupportedModelError(
                f"bailing_hybrid: {lightning} is Ling 2.5's lightning attention, which is not "
                "supported (transformers' bailing_hybrid, supported here, is Ling 3.0's delta "
                "attention)"
            )
        layers = BailingHybridConfig.from_dict(config).num_hidden_layers
        kept = {
            k: v for k, v in weights.items()
            if not k.endswith("rotary_emb.inv_freq") and not beyond(k, layers)
        }
        return stack_experts(kept)


CHECKPOINT = BailingHybridCheckpoint()
