"""core.experts.stack_experts: one helper, each family naming its checkpoint's experts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.core.experts import ExpertKeys, stack_experts
from mlx_omnia.engine.errors import CheckpointError

MIXTRAL = ExpertKeys(block="block_sparse_moe", gate="w1", up="w3", down="w2")
BLOCK = "model.layers.0.block_sparse_moe"


def _per_expert(n: int) -> dict[str, mx.array]:
    rng = np.random.default_rng(0)
    out = {f"{BLOCK}.gate.weight": mx.array(rng.standard_normal((n, 4)).astype(np.float32))}
    for e in range(n):
        for name, shape in (("w1", (3, 4)), ("w3", (3, 4)), ("w2", (4, 3))):
            out[f"{BLOCK}.experts.{e}.{name}.weight"] = mx.array(rng.standard_normal(shape).astype(np.float32))
    return out


def test_per_expert_tensors_stack_as_gate_rows_then_up_rows() -> None:
    weights = _per_expert(2)
    got = stack_experts(weights, MIXTRAL)
    assert sorted(got) == [f"{BLOCK}.experts.down_proj.weight", f"{BLOCK}.experts.gate_up_proj.weight",
                           f"{BLOCK}.gate.weight"]
    gate_up = np.array(got[f"{BLOCK}.experts.gate_up_proj.weight"])
    assert gate_up.shape == (2, 6, 4)
    np.testing.assert_array_equal(gate_up[1, :3], np.array(weights[f"{BLOCK}.experts.1.w1.weight"]))
    np.testing.assert_array_equal(gate_up[1, 3:], np.array(weights[f"{BLOCK}.experts.1.w3.weight"]))
    down = np.array(got[f"{BLOCK}.experts.down_proj.weight"])
    np.testing.assert_array_equal(down[0], np.array(weights[f"{BLOCK}.experts.0.w2.weight"]))


def test_switch_mlp_and_fused_layouts_give_the_same_parameters() -> None:
    stacked = stack_experts(_per_expert(2), MIXTRAL)
    gate_up = stacked[f"{BLOCK}.experts.gate_up_proj.weight"]
    switch = {
        f"{BLOCK}.switch_mlp.gate_proj.weight": gate_up[:, :3],
        f"{BLOCK}.switch_mlp.up_proj.weight": gate_up[:, 3:],
        f"{BLOCK}.switch_mlp.down_proj.weight": stacked[f"{BLOCK}.experts.down_proj.weight"],
    }
    fused = {f"{BLOCK}.experts.gate_up_proj": gate_up,
             f"{BLOCK}.experts.down_proj": stacked[f"{BLOCK}.experts.down_proj.weight"]}
    for layout in (switch, fused):
        got = stack_experts(layout, MIXTRAL)
        assert sorted(got) == [f"{BLOCK}.experts.down_proj.weight", f"{BLOCK}.experts.gate_up_proj.weight"]
        for name, value in got.items():
            np.testing.assert_array_equal(np.array(value), np.array(stacked[name]))


def test_a_missing_expert_is_named_in_the_checkpoints_words() -> None:
    weights = _per_expert(3)
    del weights[f"{BLOCK}.experts.1.w3.weight"]
    with pytest.raises(CheckpointError, match=r"block_sparse_moe\.experts: w3\.weight is missing .*\[0, 2\]"):
        stack_experts(weights, MIXTRAL)


def test_another_blocks_names_are_left_alone() -> None:
    """Qwen-style names are not mixtral's experts: they keep their names."""
    weights = {"model.layers.0.mlp.experts.0.gate_proj.weight": mx.zeros((2, 2))}
    assert list(stack_experts(weights, MIXTRAL)) == list(weights)
    with pytest.raises(CheckpointError, match=r"mlp\.experts: up_proj\.weight is missing"):
        stack_experts(weights)  # the default keys (mlp, gate_proj...) take them as experts
