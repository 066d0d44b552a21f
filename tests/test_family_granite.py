"""granite family checks beyond tests/test_parity.py: the MLX-quantized form round-trips
through save/load, and each of Granite's four scalars changes the logits (so parity checks
all of them)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.mxcompat import flat_parameters, set_parameters
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests.fixtures import parity


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "key", ["embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"]
)
def test_each_multiplier_is_read(key: str) -> None:
    d = parity.checkpoint_dir("granite-tied", "v4")
    config = read_json(d / "config.json")
    m = load(d, dtype="float32")
    other = family_for("granite").build({**config, key: 1.0})
    set_parameters(other, list(flat_parameters(m.network).items()))
    bind_layers(other)
    ids = mx.array([parity.PROMPT_IDS], dtype=mx.int32)
    assert _rel(np.array(other(ids)[0]), np.array(m.logits(parity.PROMPT_IDS))) > 1e-2


@pytest.mark.parametrize("variant", ["granite-tied", "granite-bias"])
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.35
