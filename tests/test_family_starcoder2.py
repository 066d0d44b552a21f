"""starcoder2 family checks beyond tests/test_parity.py: the sliding window is really exercised by
the fixture, and the MLX-quantized form round-trips through save/load."""

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


def test_sliding_window_changes_the_logits() -> None:
    """Past the window (8) the same weights without the window give other logits, so the
    parity test of starcoder2-sliding checks the windowed attention, not full attention."""
    d = parity.checkpoint_dir("starcoder2-sliding", "v5")
    config = read_json(d / "config.json")
    assert config["sliding_window"] == 8
    windowed = load(d, dtype="float32")
    family = family_for("starcoder2")
    full = family.build({**config, "sliding_window": None})
    set_parameters(full, list(flat_parameters(windowed.network).items()))
    bind_layers(full)
    ids = mx.array([parity.PROMPT_IDS], dtype=mx.int32)
    a = np.array(windowed.network(ids)[0])
    b = np.array(full(ids)[0])
    assert np.array_equal(a[:8], b[:8])  # within the window: identical
    assert _rel(a[8:], b[8:]) > 1e-2


@pytest.mark.parametrize("variant", ["starcoder2-sliding", "starcoder2-untied"])
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model (measured max rel 4-bit error: see the family report;
    uniform random weights are hard on 4 bits)."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.35
