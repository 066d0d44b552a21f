"""kimi_linear family checks beyond tests/test_parity.py: layer and MLP kinds and field names
from either spelling, the refusals, the routing (group-limited, the correction bias picks and
does not weigh), prefill over several KDA chunks against transformers' logits, long prefill ==
stepwise decode through the compiled step, compiled == eager greedy, batched == alone, the
prefix cache, the other layouts (transformers 5's in-memory names, stacked experts, an mtp head,
mlx-lm's float and quantized conversions), and the MLX-quantized round trip."""

from __future__ import annotations

import json
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
from mlx_omnia.engine.core.recurrent import ChannelGatedDeltaRule
from mlx_omnia.engine.core.state import RecurrentState
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.kimi_linear.config import (
    KimiLinearConfig,
    layer_types,
    mlp_layer_types,
)
from mlx_omnia.engine.models.kimi_linear.model import KimiLinearMoE, KimiLinearTopkRouter
from tests import hybrid_checks
from tests import moe_family_checks as checks
from tests.fixtures import parity

VARIANTS = ["kimi_linear-moe", "kimi_linear-qlora"]
L, F = "linear_attention", "full_attention"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def config(variant: str, schema: str = "v5") -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, schema) / "config.json")


def logits(path: Path) -> np.ndarray:
    return np.array(load(path, dtype="float32").logits(parity.PROMPT_IDS))


def test_layer_kinds_from_each_spelling() -> None:
    hub = {"linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]}}
    assert layer_types(hub, 4) == (L, L, F, L)  # 1-indexed
    assert layer_types({}, 9) == (L, L, L, L, F, L, L, L, F)  # transformers' default
    assert layer_types({**hub, "layer_types": [F, L]}, 2) == (F, L)  # layer_types wins
    assert mlp_layer_types({}, 3) == ("dense", "sparse", "sparse")  # first_k_dense_replace 1
    assert mlp_layer_types({"first_k_dense_replace": 2}, 3) == ("dense", "dense", "sparse")
    assert mlp_layer_types({"mlp_layer_types": ["sparse", "dense"]}, 2) == ("sparse", "dense")


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_hub_spellings_read_alike(variant: str) -> None:
    """The hub's remote-code config (v4) and transformers 5's (v5) give one config; so do
    transformers' attribute names in place of the names it stores."""
    v5 = KimiLinearConfig.from_dict(config(variant))
    assert KimiLinearConfig.from_dict(config(variant, "v4")) == v5
    stored_as = {
        "model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
        "num_expert_group": "n_group", "num_experts": "num_local_experts",
        "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
    }
    aliased = {stored_as.get(k, k): v for k, v in config(variant).items()}
    assert KimiLinearConfig.from_dict(aliased) == v5


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"layer_types": [L, "mamba", L, F]}, "mamba"),
        ({"layer_types": [L, F]}, "names 2 layers"),
        ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "moe"),
        ({"mlp_layer_types": None, "moe_layer_freq": 2}, "moe_layer_freq"),
        ({"num_expert_group": 3}, "num_expert_group"),
        ({"num_expert_group": 8}, "two or more"),
        ({"num_expert_group": 4, "topk_group": 5}, "topk_group"),
        ({"num_experts_per_token": 9}, "num_experts_per_token"),
        ({"num_expert_group": 4, "topk_group": 1, "num_experts_per_token": 3}, "num_experts_per_token"),
        ({"num_shared_experts": 0}, "num_shared_experts"),
        ({"layer_types": None, "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [4]}},
         "names no kind for layers \\[3\\]"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    family = family_for("kimi_linear")
    family.build(config("kimi_linear-moe"))
    with pytest.raises(UnsupportedModelError, match=match):
        family.build({**config("kimi_linear-moe"), **change})


def test_routing_is_group_limited_and_the_bias_picks_only() -> None:
    cfg = KimiLinearConfig.from_dict({
        **config("kimi_linear-moe"), "num_expert_group": 2, "topk_group": 1,
        "num_experts_per_token": 2, "moe_renormalize": True, "routed_scaling_factor": 2.0,
    })
    router = KimiLinearTopkRouter(cfg)
    router.weight = mx.eye(8, 64)  # logits = the first 8 features
    # group 0 (experts 0-3) holds the best single expert, group 1 the best pair once biased
    router.e_score_correction_bias = mx.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.0])
    x = mx.concatenate([mx.array([[3.0, -3.0, -3.0, -3.0, 0.0, 0.0, 0.0, -3.0]]),
                        mx.zeros((1, 56))], axis=-1)
    weights, ids = router(x)
    assert sorted(np.array(ids[0]).tolist()) == [5, 6]
    np.testing.assert_allclose(np.array(weights[0]), [1.0, 1.0], rtol=1e-6)  # 2 * 0.5 / 1.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_fixtures_routing_matters(variant: str) -> None:
    """Zeroing the correction bias changes the fixture's logits (it picks experts)."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    want = np.array(model.logits(parity.PROMPT_IDS))
    for _, module in named_modules(model.network):
        if isinstance(module, KimiLinearMoE):
            module.gate.e_score_correction_bias = mx.zeros_like(module.gate.e_score_correction_bias)
    assert _rel(np.array(model.logits(parity.PROMPT_IDS)), want) > 1e-2


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [8, 16])
def test_prefill_over_several_chunks_matches_transformers(variant: str, chunk: int) -> None:
    """The 24-token prompt in KDA chunks of 8 (three) and 16 (two, the last padded):
    transformers' logits within the parity tolerance."""
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    rules = [m for _, m in named_modules(model.network) if isinstance(m, ChannelGatedDeltaRule)]
    assert rules
    for rule in rules:
        rule.chunk = chunk
    ref = parity.load_reference(variant)
    got = np.array(model.network(mx.array([parity.PROMPT_IDS], dtype=mx.int32))[0])
    assert _rel(got, ref.logits64) <= max(10 * ref.info["fp32_fp64_spread"], 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kda_layers_carry_state_and_latent_layers_a_cache(variant: str) -> None:
    """A KDA layer's state: the three convolutions' last K - 1 inputs and the delta rule's
    state [heads, head_dim, head_dim]; a latent-attention layer caches one shared head
    (kv_lora_rank 32 + qk_rope 16 keys, the latent as values)."""
    cfg = KimiLinearConfig.from_dict(config(variant))
    net = load(parity.checkpoint_dir(variant, "v5"), dtype="float32").network
    cache = net.make_cache()
    net(mx.array([parity.PROMPT_IDS[:5]], dtype=mx.int32), cache)
    for kind, c in zip(cfg.layer_types, cache, strict=True):
        if kind == L:
            assert isinstance(c, RecurrentState)
            assert c.names == ("q_conv1d", "k_conv1d", "v_conv1d", "recurrent")
            width, k = cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_conv_kernel_dim
            assert c.arrays["q_conv1d"].shape == (1, k - 1, width)
            d = cfg.linear_head_dim
            assert c.arrays["recurrent"].shape == (1, cfg.linear_num_heads, d, d)
        else:
            assert isinstance(c, KVCache) and c.keys is not None and c.values is not None
            assert (c.keys.shape[1], c.keys.shape[3], c.values.shape[3]) == (1, 48, 32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_long_prefill_equals_stepwise_decode(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 tokens (four KDA chunks) prefilled in passes of 96 rows, then 8 tokens through the
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


@pytest.mark.parametrize("variant", VARIANTS)
def test_stacked_layouts_load_alike(variant: str, tmp_path: Path) -> None:
    checks.stacked_layouts_load_alike(variant, tmp_path)


def _with_weights(src: Path, dest: Path, weights: dict[str, mx.array]) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    mx.save_safetensors(str(dest / "model.safetensors"), weights)  # pyright: ignore[reportUnknownMemberType]
    return dest


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_in_memory_names_load_alike(variant: str, tmp_path: Path) -> None:
    """transformers 5's module names (the forget gate's `forget_gate.*`, the three convolutions
    fused as conv1d [3 C, 1, K], the experts fused without .weight), with an mtp head the
    network drops, load to the logits of the hub's names."""
    d = parity.checkpoint_dir(variant, "v5")
    want = logits(d)
    params = flat_parameters(load(d, dtype="float32").network)
    names: dict[str, mx.array] = {"model.mtp.0.norm.weight": mx.ones((64,))}
    convs: dict[str, list[mx.array]] = {}
    for name, value in params.items():
        at, _, leaf = name.rpartition(".self_attn.")
        if leaf.endswith("_conv1d.weight"):
            convs.setdefault(at, []).append(value)  # q, k, v in the network's order
            continue
        if leaf.startswith(("f_a_proj.", "f_b_proj.", "dt_bias", "A_log")):
            name = f"{at}.self_attn.forget_gate.{leaf}"
        names[name.removesuffix(".weight") if ".experts." in name else name] = value
    for at, parts in convs.items():
        assert len(parts) == 3
        names[f"{at}.self_attn.conv1d.weight"] = mx.concatenate(parts, axis=0)
    assert any(".forget_gate." in k for k in names) and any(k.endswith("experts.gate_up_proj") for k in names)
    assert np.array_equal(logits(_with_weights(d, tmp_path / "in-memory", names)), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits, the experts quantized (their
    inputs, 64 and 32 wide, are whole groups of 32); the router stays float32, as transformers
    runs it. 8 bits stay near the float model, as near as these fixtures allow: measured max
    rel error 0.38 (moe) / 0.34 (qlora) at 8 bits, 0.76 / 0.79 at 4 bits in groups of 32. The
    tiny random routers choose between close scores: 8 bits on k_proj alone changes the
    experts of 8 of the moe fixture's 72 (token, sparse layer) pairs and moves the logits 0.37,
    the embedding alone 0.38, the dense MLPs alone under 0.01."""
    d = parity.checkpoint_dir(variant, "v5")
    q = load(d, quantize={"bits": 4, "group_size": 32}, dtype="float32")
    experts = [m for _, m in named_modules(q.network) if isinstance(m, ExpertLinear)]
    assert experts and all(m.quantized for m in experts)
    routers = [m for _, m in named_modules(q.network) if isinstance(m, KimiLinearTopkRouter)]
    assert routers and all(r.weight.dtype == mx.float32 for r in routers)
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    np.testing.assert_array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    ref = logits(d)
    q8 = np.array(load(d, quantize=8, dtype="float32").logits(parity.PROMPT_IDS))
    assert _rel(q8, ref) < 0.5


# -- mlx-lm's layout ----------------------------------------------------------------------------
# mlx-lm 0.32.2 reads the hub's layout but for one thing save_pretrained writes: the dense MLP of
# a layer under `block_sparse_moe` (mlx-lm expects the hub's `mlp` there). Its latent attention
# has no q_lora_rank path, so the kimi_linear-moe fixture (q_proj; rms_norm_eps 1e-6, the latent
# norms' epsilon, which mlx-lm takes from rms_norm_eps) is the one it runs as transformers does.
MLX_LM_VARIANT = "kimi_linear-moe"


def _hub_for_mlx_lm(dest: Path) -> Path:
    src = parity.checkpoint_dir(MLX_LM_VARIANT, "v4")
    cfg = read_json(src / "config.json")
    weights = mx.load(str(src / "model.safetensors"))
    assert isinstance(weights, dict)
    dense = tuple(f"model.layers.{i}." for i in range(int(cfg["first_k_dense_replace"])))
    renamed = {k.replace(".block_sparse_moe.", ".mlp.") if k.startswith(dense) else k: v
               for k, v in weights.items()}
    out = _with_weights(src, dest, renamed)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "q4"])
def test_an_mlx_lm_conversion_runs_as_mlx_lm_runs_it(quantize: bool, tmp_path: Path) -> None:
    """mlx_lm.convert's checkpoint (channels-last q/k/v_conv, switch_mlp, the router's bias
    beside it, kv_b_proj split into embed_q / unembed_out; 4 bits with mlx-lm's 8-bit routers):
    float, our hub-layout logits bit for bit; either, mlx-lm's own logits within 5e-5
    (measured 1.5e-6 float, 1.4e-6 q4) and its greedy tokens."""
    layout = pytest.importorskip("tests.test_mlx_lm_layout")
    src = _hub_for_mlx_lm(tmp_path / "hub")
    converted = layout.mlx_lm_convert_to(src, tmp_path / "mlx", quantize=quantize)
    weights = mx.load(str(next(converted.glob("*.safetensors"))))
    assert isinstance(weights, dict) and any(k.endswith(".embed_q.weight") for k in weights)
    assert any(k.endswith(".mlp.gate.scales") for k in weights) == quantize
    ours = load(converted, dtype="float32")
    got = np.array(ours.logits(parity.PROMPT_IDS))
    if not quantize:
        np.testing.assert_array_equal(got, logits(src))
    want, want_tokens = layout.mlx_lm_logits_and_greedy(converted)
    assert _rel(got, want) <= layout.IMPLEMENTATION_TOL
    assert layout.greedy(ours) == want_tokens
