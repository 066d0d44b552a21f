"""qwen2_moe family checks beyond tests/test_parity.py: the MLX-quantized round trip, the
stacked expert layouts, the shared expert and its gate, decoder_sparse_step and refusals."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.mxcompat import flat_parameters, set_parameters
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.qwen2_moe.model import Qwen2MoeForCausalLM
from tests import moe_family_checks as checks
from tests.fixtures import parity


@pytest.mark.parametrize("variant", ["qwen2_moe-shared", "qwen2_moe-step2"])
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """4-bit: measured max rel error vs float 0.306 (shared) and 0.264 (step2)."""
    assert checks.quantized_round_trip(variant, tmp_path) < 0.4


@pytest.mark.parametrize("variant", ["qwen2_moe-shared", "qwen2_moe-step2"])
def test_stacked_layouts_load_alike(variant: str, tmp_path: Path) -> None:
    checks.stacked_layouts_load_alike(variant, tmp_path)


def test_decoder_sparse_step() -> None:
    net = cast(Qwen2MoeForCausalLM, load(parity.checkpoint_dir("qwen2_moe-step2", "v4")).network)
    kinds = [type(layer.mlp).__name__ for layer in net.model.layers]
    assert kinds == ["Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"]


def test_shared_expert_gate_matters() -> None:
    """A shared_expert_gate of zeros (sigmoid 1/2) changes the logits: the gate is applied."""
    model = load(parity.checkpoint_dir("qwen2_moe-shared", "v5"), dtype="float32")
    before = checks.logits(model)
    params = flat_parameters(model.network)
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    set_parameters(model.network, [(name, mx.zeros_like(params[name]))])
    assert checks.rel(checks.logits(model), before.astype(np.float64)) > 1e-3


def test_sliding_window_is_refused() -> None:
    config = read_json(parity.checkpoint_dir("qwen2_moe-shared", "v5") / "config.json")
    family = family_for("qwen2_moe")
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        family.build({**config, "use_sliding_window": True})
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        family.build({**config, "layer_types": ["sliding_attention", "full_attention"]})
