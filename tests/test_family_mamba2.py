"""mamba2 family checks beyond tests/test_parity.py: refusals, a model of recurrent layers only
through every decode path (the compiled step, a batch, the prefix cache, whose blocks then hold
no rows and whose anchors hold everything), and the MLX-quantized round trip."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests import hybrid_checks
from tests.fixtures import parity

VARIANTS = ["mamba2-groups", "mamba2-tied"]


def config(variant: str) -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, "v5") / "config.json")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"time_step_limit": [0.01, 0.5]}, "time_step_limit"),
        ({"num_heads": 6}, "expand"),
        ({"n_groups": 3}, "n_groups"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("mamba2").build({**config("mamba2-groups"), **change})


def test_infinity_in_either_spelling() -> None:
    base = config("mamba2-groups")
    family_for("mamba2").build({**base, "time_step_limit": [0.0, math.inf]})  # older configs
    family_for("mamba2").build({**base, "time_step_limit": [0.0, {"__float__": "Infinity"}]})


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_greedy_generation_compiled_equals_eager(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(parity.checkpoint_dir("mamba2-groups", "v5"), dtype="float32")
    monkeypatch.setenv("OMNIA_COMPILE", compiled)
    got = model.generate("Tell me a story", hybrid_checks.options(24)).token_ids
    monkeypatch.setenv("OMNIA_COMPILE", "0")
    assert got == model.generate("Tell me a story", hybrid_checks.options(24)).token_ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_greedy_equals_each_alone(variant: str) -> None:
    hybrid_checks.batched_equals_alone(load(parity.checkpoint_dir(variant, "v5"), dtype="float32"))


def test_a_resent_conversation_resumes_from_the_prefix_cache(tmp_path: Path) -> None:
    model = load(parity.checkpoint_dir("mamba2-groups", "v5"), dtype="float32")
    hybrid_checks.prefix_resumes_recurrent_layers(model, tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits; 8 bits near the float model."""
    d = parity.checkpoint_dir(variant, "v5")
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    np.testing.assert_array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q8 = np.array(load(d, quantize=8, dtype="float32").logits(parity.PROMPT_IDS))
    assert float(np.abs(q8 - ref).max() / np.abs(ref).max()) < 0.1
