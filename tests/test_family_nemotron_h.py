"""nemotron_h family checks beyond tests/test_parity.py: layer kinds and field names from every
spelling, the refusals, the routing (group-limited, the correction bias picks and does not
weigh), prefill over several scan chunks against transformers' logits, long prefill == stepwise
decode through the compiled step, a cache only for the attention and Mamba blocks, batched ==
alone, the prefix cache, the expert and conv layouts, the mtp head dropped, and the
MLX-quantized round trip."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.moe import ExpertLinear
from mlx_omnia.engine.core.mxcompat import flat_parameters, named_modules
from mlx_omnia.engine.core.recurrent import SelectiveScan
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.nemotron_h.config import NemotronHConfig, layer_types
from mlx_omnia.engine.models.nemotron_h.model import NemotronHMoE, NemotronHTopkRouter
from tests import hybrid_checks
from tests.fixtures import parity

VARIANTS = ["nemotron_h-hybrid", "nemotron_h-latent"]
M, A, P, E = "linear_attention", "full_attention", "mlp", "moe"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def config(variant: str, schema: str = "v5") -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, schema) / "config.json")


def logits(path: Path) -> np.ndarray:
    return np.array(load(path, dtype="float32").logits(parity.PROMPT_IDS))


def test_layer_kinds_from_each_spelling() -> None:
    assert layer_types({"hybrid_override_pattern": "M-*E"}) == (M, P, A, E)
    assert layer_types({"layers_block_type": [E, M]}) == (E, M)
    assert layer_types({"layer_types": [A, P]}) == (A, P)  # transformers 5's alias


def test_the_hub_spellings_read_alike() -> None:
    v5 = NemotronHConfig.from_dict(config("nemotron_h-latent"))
    assert NemotronHConfig.from_dict(config("nemotron_h-latent", "v4")) == v5
    hub = {k: v for k, v in config("nemotron_h-latent", "v4").items() if k != "head_dim"}
    assert NemotronHConfig.from_dict(hub).head_dim == 16  # attention_head_dim
    for name in ("num_local_experts", "num_experts"):
        renamed = {k: v for k, v in config("nemotron_h-latent").items() if k != "n_routed_experts"}
        assert NemotronHConfig.from_dict({**renamed, name: 8}) == v5


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layers_block_type": [M, "sliding_attention"]}, "sliding_attention"),
        ({"layers_block_type": None, "hybrid_override_pattern": "M*X"}, "letters X"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"residual_in_fp32": True}, "residual_in_fp32"),
        ({"attention_bias": True}, "attention_bias"),
        ({"sliding_window": 256}, "sliding_window"),
        ({"time_step_limit": [0.01, 0.5]}, "time_step_limit"),
        ({"mamba_num_heads": 7}, "n_groups"),
        ({"n_group": 3}, "n_group"),
        ({"n_group": 2, "topk_group": 3}, "topk_group"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("nemotron_h").build({**config("nemotron_h-hybrid"), **change})


def test_routing_is_group_limited_and_the_bias_picks_only() -> None:
    cfg = NemotronHConfig.from_dict({
        **config("nemotron_h-latent"), "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.0,
    })
    router = NemotronHTopkRouter(cfg)
    router.weight = mx.eye(8, 64)  # logits = the first 8 features
    # group 0 (experts 0-3) holds the best single expert, group 1 the best pair once biased
    router.e_score_correction_bias = mx.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.0])
    x = mx.concatenate([mx.array([[3.0, -3.0, -3.0, -3.0, 0.0, 0.0, 0.0, -3.0]]),
                        mx.zeros((1, 56))], axis=-1)
    weights, ids = router(x)
    assert sorted(np.array(ids[0]).tolist()) == [5, 6]
    np.testing.assert_allclose(np.array(weights[0]), [1.0, 1.0], rtol=1e-6)  # 2 * 0.5 / 1.0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [5, 24])
def test_prefill_over_other_scan_chunks_matches_transformers(variant: str, chunk: int) -> None:
    """The 24-token prompt in scan chunks of 5 (the last one padded) and 24 (one):
    transformers' logits within the parity tolerance."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    scans = [m for _, m in named_modules(model.network) if isinstance(m, SelectiveScan)]
    assert scans
    for scan in scans:
        scan.chunk = chunk
    ref = parity.load_reference(variant)
    got = np.array(model.network(mx.array([parity.PROMPT_IDS], dtype=mx.int32))[0])
    assert _rel(got, ref.logits64) <= max(10 * ref.info["fp32_fp64_spread"], 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_attention_and_mamba_blocks_have_a_cache(variant: str) -> None:
    caches = load(parity.checkpoint_dir(variant, "v5"), dtype="float32").network.make_cache()
    kinds = [type(c) for c in caches]
    assert kinds == ([KVCache, RecurrentState] if variant.endswith("latent")
                     else [RecurrentState, KVCache])


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_long_prefill_equals_stepwise_decode(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 tokens prefilled in passes of 96 rows, then 8 tokens through the compiled step,
    against every token fed one at a time (eager)."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    hybrid_checks.long_prefill_equals_stepwise(model, monkeypatch)


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_greedy_generation_compiled_equals_eager(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(parity.checkpoint_dir("nemotron_h-hybrid", "v5"), dtype="float32")
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
    model = load(parity.checkpoint_dir("nemotron_h-hybrid", "v5"), dtype="float32")
    hybrid_checks.prefix_resumes_recurrent_layers(model, tmp_path)


def _with_weights(src: Path, dest: Path, weights: dict[str, mx.array]) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    mx.save_safetensors(str(dest / "model.safetensors"), weights)  # pyright: ignore[reportUnknownMemberType]
    return dest


@pytest.mark.parametrize("variant", VARIANTS)
def test_other_layouts_load_alike(variant: str, tmp_path: Path) -> None:
    """The per-expert checkpoint save_pretrained writes, transformers 5's in-memory names
    (`model.*`, fused experts.up_proj / down_proj without .weight), and mlx-community's
    (switch_mlp.fc1 / fc2, conv1d weights [C, K, 1], an mtp head) load to identical logits."""
    d = parity.checkpoint_dir(variant, "v5")
    want = logits(d)
    params = flat_parameters(load(d, dtype="float32").network)
    fused: dict[str, mx.array] = {}
    switch: dict[str, mx.array] = {"mtp.layers.0.norm.weight": mx.ones((64,))}
    for name, value in params.items():
        renamed = name.replace("backbone.", "model.", 1)
        fused[renamed.removesuffix(".weight") if ".experts." in name else renamed] = value
        if ".experts." in name:
            proj = "fc1" if ".up_proj." in name else "fc2"
            name = name.replace(f"experts.{'up' if proj == 'fc1' else 'down'}_proj",
                                f"switch_mlp.{proj}")
        elif name.endswith("conv1d.weight"):
            value = value.swapaxes(1, 2)
        switch[name] = value
    assert any(k.endswith("experts.up_proj") for k in fused)
    assert any(".switch_mlp.fc1." in k for k in switch)
    for kind, weights in (("fused", fused), ("switch", switch)):
        assert np.array_equal(logits(_with_weights(d, tmp_path / kind, weights)), want), kind


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits, the experts quantized where
    their input width is a multiple of the group (64); 8 bits near the float model."""
    d = parity.checkpoint_dir(variant, "v5")
    q = load(d, quantize=4, dtype="float32")
    experts = [m for _, m in named_modules(q.network) if isinstance(m, ExpertLinear)]
    assert experts and all(m.quantized == (m.input_dims % 64 == 0) for m in experts)
    assert any(m.quantized for m in experts) == variant.endswith("hybrid")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    np.testing.assert_array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    ref = logits(d)
    q8 = np.array(load(d, quantize=8, dtype="float32").logits(parity.PROMPT_IDS))
    assert _rel(q8, ref) < 0.1


def test_the_fixtures_routing_matters() -> None:
    """Zeroing the correction bias changes the hybrid fixture's logits (it picks experts)."""
    model = load(parity.checkpoint_dir("nemotron_h-hybrid", "v5"), dtype="float32")
    want = np.array(model.logits(parity.PROMPT_IDS))
    for _, module in named_modules(model.network):
        if isinstance(module, NemotronHMoE):
            module.gate.e_score_correction_bias = mx.zeros_like(module.gate.e_score_correction_bias)
    assert _rel(np.array(model.logits(parity.PROMPT_IDS)), want) > 1e-2
