"""phi3 family checks beyond tests/test_parity.py: the longrope switch and the prefix rerun at
the boundary are exercised, config aliases and refusals, and the MLX-quantized form
round-trips through save/load."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.rope import LongRope
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests.fixtures import parity


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _stepwise(net: object, ids: list[int], cache: list[KVCache]) -> np.ndarray:
    rows = [net(mx.array([[t]], dtype=mx.int32), cache)[0, -1] for t in ids]  # type: ignore[operator]
    return np.array(mx.stack(rows))


def test_longrope_crossing_reruns_the_prefix() -> None:
    """Fed one token at a time past original_max_position_embeddings (32), the model reruns
    the prefix with the long factors: every row equals a one-call forward of the sequence so
    far. Keeping the short-rope cache instead (plain KVCaches) gives other logits, so the
    greedy parity test of phi3-longrope checks the rerun."""
    m = load(parity.checkpoint_dir("phi3-longrope", "v5"), dtype="float32")
    net = m.network
    assert net.compile_decode is False
    assert isinstance(net.model.layers[0].self_attn.rope, LongRope)
    ids = (parity.PROMPT_IDS * 2)[:40]
    steps = _stepwise(net, ids, net.make_cache())
    for n in (20, 32, 33, 40):
        full = np.array(net(mx.array([ids[:n]], dtype=mx.int32))[0, -1])
        assert _rel(steps[n - 1], full) < 1e-5, n
    plain = _stepwise(net, ids, [KVCache() for _ in net.model.layers])
    assert np.array_equal(plain[:32], steps[:32])
    assert _rel(plain[32:], steps[32:]) > 1e-2


def test_longrope_long_factors_differ_from_short() -> None:
    """A 33-token sequence (past 32) uses the long factors for every position."""
    d = parity.checkpoint_dir("phi3-longrope", "v5")
    config = read_json(d / "config.json")
    net = load(d, dtype="float32").network
    ids = mx.array([(parity.PROMPT_IDS * 2)[:33]], dtype=mx.int32)
    long_rows = np.array(net(ids)[0, :32])
    short_rows = np.array(net(ids[:, :32])[0])
    assert _rel(long_rows, short_rows) > 1e-2
    # attention factor sqrt(1 + ln(128/32) / ln 32)
    rope = family_for("phi3").build(config).model.layers[0].self_attn.rope
    assert isinstance(rope, LongRope)
    assert rope.attention_factor == pytest.approx((1 + np.log(4) / np.log(32)) ** 0.5)
    assert rope.dims == 12


def test_su_is_longrope_and_other_kinds_are_refused() -> None:
    config = read_json(parity.checkpoint_dir("phi3-longrope", "v4") / "config.json")
    assert config["rope_scaling"]["type"] == "longrope"
    family = family_for("phi3")
    su = family.build({**config, "rope_scaling": {**config["rope_scaling"], "type": "su"}})
    assert isinstance(su.model.layers[0].self_attn.rope, LongRope)  # type: ignore[union-attr]
    for kind in ("yarn", "dynamic"):
        with pytest.raises(UnsupportedModelError, match=kind):
            family.build({**config, "rope_scaling": {"type": kind, "factor": 2.0}})
    with pytest.raises(UnsupportedModelError, match="short_factor has 5 entries"):
        family.build({**config, "rope_scaling": {**config["rope_scaling"], "short_factor": [1.0] * 5}})


@pytest.mark.parametrize("variant", ["phi3-sliding", "phi3-longrope"])
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model (fused qkv_proj/gate_up_proj keep their names), and close to the float model."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    assert q.network.model.layers[0].self_attn.qkv_proj.bits == 4
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.35
