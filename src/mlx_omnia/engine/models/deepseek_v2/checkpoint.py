"""How deepseek_v2 checkpoints become a DeepseekV2ForCausalLM: config and tensor names.

Routed experts are stacked at load into the module tree's mlp.experts.gate_up_proj.weight
[experts, 2 * moe_intermediate, hidden] (gate rows, then up rows) and mlp.experts.down_proj.weight
[experts, hidden, moe_intermediate], from any of the layouts checkpoints use:

    mlp.experts.<e>.{gate,up,down}_proj.weight      per expert (hub checkpoints, and what
                                                    transformers 5 save_pretrained writes)
    mlp.experts.gate_up_proj / mlp.experts.down_proj   stacked, transformers 5 in memory
    mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}   stacked, mlx-community
    mlp.experts.{gate_up,down}_proj.{weight,scales,biases}      stacked, as this engine saves

The shared experts (mlp.shared_experts.*) and the attention's tensors load as named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.errors import CheckpointError
from mlx_omnia.engine.models.deepseek_v2.config import DeepseekV2Config
from mlx_omnia.engine.models.deepseek_v2.model import DeepseekV2ForCausalLM

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PER_EXPERT = re.compile(
    r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<kind>weight|scales|biases)$"
)
SWITCH = re.compile(
    r"^(?P<block>.+\.mlp)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<kind>weight|scales|biases)$"
)
FUSED = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def _stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    per_expert: dict[tuple[str, str], dict[str, dict[int, mx.array]]] = {}
    switch: dict[tuple[str, str], dict[str, mx.array]] = {}
    for name, tensor in weights.items():
        if m := PER_EXPERT.match(name):
            slot = per_expert.setdefault((m["block"], m["kind"]), {})
            slot.setdefault(m["proj"], {})[int(m["expert"])] = tensor
        elif m := SWITCH.match(name):
            switch.setdefault((m["block"], m["kind"]), {})[m["proj"]] = tensor
        elif FUSED.match(name):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    for (block, kind), projs in per_expert.items():
        stacked: dict[str, mx.array] = {}
        for proj in PROJECTIONS:
            experts = projs.get(proj, {})
            if not experts or sorted(experts) != list(range(len(experts))):
                raise CheckpointError(
                    f"{block}.experts: {proj}.{kind} is missing for some experts "
                    f"(found {sorted(experts)})"
                )
            stacked[proj] = mx.stack([experts[e] for e in range(len(experts))])
        out[f"{block}.experts.gate_up_proj.{kind}"] = mx.concatenate(
            [stacked["gate_proj"], stacked["up_proj"]], axis=1
        )
        out[f"{block}.experts.down_proj.{kind}"] = stacked["down_proj"]
    for (block, kind), projs in switch.items():
        if set(projs) != set(PROJECTIONS):
            raise CheckpointError(f"{block}.switch_mlp: {kind} is missing for some projections")
        out[f"{block}.experts.gate_up_proj.{kind}"] = mx.concatenate(
            [projs["gate_proj"], projs["up_proj"]], axis=1
        )
        out[f"{block}.experts.down_proj.{kind}"] = projs["down_proj"]
    return out


class DeepseekV2Checkpoint:
    model_types = ("deepseek_v2",)

    def build(self, config: Mapping[str, Any]) -> DeepseekV2ForCausalLM:
        return DeepseekV2ForCausalLM(DeepseekV2Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return DeepseekV2Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Stack the experts' tensors (see the module docstring); drop tensors that are derived,
        not learned (rotary inv_freq) and, when tied, a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        return _stack_experts(kept)


CHECKPOINT = DeepseekV2Checkpoint()
