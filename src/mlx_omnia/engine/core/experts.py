"""Stacking mixture-of-experts tensors from the layouts checkpoints use into the stacked
`experts.gate_up_proj` / `experts.down_proj` parameters of the MoE declarations (core/moe.py).

Shared byte for byte by the families whose checkpoints name experts `mlp.experts.<e>.*_proj`
(qwen3_moe, qwen2_moe, olmoe):

    mlp.experts.<e>.{gate,up,down}_proj.weight      per expert (hub checkpoints, and what
                                                    transformers 5 save_pretrained writes)
    mlp.experts.gate_up_proj / mlp.experts.down_proj   stacked, transformers 5 in memory
    mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}   stacked, mlx-community
    mlp.experts.{gate_up,down}_proj.{weight,scales,biases}      stacked, as this engine saves
"""

from __future__ import annotations

import re

import mlx.core as mx

from mlx_omnia.engine.errors import CheckpointError

PER_EXPERT = re.compile(
    r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<kind>weight|scales|biases)$"
)
SWITCH = re.compile(
    r"^(?P<block>.+\.mlp)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<kind>weight|scales|biases)$"
)
FUSED = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Stack per-expert (or mlx-community switch_mlp) tensors into experts.gate_up_proj
    [experts, 2 * intermediate, hidden] (gate rows, then up rows) and experts.down_proj
    [experts, hidden, intermediate]; fused transformers-5 tensors gain their `.weight`."""
    out: dict[str, mx.array] = {}
    # (block, kind) -> proj -> expert -> tensor (per expert), or proj -> tensor (switch_mlp)
    per_expert: dict[tuple[str, str], dict[str, dict[int, mx.array]]] = {}
    switch: dict[tuple[str, str], dict[str, mx.array]] = {}
    for name, tensor in weights.items():
        if m := PER_EXPERT.match(name):
            slot = per_expert.setdefault((m["block"], m["kind"]), {})
            slot.setdefault(m["proj"], {})[int(m["expert"])] = tensor
        elif m := SWITCH.match(name):
            switch.setdefault((m["block"], m["kind"]), {})[m["proj"]] = tensor
        elif m := FUSED.match(name):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    for (block, kind), projs in per_expert.items():
        stacked: dict[str, mx.array] = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
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
        if set(projs) != {"gate_proj", "up_proj", "down_proj"}:
            raise CheckpointError(f"{block}.switch_mlp: {kind} is missing for some projections")
        out[f"{block}.experts.gate_up_proj.{kind}"] = mx.concatenate(
            [projs["gate_proj"], projs["up_proj"]], axis=1
        )
        out[f"{block}.experts.down_proj.{kind}"] = projs["down_proj"]
    return out
