"""How lfm2 checkpoints become an Lfm2MoeForCausalLM: config and tensor names (as saved).

mlx-lm's layout (what `mlx_lm.convert` and mlx-community publish, float or quantized) differs
from the hub's in three ways, each undone here: the short convolution's weight is channels-last
[C, K, 1] (the hub's is [C, 1, K]; told apart by its shape, for K > 1), the dense feed-forward's
w1 / w3 / w2 are named gate_proj / up_proj / down_proj, and the experts are stacked as
`feed_forward.switch_mlp.*` (read by core.experts.stack_experts)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import ExpertKeys, stack_experts
from mlx_omnia.engine.core.mlx_layout import torch_convs
from mlx_omnia.engine.models.lfm2_moe.config import Lfm2MoeConfig
from mlx_omnia.engine.models.lfm2_moe.model import Lfm2MoeForCausalLM

EXPERT_KEYS = ExpertKeys(block="feed_forward", gate="w1", up="w3", down="w2")
# mlx-lm's names of a dense layer's feed-forward -> the checkpoint's (never in a hub checkpoint).
MLX_LM_DENSE = re.compile(
    r"^(?P<at>model\.layers\.\d+\.feed_forward)\.(?P<proj>gate_proj|up_proj|down_proj)\."
    r"(?P<kind>weight|scales|biases)$"
)
DENSE_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def is_conv(name: str) -> bool:
    return name.endswith(".conv.conv.weight")


def dense_name(name: str) -> str:
    if m := MLX_LM_DENSE.match(name):
        return f"{m['at']}.{DENSE_NAMES[m['proj']]}.{m['kind']}"
    return name


class Lfm2MoeCheckpoint:
    model_types = ("lfm2_moe",)

    def build(self, config: Mapping[str, Any]) -> Lfm2MoeForCausalLM:
        return Lfm2MoeForCausalLM(Lfm2MoeConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Lfm2MoeConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop derived tensors (rotary inv_freq) and, when tied, a saved copy of the embedding
        as lm_head; mlx-lm's layout read back; the experts stacked."""
        cfg = Lfm2MoeConfig.from_dict(config)
        kept = {
            dense_name(k): v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")
        }
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        kept, _ = torch_convs(kept, is_conv, cfg.conv_kernel)
        return stack_experts(kept, EXPERT_KEYS)


CHECKPOINT = Lfm2MoeCheckpoint()
