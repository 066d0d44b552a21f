"""Stacking mixture-of-experts tensors from the layouts checkpoints use into the stacked
`<block>.experts.gate_up_proj` [experts, 2 * intermediate, hidden] (gate rows, then up rows) and
`<block>.experts.down_proj` [experts, hidden, intermediate] parameters of the MoE declarations
(core/moe.py). A family states its checkpoint's names in an `ExpertKeys`; the layouts are:

    <block>.experts.<e>.<gate|up|down>.weight        per expert (hub checkpoints, and what
                                                     transformers 5 save_pretrained writes)
    <block>.experts.gate_up_proj / .down_proj        stacked, transformers 5 in memory
    <block>.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}   stacked, mlx-community
    <block>.experts.{gate_up,down}_proj.{weight,scales,biases}      stacked, as this engine saves
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

from mlx_omnia.engine.errors import CheckpointError

# mlx-community's switch_mlp names, whatever the checkpoint calls its per-expert projections.
SWITCH_NAMES = ("gate_proj", "up_proj", "down_proj")
KIND = r"\.(?P<kind>weight|scales|biases)$"


@dataclass(frozen=True)
class ExpertKeys:
    """How a checkpoint names one MoE block's routed experts: the block
    (`model.layers.<i>.<block>`) and its per-expert gate, up and down projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


def stack_experts(weights: dict[str, mx.array], keys: ExpertKeys = ExpertKeys()) -> dict[str, mx.array]:
    """Stack per-expert (or mlx-community switch_mlp) tensors into experts.gate_up_proj and
    experts.down_proj; fused transformers-5 tensors gain their `.weight`; every other tensor
    keeps its name."""
    block = rf"^(?P<block>.+\.{re.escape(keys.block)})"
    names = (keys.gate, keys.up, keys.down)
    per_expert_key = re.compile(
        rf"{block}\.experts\.(?P<expert>\d+)\.(?P<proj>{'|'.join(map(re.escape, names))}){KIND}"
    )
    switch_key = re.compile(rf"{block}\.switch_mlp\.(?P<proj>{'|'.join(SWITCH_NAMES)}){KIND}")
    fused_key = re.compile(rf"{block}\.experts\.(?:gate_up_proj|down_proj)$")
    out: dict[str, mx.array] = {}
    # (block, kind) -> projection -> expert -> tensor (per expert), or projection -> tensor
    per_expert: dict[tuple[str, str], dict[str, dict[int, mx.array]]] = {}
    switch: dict[tuple[str, str], dict[str, mx.array]] = {}
    for name, tensor in weights.items():
        if m := per_expert_key.match(name):
            slot = per_expert.setdefault((m["block"], m["kind"]), {})
            slot.setdefault(m["proj"], {})[int(m["expert"])] = tensor
        elif m := switch_key.match(name):
            switch.setdefault((m["block"], m["kind"]), {})[m["proj"]] = tensor
        elif fused_key.match(name):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    for (at, kind), projs in per_expert.items():
        gate, up, down = (_stack(projs.get(proj, {}), f"{at}.experts", proj, kind) for proj in names)
        out[f"{at}.experts.gate_up_proj.{kind}"] = mx.concatenate([gate, up], axis=1)
        out[f"{at}.experts.down_proj.{kind}"] = down
    for (at, kind), projs in switch.items():
        if set(projs) != set(SWITCH_NAMES):
            raise CheckpointError(f"{at}.switch_mlp: {kind} is missing for some projections")
        out[f"{at}.experts.gate_up_proj.{kind}"] = mx.concatenate(
            [projs["gate_proj"], projs["up_proj"]], axis=1
        )
        out[f"{at}.experts.down_proj.{kind}"] = projs["down_proj"]
    return out


def _stack(experts: dict[int, mx.array], where: str, proj: str, kind: str) -> mx.array:
    """One projection's tensors, expert 0 first; every expert must have one."""
    if not experts or sorted(experts) != list(range(len(experts))):
        raise CheckpointError(
            f"{where}: {proj}.{kind} is missing for some experts (found {sorted(experts)})"
        )
    return mx.stack([experts[e] for e in range(len(experts))])
