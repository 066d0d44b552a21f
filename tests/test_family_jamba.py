"""jamba family checks beyond tests/test_parity.py: layer and MLP kinds from the periods and
offsets, either spelling of the expert count, the refusals, prefill over several scan chunks
against transformers' logits, a long prefill == stepwise decode through the compiled step,
compiled == eager, batched == alone, the prefix cache resuming Mamba and attention layers, the
stacked expert layouts, and the MLX-quantized round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.mxcompat import named_modules
from mlx_omnia.engine.core.recurrent import DiagonalSelectiveScan
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.jamba.config import JambaConfig, layers_block_type
from tests import hybrid_checks
from tests import moe_family_checks as checks
from tests.fixtures import parity

VARIANTS = ["jamba-moe", "jamba-tied"]
A, M = "attention", "mamba"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def config(variant: str) -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, "v5") / "config.json")


def test_layer_and_mlp_kinds() -> None:
    assert layers_block_type({}, 9) == (M, M, M, M, A, M, M, M, M)  # period 8, offset 4
    assert layers_block_type({"attn_layer_period": 2, "attn_layer_offset": 1}, 4) == (M, A, M, A)
    moe = JambaConfig.from_dict(config("jamba-moe"))
    assert moe.layers_block_type == (M, M, A, M)
    assert moe.layers_sparse == (False, True, False, True)
    assert moe.mamba_dt_rank == 4  # "auto": ceil(64 / 16)
    tied = JambaConfig.from_dict(config("jamba-tied"))
    assert tied.layers_block_type == (A, M, A, M)
    assert tied.layers_sparse == (True, False, True, False)
    dense = JambaConfig.from_dict({**config("jamba-moe"), "num_experts": 1})
    assert dense.layers_sparse == (False,) * 4  # one expert: every MLP dense, as transformers


def test_either_spelling_of_the_expert_count_and_layer_types() -> None:
    base = config("jamba-moe")
    renamed = {k: v for k, v in base.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert JambaConfig.from_dict(renamed) == JambaConfig.from_dict(base)
    kinds = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert JambaConfig.from_dict({**base, "layer_types": kinds}) == JambaConfig.from_dict(base)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": 16}, "sliding_window"),
        ({"attn_layer_offset": 4}, "attn_layer_offset"),
        ({"expert_layer_offset": 2}, "expert_layer_offset"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("jamba").build({**config("jamba-moe"), **change})


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [8, 10])
def test_prefill_over_several_scan_chunks_matches_transformers(variant: str, chunk: int) -> None:
    """The 24-token prompt in scan chunks of 8 (three) and 10 (three, the last of 4):
    transformers' logits within the parity tolerance."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    scans = [m for _, m in named_modules(model.network) if isinstance(m, DiagonalSelectiveScan)]
    assert len(scans) == {"jamba-moe": 3, "jamba-tied": 2}[variant]  # the Mamba layers
    for scan in scans:
        scan.chunk = chunk
    ref = parity.load_reference(variant)
    got = checks.logits(model).astype(np.float64)
    assert _rel(got, ref.logits64) <= max(10 * ref.info["fp32_fp64_spread"], 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_long_prefill_equals_stepwise_decode(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 tokens (scan chunks of 128 over prefill passes of 96 rows) prefilled, then 8 tokens
    through the compiled step, against every token fed one at a time (eager)."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    hybrid_checks.long_prefill_equals_stepwise(model, monkeypatch, prompt=300)


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_greedy_generation_compiled_equals_eager(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(parity.checkpoint_dir("jamba-moe", "v5"), dtype="float32")
    monkeypatch.setenv("OMNIA_COMPILE", compiled)
    got = model.generate("Tell me a story", hybrid_checks.options(24)).token_ids
    monkeypatch.setenv("OMNIA_COMPILE", "0")
    assert got == model.generate("Tell me a story", hybrid_checks.options(24)).token_ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_greedy_equals_each_alone(variant: str) -> None:
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    assert model.signature.batched
    hybrid_checks.batched_equals_alone(model)


def test_a_resent_conversation_resumes_from_the_prefix_cache(tmp_path: Path) -> None:
    model = load(parity.checkpoint_dir("jamba-moe", "v5"), dtype="float32")
    hybrid_checks.prefix_resumes_recurrent_layers(model, tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stacked_layouts_load_alike(variant: str, tmp_path: Path) -> None:
    checks.stacked_layouts_load_alike(variant, tmp_path, block="feed_forward", fused_block="feed_forward")


def test_convolutions_in_mlx_layout_load_alike(tmp_path: Path) -> None:
    """mlx-community checkpoints store conv1d.weight as MLX's Conv1d, [channels, kernel, 1]."""
    d = parity.checkpoint_dir("jamba-moe", "v5")
    weights = mx.load(str(d / "model.safetensors"))
    assert isinstance(weights, dict)
    moved = {k: v.swapaxes(1, 2) if k.endswith("conv1d.weight") else v for k, v in weights.items()}
    assert moved["model.layers.0.mamba.conv1d.weight"].shape == (128, 4, 1)
    dest = tmp_path / "mlx-layout"
    dest.mkdir()
    for f in d.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(str(dest / "model.safetensors"), moved)  # pyright: ignore[reportUnknownMemberType]
    assert np.array_equal(checks.logits(load(dest, dtype="float32")), checks.logits(load(d, dtype="float32")))


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits, every expert matrix 4-bit;
    8 bits near the float model. Measured max rel error: 4 bits 0.42 (moe) / 0.26 (tied),
    8 bits 0.26 / 0.012: jamba-moe's 8-bit figure is one routing flip (layer 1, the last
    token); its other rows are within 3.3 %."""
    error4 = checks.quantized_round_trip(variant, tmp_path)
    d = parity.checkpoint_dir(variant, "v5")
    ref = checks.logits(load(d, dtype="float32"))
    q8 = checks.logits(load(d, quantize=8, dtype="float32"))
    assert error4 < 1.0
    assert _rel(q8, ref) < 0.3
