"""bailing_hybrid family checks beyond tests/test_parity.py: both config spellings read alike,
layer kinds derived as transformers derives them, the refusals (Ling 2.5's lightning attention
among them), prefill over several delta-rule chunks against transformers' logits, long prefill
== stepwise decode through the compiled step, the stacked expert layouts, the MTP layers
dropped, batched == alone, the prefix cache, and the MLX-quantized round trip.

mlx-lm's bailing_hybrid is Ling 2.5 (lightning attention, `attention.query_key_value`), another
network under the same model_type: it cannot convert these checkpoints, and what it converts is
refused here by that tensor's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.recurrent import ChannelGatedDeltaRule
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.bailing_hybrid.config import (
    BailingHybridConfig,
    layer_types,
    mlp_layer_types,
)
from tests import hybrid_checks
from tests import moe_family_checks as checks
from tests.fixtures import parity

VARIANTS = ["bailing_hybrid-moe", "bailing_hybrid-softplus"]
L, F = "linear_attention", "full_attention"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def config(variant: str, schema: str = "v5") -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, schema) / "config.json")


def _copy_with(src: Path, dest: Path, weights: dict[str, mx.array]) -> Path:
    dest.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(str(dest / "model.safetensors"), weights)  # pyright: ignore[reportUnknownMemberType]
    return dest


def _weights(d: Path) -> dict[str, mx.array]:
    weights = mx.load(str(d / "model.safetensors"))
    assert isinstance(weights, dict)
    return weights


def test_layer_kinds() -> None:
    assert layer_types({}, 12) == (L, L, L, L, L, F) * 2  # transformers' default group of 6
    assert layer_types({"layer_group_size": 2}, 4) == (L, F, L, F)
    assert layer_types({"layer_types": [F, L]}, 2) == (F, L)
    assert mlp_layer_types({}, 3) == ("dense", "dense", "sparse")  # first_k_dense_replace 2
    assert mlp_layer_types({"first_k_dense_replace": 0}, 2) == ("sparse", "sparse")


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_config_spellings_read_alike(variant: str) -> None:
    """transformers 5's saved names (num_experts, num_experts_per_token, num_expert_group,
    moe_renormalize, model_max_length, linear_head_dim beside head_dim = qk_rope_head_dim,
    layer_types) and the standard ones a hub config uses read to one config."""
    new, old = config(variant, "v5"), config(variant, "v4")
    assert new["head_dim"] != new["linear_head_dim"] == old["head_dim"]
    assert "num_experts" in new and "num_local_experts" in old
    assert BailingHybridConfig.from_dict(new) == BailingHybridConfig.from_dict(old)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": [L, "mamba", L, F]}, "mamba"),
        ({"layer_types": [L, F]}, "names 2 layers"),
        ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "moe"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"q_lora_rank": 16}, "q_lora_rank"),
        ({"num_expert_group": 8}, "groups"),
        ({"topk_group": 1, "num_experts_per_token": 3}, "topk_group"),
        ({"num_shared_experts": 0}, "num_shared_experts"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "llama3"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                              "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("bailing_hybrid").build({**config("bailing_hybrid-moe"), **change})


def test_ling_2_5_lightning_attention_is_refused() -> None:
    """Ling 2.5 shares the model_type; its linear layers' fused attention.query_key_value
    names what this family does not compute."""
    cfg = config("bailing_hybrid-moe")
    weights = {"model.layers.0.attention.query_key_value.weight": mx.zeros((192, 64))}
    with pytest.raises(UnsupportedModelError, match="lightning attention"):
        family_for("bailing_hybrid").sanitize(weights, cfg)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [8, 16])
def test_prefill_over_several_chunks_matches_transformers(variant: str, chunk: int) -> None:
    """The 24-token prompt in delta-rule chunks of 8 (three) and 16 (two, the last padded):
    transformers' logits within the parity tolerance."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    rules = [m for _, m in model.network.named_modules() if isinstance(m, ChannelGatedDeltaRule)]
    assert rules
    for rule in rules:
        rule.chunk = chunk
    ref = parity.load_reference(variant)
    got = np.array(model.network(mx.array([parity.PROMPT_IDS], dtype=mx.int32))[0]).astype(np.float64)
    assert _rel(got, ref.logits64) <= max(10 * ref.info["fp32_fp64_spread"], 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_long_prefill_equals_stepwise_decode(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 tokens prefilled in passes of 96 rows (each a delta-rule chunk of 64 and a partial
    one), then 8 tokens through the compiled step, against every token fed one at a time
    (eager)."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    hybrid_checks.long_prefill_equals_stepwise(model, monkeypatch)


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
def test_stacked_layouts_load_alike(variant: str, tmp_path: Path) -> None:
    checks.stacked_layouts_load_alike(variant, tmp_path)


def test_the_mtp_layers_are_dropped(tmp_path: Path) -> None:
    """Hub checkpoints append multi-token-prediction layers after the last one
    (model.layers.<num_hidden_layers>.*), which the network has no use for."""
    d = parity.checkpoint_dir("bailing_hybrid-moe", "v5")
    model = load(d, dtype="float32")
    weights = _weights(d)
    weights["model.layers.4.attention.q_proj.weight"] = mx.zeros((96, 64))
    weights["model.layers.4.eh_proj.weight"] = mx.zeros((64, 128))
    again = load(_copy_with(d, tmp_path / "with-mtp", weights), dtype="float32")
    np.testing.assert_array_equal(np.array(again.logits(parity.PROMPT_IDS)),
                                  np.array(model.logits(parity.PROMPT_IDS)))


def test_the_head_is_never_tied() -> None:
    """tie_word_embeddings is set in the softplus fixture, yet transformers ties nothing in
    this family: lm_head is a matrix of its own, saved and loaded."""
    d = parity.checkpoint_dir("bailing_hybrid-softplus", "v5")
    assert config("bailing_hybrid-softplus")["tie_word_embeddings"] is True
    weights = _weights(d)
    assert not np.array_equal(np.array(weights["lm_head.weight"]),
                              np.array(weights["model.word_embeddings.weight"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits; 8 bits near the float model
    row by row. Measured max rel error: 4 bits 0.86 (moe) / 0.92 (softplus), 8 bits 0.45 / 0.11;
    8-bit rows' median 0.03 / 0.01. The moe fixture's 0.45 is one token (13 of 24) whose expert
    choice flips, and the rows after it while the forget gate lets it fade: 8 bits on k_proj,
    v_proj, the MLA's dense or kv_a_proj_with_mqa alone each give the same 0.46, on f_proj alone
    0.002."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    np.testing.assert_array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 1.2
    q8 = np.array(load(d, quantize=8, dtype="float32").logits(parity.PROMPT_IDS))
    assert _rel(q8, ref) < 0.6
    rows = np.abs(q8 - ref).max(axis=-1) / np.abs(ref).max()
    assert float(np.median(rows)) < 0.05
