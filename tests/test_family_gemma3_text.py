"""gemma3_text family checks beyond tests/test_parity.py: per-layer-type rope read alike from
both schemas and really exercised, refused variants, and the MLX-quantized form round-trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.mxcompat import flat_parameters, set_parameters
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.gemma3_text.config import Gemma3TextConfig
from tests.fixtures import parity

VARIANTS = ["gemma3_text-linear", "gemma3_text-default"]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_schemas_read_alike(variant: str) -> None:
    v5 = Gemma3TextConfig.from_dict(read_json(parity.checkpoint_dir(variant, "v5") / "config.json"))
    v4 = Gemma3TextConfig.from_dict(read_json(parity.checkpoint_dir(variant, "v4") / "config.json"))
    assert v5.layer_types == v4.layer_types
    for kind in ("sliding_attention", "full_attention"):
        assert v5.rope[kind]["rope_type"] == v4.rope[kind]["rope_type"]
        assert float(v5.rope[kind]["rope_theta"]) == float(v4.rope[kind]["rope_theta"])
        assert v5.rope[kind].get("factor") == v4.rope[kind].get("factor")
    if variant == "gemma3_text-linear":
        assert v4.rope["full_attention"]["factor"] == 8.0
        assert v4.rope["sliding_attention"]["rope_type"] == "default"


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_local_base_freq": 1e6},  # the sliding layers' rope
        {"rope_scaling": None},  # the global layers' linear scaling
        {"sliding_window_pattern": 3},  # which layers are global
        {"sliding_window": None},
    ],
)
def test_fixture_exercises(changes: dict[str, Any]) -> None:
    d = parity.checkpoint_dir("gemma3_text-linear", "v4")
    config = read_json(d / "config.json")
    model = load(d, dtype="float32")
    other = family_for("gemma3_text").build({**config, **changes})
    set_parameters(other, list(flat_parameters(model.network).items()))
    bind_layers(other)
    ids = mx.array([parity.PROMPT_IDS], dtype=mx.int32)
    assert _rel(np.array(other(ids)[0]), np.array(model.network(ids)[0])) > 1e-3, changes


def test_refused_variants() -> None:
    config = read_json(parity.checkpoint_dir("gemma3_text-linear", "v5") / "config.json")
    family = family_for("gemma3_text")
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        family.build({**config, "attn_logit_softcapping": 50.0})
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        family.build({**config, "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        family.build({**config, "hidden_activation": "silu"})
    rope = {
        **config["rope_parameters"],
        "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
    }
    with pytest.raises(UnsupportedModelError, match="yarn"):
        family.build({**config, "rope_parameters": rope})


@pytest.mark.parametrize(("variant", "bound"), [(VARIANTS[0], 0.85), (VARIANTS[1], 1.1)])
def test_quantized_round_trip(variant: str, bound: float, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model (measured max rel 4-bit error: linear 0.63, default
    0.84; random weights and a quantized tied embedding)."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < bound
