"""qwen3_moe family checks beyond tests/test_parity.py: the MLX-quantized round trip, the
stacked expert layouts, both config schemas' expert counts, mlp_only_layers and refusals."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import mlx.core as mx
import pytest

from mlx_omnia import load
from mlx_omnia.engine.errors import CheckpointError, UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json, read_safetensors
from mlx_omnia.engine.models.qwen3_moe.model import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock
from tests import moe_family_checks as checks
from tests.fixtures import parity

VARIANT = "qwen3_moe-sparse"


def test_quantized_round_trip(tmp_path: Path) -> None:
    """4-bit: measured max rel error vs float 0.238 (uniform random weights, routing flips)."""
    assert checks.quantized_round_trip(VARIANT, tmp_path) < 0.35


def test_stacked_layouts_load_alike(tmp_path: Path) -> None:
    checks.stacked_layouts_load_alike(VARIANT, tmp_path)


def test_expert_count_in_both_schemas() -> None:
    v5 = read_json(parity.checkpoint_dir(VARIANT, "v5") / "config.json")
    v4 = read_json(parity.checkpoint_dir(VARIANT, "v4") / "config.json")
    assert v5["num_local_experts"] == 8 and "num_experts" not in v5
    assert v4["num_experts"] == 8 and "num_local_experts" not in v4


def test_mlp_only_layers_are_dense() -> None:
    net = cast(Qwen3MoeForCausalLM, load(parity.checkpoint_dir(VARIANT, "v5"), dtype="float32").network)
    kinds = [type(layer.mlp).__name__ for layer in net.model.layers]
    assert kinds == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]


def test_missing_expert_is_an_error() -> None:
    d = parity.checkpoint_dir(VARIANT, "v5")
    config = read_json(d / "config.json")
    weights = read_safetensors(d)
    del weights["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match="missing for some experts"):
        family_for("qwen3_moe").sanitize(weights, config)


def test_sliding_window_is_refused() -> None:
    config = read_json(parity.checkpoint_dir(VARIANT, "v4") / "config.json")
    family = family_for("qwen3_moe")
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        family.build({**config, "use_sliding_window": True})
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        family.build({**config, "layer_types": ["full_attention", "sliding_attention", "full_attention"]})


def test_routing_renormalizes() -> None:
    """norm_topk_prob: the routing weights of every token sum to one."""
    net = cast(Qwen3MoeForCausalLM, load(parity.checkpoint_dir(VARIANT, "v5"), dtype="float32").network)
    block = net.model.layers[0].mlp
    assert isinstance(block, Qwen3MoeSparseMoeBlock)
    x = mx.random.normal((5, 64), key=mx.random.key(0))
    weights, ids = block.route(x)  # the router reads h (its norm, then the gate)
    assert ids.shape == (5, 2)
    assert mx.allclose(weights.sum(axis=-1), mx.ones((5,)), atol=1e-6).item()
