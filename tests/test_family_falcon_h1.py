"""falcon_h1 family checks beyond tests/test_parity.py: the refusals (mlx-lm's folded
conversion among them), the gate after the mixer's norm against transformers, the scan over
several chunks, a layer's two caches (keys and values beside a recurrent state) through every
decode path (the compiled step, a batch, the prefix cache), and the MLX-quantized round trip."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.recurrent import SelectiveScan
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.falcon_h1.config import FalconH1Config
from mlx_omnia.engine.models.falcon_h1.model import FalconH1ForCausalLM
from tests import hybrid_checks
from tests.fixtures import parity

VARIANTS = ["falcon_h1-default", "falcon_h1-rmsnorm"]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def config(variant: str) -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, "v5") / "config.json")


def with_config(variant: str, dest: Path, **change: Any) -> Path:
    """A copy of the variant's checkpoint with `change` in its config.json."""
    shutil.copytree(parity.checkpoint_dir(variant, "v5"), dest)
    (dest / "config.json").write_text(json.dumps({**config(variant), **change}))
    return dest


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"time_step_limit": [0.001, 0.1]}, "time_step_limit"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mamba_d_head": 32}, "mamba_d_head"),
        ({"mamba_n_heads": 12}, "does not divide"),
        ({"mamba_n_groups": 3}, "mamba_n_groups"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"key_multiplier": None}, "key_multiplier"),
        ({"ssm_multipliers": [1.0, 1.0, 1.0]}, "ssm_multipliers"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "dynamic"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("falcon_h1").build({**config("falcon_h1-default"), **change})


def test_defaults_as_transformers_fills_them() -> None:
    """mamba_d_ssm null is expand * hidden, mamba_d_head "auto" divides it by the heads, absent
    multipliers are 1 and an absent ssm_multipliers is five ones."""
    base = {k: v for k, v in config("falcon_h1-default").items()
            if not k.endswith("multiplier") and not k.endswith("multipliers")}
    cfg = FalconH1Config.from_dict({**base, "mamba_d_ssm": None, "mamba_d_head": "auto"})
    assert (cfg.mamba_d_ssm, cfg.mamba_d_head) == (128, 16)
    assert cfg.ssm_multipliers == (1.0,) * 5 and cfg.mlp_multipliers == (1.0, 1.0)
    assert cfg.key_multiplier == cfg.embedding_multiplier == cfg.lm_head_multiplier == 1.0


def test_infinity_in_either_spelling() -> None:
    base = config("falcon_h1-default")
    family_for("falcon_h1").build({**base, "time_step_limit": [0.0, math.inf]})  # older configs
    family_for("falcon_h1").build({**base, "time_step_limit": [0.0, {"__float__": "Infinity"}]})


def test_an_mlx_lm_conversion_is_refused(tmp_path: Path) -> None:
    """mlx-lm folds the multipliers into the weights and stores conv1d [C, K, 1]: run as its
    config says, every multiplier would apply twice."""
    dest = with_config("falcon_h1-default", tmp_path / "mlx-lm")
    weights = mx.load(str(dest / "model.safetensors"))
    assert isinstance(weights, dict)
    weights = {k: v.swapaxes(1, 2) if k.endswith("conv1d.weight") else v for k, v in weights.items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights)  # pyright: ignore[reportUnknownMemberType]
    with pytest.raises(UnsupportedModelError, match="mlx-lm"):
        load(dest, dtype="float32")


def test_a_layer_caches_keys_and_values_beside_its_mixer_state() -> None:
    """Two cache entries a layer, side by side: what the compiled step, a batch's rows and the
    prefix cache take as two layers of their own kinds."""
    made = FalconH1ForCausalLM(FalconH1Config.from_dict(config("falcon_h1-default"))).make_cache()
    assert len(made) == 2 * 3
    assert all(type(c) is KVCache for c in made[0::2])
    assert all(isinstance(c, RecurrentState) and c.names == ("conv", "ssm") for c in made[1::2])


def test_the_gate_after_the_norm_matches_transformers(tmp_path: Path) -> None:
    """mamba_norm_before_gate true (transformers' default; the fixtures gate first, as released
    checkpoints do): norm, weight, then silu(z), against transformers on the same weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    dest = with_config("falcon_h1-rmsnorm", tmp_path / "after", mamba_norm_before_gate=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32)
    with torch.no_grad():
        want = reference(torch.tensor([parity.PROMPT_IDS]), use_cache=False).logits[0].double().numpy()
    got = np.array(load(dest, dtype="float32").logits(parity.PROMPT_IDS))
    before = parity.load_reference("falcon_h1-rmsnorm").logits64
    assert _rel(want, before) > 1e-3  # the order matters on these weights
    assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [8, 10])
def test_prefill_over_several_scan_chunks_matches_transformers(variant: str, chunk: int) -> None:
    """The 24-token prompt in scan chunks of 8 (three, as transformers' mamba_chunk_size) and
    10 (three, the last padded): transformers' logits within the parity tolerance."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    scans = [m for _, m in model.network.named_modules() if isinstance(m, SelectiveScan)]
    assert len(scans) == 3
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


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_greedy_generation_compiled_equals_eager(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(parity.checkpoint_dir("falcon_h1-rmsnorm", "v5"), dtype="float32")
    monkeypatch.setenv("OMNIA_COMPILE", compiled)
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
    assert _rel(q8, ref) < 0.1
