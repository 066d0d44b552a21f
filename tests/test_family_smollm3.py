"""smollm3 family checks beyond tests/test_parity.py: NoPE layers are read from
no_rope_layers (or derived from no_rope_layer_interval), sliding windows are refused by name,
and the MLX-quantized form round-trips through save/load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests.fixtures import parity


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_no_rope_layers() -> None:
    config = read_json(parity.checkpoint_dir("smollm3-nope", "v4") / "config.json")
    assert config["no_rope_layers"] == [1, 1, 1, 0]
    family = family_for("smollm3")

    def flags(cfg: dict[str, object]) -> list[bool]:
        net = family.build(cfg)
        return [layer.self_attn.use_rope for layer in net.model.layers]  # type: ignore[union-attr]

    assert flags(config) == [True, True, True, False]
    derived = {k: v for k, v in config.items() if k != "no_rope_layers"}
    assert flags({**derived, "no_rope_layer_interval": 2}) == [True, False, True, False]
    assert flags({**config, "no_rope_layers": [0, 1, 0, 1]}) == [False, True, False, True]


def test_sliding_window_is_refused() -> None:
    config = read_json(parity.checkpoint_dir("smollm3-nope", "v4") / "config.json")
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        family_for("smollm3").build({**config, "use_sliding_window": True})


def test_quantized_round_trip(tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model."""
    d = parity.checkpoint_dir("smollm3-nope", "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.35
