"""granitemoehybrid family checks beyond tests/test_parity.py: layer kinds from either spelling
and the refusals, prefill over several scan chunks against transformers' logits, long prefill ==
stepwise decode through the compiled step, compiled == eager, batched == alone, the prefix
cache, mlx-community's layout, and the MLX-quantized round trip."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.mxcompat import flat_parameters
from mlx_omnia.engine.core.recurrent import SelectiveScan
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.granitemoehybrid.config import layer_types
from tests import hybrid_checks
from tests.fixtures import parity

VARIANTS = ["granitemoehybrid-moe", "granitemoehybrid-dense"]
M, A = "mamba", "attention"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def config(variant: str, schema: str = "v5") -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, schema) / "config.json")


def logits(variant: str, path: Path | None = None, **kwargs: Any) -> np.ndarray:
    model = load(path or parity.checkpoint_dir(variant, "v5"), dtype="float32", **kwargs)
    return np.array(model.logits(parity.PROMPT_IDS))


def test_layer_kinds() -> None:
    assert layer_types({}, 3) == (M, M, M)  # transformers' default: every layer Mamba
    assert layer_types({"layer_types": ["linear_attention", "full_attention"]}, 2) == (M, A)
    assert layer_types({"layer_types": ["mamba", "attention"]}, 2) == (M, A)
    assert layer_types({"layers_block_type": ["attention", "mamba"]}, 2) == (A, M)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": [M, "moe", A, M]}, "moe"),
        ({"layer_types": [M, A]}, "names 2 layers"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
        ({"position_embedding_type": "rope",
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"position_embedding_type": "rope",
          "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                              "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"time_step_limit": [0.01, 0.5]}, "time_step_limit"),
        ({"mamba_n_heads": 6}, "divide"),
        ({"mamba_d_head": 8}, "mamba_d_head"),
        ({"mamba_n_groups": 3}, "mamba_n_groups"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_local_experts": None}, "num_local_experts"),
        ({"shared_intermediate_size": 0}, "shared_intermediate_size"),
        ({"embedding_multiplier": None}, "embedding_multiplier"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("granitemoehybrid").build({**config("granitemoehybrid-moe"), **change})


def test_infinity_in_either_spelling_and_the_layer_kinds_alias() -> None:
    family = family_for("granitemoehybrid")
    base = config("granitemoehybrid-moe")
    family.build({**base, "time_step_limit": [0.0, math.inf]})  # older configs
    family.build({**base, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    old = config("granitemoehybrid-moe", "v4")
    kinds = old.pop("layer_types")
    family.build({**old, "layers_block_type": kinds})


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [8, 10])
def test_prefill_over_several_chunks_matches_transformers(variant: str, chunk: int) -> None:
    """The 24-token prompt in scan chunks of 8 (three) and 10 (three, the last padded):
    transformers' logits within the parity tolerance."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    scans = [m for _, m in model.network.named_modules() if isinstance(m, SelectiveScan)]
    assert scans
    for scan in scans:
        scan.chunk = chunk
    ref = parity.load_reference(variant)
    got = np.array(model.network(mx.array([parity.PROMPT_IDS], dtype=mx.int32))[0])
    assert _rel(got, ref.logits64) <= max(10 * ref.info["fp32_fp64_spread"], 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_long_prefill_equals_stepwise_decode(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 tokens (four scan chunks) prefilled in passes of 96 rows, then 8 tokens through the
    compiled step, against every token fed one at a time (eager)."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    hybrid_checks.long_prefill_equals_stepwise(model, monkeypatch)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_compiled_equals_eager(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    monkeypatch.setenv("OMNIA_COMPILE", "1")
    got = model.generate("Tell me a story", hybrid_checks.options(24)).token_ids
    monkeypatch.setenv("OMNIA_COMPILE", "0")
    assert got == model.generate("Tell me a story", hybrid_checks.options(24)).token_ids


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("compiled", ["1", "0"])
def test_batched_greedy_equals_each_alone(
    variant: str, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIA_COMPILE", compiled)
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    assert model.signature.batched
    hybrid_checks.batched_equals_alone(model)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_resent_conversation_resumes_from_the_prefix_cache(variant: str, tmp_path: Path) -> None:
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    hybrid_checks.prefix_resumes_recurrent_layers(model, tmp_path)


def _mlx_community(name: str, value: mx.array) -> dict[str, mx.array]:
    """One tensor as mlx-lm's conversion writes it: experts split into switch_mlp's gate / up /
    down, a model without experts' shared MLP as mlp's, convolutions [channels, kernel, 1]."""
    if m := re.match(r"^(.+)\.block_sparse_moe\.(input|output)_linear\.weight$", name):
        at = f"{m[1]}.block_sparse_moe.switch_mlp"
        if m[2] == "output":
            return {f"{at}.down_proj.weight": value}
        gate, up = mx.split(value, 2, axis=1)
        return {f"{at}.gate_proj.weight": gate, f"{at}.up_proj.weight": up}
    if m := re.match(r"^(.+)\.shared_mlp\.(input|output)_linear\.weight$", name):
        if m[2] == "output":
            return {f"{m[1]}.mlp.down_proj.weight": value}
        gate, up = mx.split(value, 2, axis=0)
        return {f"{m[1]}.mlp.gate_proj.weight": gate, f"{m[1]}.mlp.up_proj.weight": up}
    if name.endswith(".conv1d.weight"):
        return {name: value.swapaxes(1, 2)}
    return {name: value}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlx_community_layout_loads_alike(variant: str, tmp_path: Path) -> None:
    d = parity.checkpoint_dir(variant, "v5")
    model = load(d, dtype="float32")
    weights: dict[str, mx.array] = {}
    for name, value in flat_parameters(model.network).items():
        if variant == "granitemoehybrid-moe" and ".shared_mlp." in name:
            weights[name] = value  # mlx-lm keeps the shared MLP of a model with experts
        else:
            weights.update(_mlx_community(name, value))
    assert not any(".input_linear." in k for k in weights if ".shared_mlp." not in k)
    dest = tmp_path / "mlx-community"
    dest.mkdir()
    for f in d.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, dest / f.name)
    mx.save_safetensors(str(dest / "model.safetensors"), weights)  # pyright: ignore[reportUnknownMemberType]
    assert np.array_equal(logits(variant, dest), np.array(model.logits(parity.PROMPT_IDS)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits; 8 bits near the float model.
    Measured max rel error: 4 bits 0.41 (moe) / 0.24 (dense), 8 bits 0.020 / 0.018."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = logits(variant)
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    np.testing.assert_array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    q8 = logits(variant, quantize=8)
    assert _rel(ql, ref) < 0.6
    assert _rel(q8, ref) < 0.05
