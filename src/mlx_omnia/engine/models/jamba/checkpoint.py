"""How jamba checkpoints become a JambaForCausalLM: config and tensor names.

Routed experts are stacked at load by core.experts.stack_experts under the block
`feed_forward`: per expert (feed_forward.experts.<e>.{gate,up,down}_proj, as the hub's
checkpoints and transformers' save_pretrained write them), transformers 5's fused in-memory
tensors, mlx-community's switch_mlp. mlx-community checkpoints also store each Mamba
convolution as MLX's Conv1d does, [channels, kernel, 1]: it is read back as torch's
[channels, 1, kernel]."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import ExpertKeys, stack_experts
from mlx_omnia.engine.core.mlx_layout import torch_convs
from mlx_omnia.engine.models.jamba.config import JambaConfig
from mlx_omnia.engine.models.jamba.model import JambaForCausalLM

EXPERT_KEYS = ExpertKeys(block="feed_forward")


class JambaCheckpoint:
    model_types = ("jamba",)

    def build(self, config: Mapping[str, Any]) -> JambaForCausalLM:
        return JambaForCausalLM(JambaConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return JambaConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Stack the experts' tensors, take convolutions in MLX's layout back to torch's; when
        tied, drop a saved copy of the embedding as lm_head."""
        cfg = JambaConfig.from_dict(config)
        kept, _ = torch_convs(weights, lambda k: k.endswith("mamba.conv1d.weight"), cfg.mamba_d_conv)
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return stack_experts(kept, EXPERT_KEYS)


CHECKPOINT = JambaCheckpoint()
