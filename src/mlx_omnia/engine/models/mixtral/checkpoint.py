"""How mixtral checkpoints become a MixtralForCausalLM: config and tensor names.

Expert weights are stacked at load into the module tree's
block_sparse_moe.experts.gate_up_proj.weight [experts, 2 * intermediate, hidden] (gate rows,
then up rows) and block_sparse_moe.experts.down_proj.weight [experts, hidden, intermediate],
from any of the layouts checkpoints use:

    block_sparse_moe.experts.<e>.{w1,w3,w2}.weight   per expert, w1 gate, w3 up, w2 down (hub
                                                     checkpoints, transformers 5 save_pretrained)
    mlp.experts.gate_up_proj / mlp.experts.down_proj, mlp.gate.weight   stacked, transformers 5
                                                     in memory (block_sparse_moe renamed mlp)
    block_sparse_moe.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}   mlx-community
    block_sparse_moe.experts.{gate_up,down}_proj.{weight,scales,biases}   as this engine saves
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.errors import CheckpointError
from mlx_omnia.engine.models.mixtral.config import MixtralConfig
from mlx_omnia.engine.models.mixtral.model import MixtralForCausalLM

PER_EXPERT = re.compile(
    r"^(?P<block>.+\.block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3)"
    r"\.(?P<kind>weight|scales|biases)$"
)
SWITCH = re.compile(
    r"^(?P<block>.+\.block_sparse_moe)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<kind>weight|scales|biases)$"
)
FUSED = re.compile(r"^.+\.block_sparse_moe\.experts\.(?:gate_up_proj|down_proj)$")
V5_BLOCK = re.compile(r"^(model\.layers\.\d+)\.mlp\.")
# per-expert projection -> its part of the stacked layout
PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    per_expert: dict[tuple[str, str], dict[str, dict[int, mx.array]]] = {}
    switch: dict[tuple[str, str], dict[str, mx.array]] = {}
    for raw, tensor in weights.items():
        name = V5_BLOCK.sub(r"\1.block_sparse_moe.", raw)
        if m := PER_EXPERT.match(name):
            slot = per_expert.setdefault((m["block"], m["kind"]), {})
            slot.setdefault(PARTS[m["proj"]], {})[int(m["expert"])] = tensor
        elif m := SWITCH.match(name):
            switch.setdefault((m["block"], m["kind"]), {})[PARTS[m["proj"]]] = tensor
        elif FUSED.match(name):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    for (block, kind), parts in per_expert.items():
        stacked: dict[str, mx.array] = {}
        for part in ("gate", "up", "down"):
            experts = parts.get(part, {})
            if not experts or sorted(experts) != list(range(len(experts))):
                raise CheckpointError(
                    f"{block}.experts: the {part} projection's {kind} is missing for some "
                    f"experts (found {sorted(experts)})"
                )
            stacked[part] = mx.stack([experts[e] for e in range(len(experts))])
        out[f"{block}.experts.gate_up_proj.{kind}"] = mx.concatenate(
            [stacked["gate"], stacked["up"]], axis=1
        )
        out[f"{block}.experts.down_proj.{kind}"] = stacked["down"]
    for (block, kind), parts in switch.items():
        if set(parts) != {"gate", "up", "down"}:
            raise CheckpointError(f"{block}.switch_mlp: {kind} is missing for some projections")
        out[f"{block}.experts.gate_up_proj.{kind}"] = mx.concatenate(
            [parts["gate"], parts["up"]], axis=1
        )
        out[f"{block}.experts.down_proj.{kind}"] = parts["down"]
    return out


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
        return _stack_experts(kept)


CHECKPOINT = MixtralCheckpoint()
