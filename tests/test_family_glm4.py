"""glm4 family checks beyond tests/test_parity.py: partial_rotary_factor read from both
schemas, refused variants, and the MLX-quantized form round-trips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.glm4.config import Glm4Config
from tests.fixtures import parity

VARIANT = "glm4-partial"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("schema", parity.SCHEMAS)
def test_partial_rotary_factor(schema: str) -> None:
    config = read_json(parity.checkpoint_dir(VARIANT, schema) / "config.json")
    assert Glm4Config.from_dict(config).rotary_dims == 16  # half of head_dim 32
    built = family_for("glm4").build(config)
    rope = built.model.layers[0].self_attn.rope
    assert rope.dims == 16 and rope.traditional


def test_refused_variants() -> None:
    config = read_json(parity.checkpoint_dir(VARIANT, "v4") / "config.json")
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        family_for("glm4").build({**config, "hidden_act": "gelu"})


def test_quantized_round_trip(tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model (measured max rel 4-bit error 0.27)."""
    d = parity.checkpoint_dir(VARIANT, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.4
