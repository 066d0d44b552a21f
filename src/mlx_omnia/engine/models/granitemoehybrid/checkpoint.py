"""How granitemoehybrid checkpoints become a GraniteMoeHybridForCausalLM: config and tensor names.

The hub's checkpoints (and transformers' save_pretrained) store the experts stacked as this
family names them (`block_sparse_moe.input_linear` [experts, 2 * intermediate, hidden],
`output_linear` [experts, hidden, intermediate], `router.layer`). mlx-community's conversions
rename and split them, and sanitize puts them back:

    <layer>.block_sparse_moe.switch_mlp.{gate,up,down}_proj.*   -> input_linear / output_linear
    <layer>.mlp.{gate,up,down}_proj.* (models without experts)   -> shared_mlp.input_linear / ...
    <layer>.mamba.conv1d.weight [channels, kernel, 1]            -> [channels, 1, kernel]
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.mlx_layout import torch_convs
from mlx_omnia.engine.errors import CheckpointError
from mlx_omnia.engine.models.granitemoehybrid.config import GraniteMoeHybridConfig
from mlx_omnia.engine.models.granitemoehybrid.model import GraniteMoeHybridForCausalLM

KIND = r"\.(?P<kind>weight|scales|biases)$"
SWITCH = re.compile(rf"^(?P<at>.+)\.block_sparse_moe\.switch_mlp\.(?P<proj>gate|up|down)_proj{KIND}")
DENSE = re.compile(rf"^(?P<at>.+)\.mlp\.(?P<proj>gate|up|down)_proj{KIND}")
# (where the parts go, the axis gate and up stack along: the experts' output rows are axis 1)
TARGETS = {SWITCH: ("block_sparse_moe", 1), DENSE: ("shared_mlp", 0)}


def _joined(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-community's split gate / up / down projections back into input_linear ([gate; up]
    along the output rows) and output_linear; every other tensor keeps its name."""
    out: dict[str, mx.array] = {}
    parts: dict[tuple[str, str, str], dict[str, mx.array]] = {}
    for name, tensor in weights.items():
        for pattern, (block, _) in TARGETS.items():
            if m := pattern.match(name):
                parts.setdefault((f"{m['at']}.{block}", m["kind"], block), {})[m["proj"]] = tensor
                break
        else:
            out[name] = tensor
    axes = dict(TARGETS.values())
    for (at, kind, block), found in parts.items():
        if set(found) != {"gate", "up", "down"}:
            raise CheckpointError(f"{at}: {kind} is missing for some of gate/up/down_proj "
                                  f"(found {', '.join(sorted(found))})")
        out[f"{at}.input_linear.{kind}"] = mx.concatenate([found["gate"], found["up"]],
                                                          axis=axes[block])
        out[f"{at}.output_linear.{kind}"] = found["down"]
    return out


class GraniteMoeHybridCheckpoint:
    model_types = ("granitemoehybrid",)

    def build(self, config: Mapping[str, Any]) -> GraniteMoeHybridForCausalLM:
        return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return GraniteMoeHybridConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Drop derived tensors (rotary inv_freq) and, when tied, a saved copy of the embedding
        as lm_head; put mlx-community's layout back (module docstring)."""
        cfg = GraniteMoeHybridConfig.from_dict(config)
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        kept, _ = torch_convs(kept, lambda k: k.endswith(".conv1d.weight"), cfg.mamba_d_conv)
        return _joined(kept)


CHECKPOINT = GraniteMoeHybridCheckpoint()
