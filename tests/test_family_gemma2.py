"""gemma2 family checks beyond tests/test_parity.py: the fixture really exercises the
attention and final soft-capping and the sliding window, refused variants, and the
MLX-quantized form round-trips."""

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
from tests.fixtures import parity

VARIANT = "gemma2-softcap"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _logits_with(changes: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Logits of the fixture as loaded, and of the same weights under a changed config."""
    d = parity.checkpoint_dir(VARIANT, "v5")
    config = read_json(d / "config.json")
    model = load(d, dtype="float32")
    other = family_for("gemma2").build({**config, **changes})
    set_parameters(other, list(flat_parameters(model.network).items()))
    bind_layers(other)
    ids = mx.array([parity.PROMPT_IDS], dtype=mx.int32)
    return np.array(model.network(ids)[0]), np.array(other(ids)[0])


@pytest.mark.parametrize(
    "changes",
    [
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"sliding_window": None},
        {"query_pre_attn_scalar": 32},
    ],
)
def test_fixture_exercises(changes: dict[str, Any]) -> None:
    ours, changed = _logits_with(changes)
    assert _rel(changed, ours) > 1e-3, changes


def test_v4_layers_alternate_from_sliding() -> None:
    config = read_json(parity.checkpoint_dir(VARIANT, "v4") / "config.json")
    assert "layer_types" not in config
    built = family_for("gemma2").build(config)
    windows = [layer.self_attn.attention.window for layer in built.model.layers]
    assert windows == [8, None, 8]


def test_refused_variants() -> None:
    config = read_json(parity.checkpoint_dir(VARIANT, "v5") / "config.json")
    family = family_for("gemma2")
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        family.build({**config, "hidden_activation": "silu"})
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        family.build({**config, "layer_types": ["chunked_attention"] * 3})
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        family.build({**config, "use_bidirectional_attention": True})


def test_quantized_round_trip(tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model (measured max rel 4-bit error 0.51)."""
    d = parity.checkpoint_dir(VARIANT, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.7
