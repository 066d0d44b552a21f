"""deepseek_v2 family checks beyond tests/test_parity.py: the MLX-quantized round trip, the
stacked expert layouts, the module tree of both attention shapes (q_proj vs the q_lora
bottleneck), the latent cache, dense-first layers, and refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.cache import KVCache, KVFormat, sequence_caches
from mlx_omnia.engine.core.mxcompat import flat_parameters, float_item, set_parameters
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.deepseek_v2.model import (
    DeepseekV2ForCausalLM,
    group_limited_greedy,
    softmax_scale,
)
from tests import moe_family_checks as checks
from tests.fixtures import parity

VARIANTS = ["deepseek_v2-lite", "deepseek_v2-qlora"]


def network(variant: str, schema: str = "v5") -> DeepseekV2ForCausalLM:
    return cast(DeepseekV2ForCausalLM, load(parity.checkpoint_dir(variant, schema)).network)


def config(variant: str) -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, "v5") / "config.json")


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """4-bit: measured max rel error vs float 0.305 (lite) and 0.396 (qlora: 4-bit rounding
    flips some top-3 routing choices of the tiny random model; qwen2_moe measures 0.26-0.31)."""
    assert checks.quantized_round_trip(variant, tmp_path) < 0.5


@pytest.mark.parametrize("variant", VARIANTS)
def test_stacked_layouts_load_alike(variant: str, tmp_path: Path) -> None:
    checks.stacked_layouts_load_alike(variant, tmp_path)


def test_module_trees() -> None:
    lite, qlora = network("deepseek_v2-lite"), network("deepseek_v2-qlora")
    attn = lite.model.layers[0].self_attn
    assert "q_proj" in attn and "q_a_proj" not in attn
    attn = qlora.model.layers[0].self_attn
    assert "q_proj" not in attn and {"q_a_proj", "q_a_layernorm", "q_b_proj"} <= set(attn)
    # The latent norms keep RMSNorm's default epsilon whatever rms_norm_eps says (1e-5 here).
    assert attn.q_a_layernorm.eps == attn.kv_a_layernorm.eps == 1e-6
    assert qlora.model.layers[0].input_layernorm.eps == 1e-5
    kinds = [type(layer.mlp).__name__ for layer in lite.model.layers]
    assert kinds == ["DeepseekV2MLP", "DeepseekV2Moe", "DeepseekV2Moe"]


def test_softmax_scale_has_yarn_mscale() -> None:
    """qk_head_dim^-1/2 * (0.1 * mscale_all_dim * ln(factor) + 1)^2."""
    for variant, all_dim in (("deepseek_v2-lite", 0.707), ("deepseek_v2-qlora", 0.8)):
        cfg = network(variant).config
        want = (0.1 * all_dim * np.log(40.0) + 1) ** 2 / np.sqrt(32)
        assert softmax_scale(cfg) == pytest.approx(want, rel=1e-12)


def test_cache_holds_the_latent() -> None:
    """The cache holds one shared head: keys [latent | k_pe] (kv_lora_rank 64 + qk_rope 16) and
    values the latent (64), 144 numbers a token where the heads' keys and values take 4 * (32 +
    16) = 192 (DeepSeek-V2-Lite: 576 + 512 against 16 * (192 + 128) = 5,120)."""
    net = network("deepseek_v2-lite")
    cache = net.make_cache()
    net(mx.array([parity.PROMPT_IDS[:5]], dtype=mx.int32), cache)
    keys, values = cache[0].keys, cache[0].values
    assert keys is not None and values is not None
    assert keys.shape[1] == values.shape[1] == 1
    assert (keys.shape[3], values.shape[3]) == (80, 64)
    assert mx.array_equal(keys[..., :64], values).item()


def test_group_limited_greedy_against_numpy() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((50, 8)).astype(np.float32)
    weights, ids = group_limited_greedy(mx.array(logits), 3, 4, 2)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    for row in range(50):
        best_groups = np.argsort(-probs[row].reshape(4, 2).max(-1))[:2]
        allowed = np.array([e for g in best_groups for e in (2 * g, 2 * g + 1)], dtype=np.int64)
        want = allowed[np.argsort(-probs[row, allowed])[:3]]
        got = np.array(ids[row], dtype=np.int64)
        assert sorted(got.tolist()) == sorted(want.tolist())
        np.testing.assert_allclose(np.array(weights[row], dtype=np.float32), probs[row, got], rtol=1e-6)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"topk_method": "noaux_tc"}, "noaux_tc"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_shared_experts": None}, "n_shared_experts"),
        ({"topk_method": "group_limited_greedy", "n_group": 3}, "n_group"),
    ],
)
def test_unsupported_variants_are_refused(change: dict[str, Any], match: str) -> None:
    family = family_for("deepseek_v2")
    base = config("deepseek_v2-lite")
    family.build(base)
    with pytest.raises(UnsupportedModelError, match=match):
        family.build({**base, **change})


def test_the_latent_cache_quantizes() -> None:
    """A quantized KV cache holds the latent's codes: with kv_lora_rank 64 and a 32-dim rope key
    (groups of 32 fit both), 8-bit caching moves the next-token distributions of a random model
    by a KL divergence well under 1e-3, stepwise from a 24-token prefill."""
    base = config("deepseek_v2-lite")
    cfg = {**base, "qk_rope_head_dim": 32, "qk_nope_head_dim": 16}
    net = cast(DeepseekV2ForCausalLM, family_for("deepseek_v2").build(cfg))
    set_parameters(net, [
        (name, 0.2 * mx.random.normal(a.shape, key=mx.random.key(i)))
        for i, (name, a) in enumerate(flat_parameters(net).items())
    ])
    ids = mx.array([list(parity.PROMPT_IDS) + list(parity.PROMPT_IDS[:8])], dtype=mx.int32)

    def logits(fmt: KVFormat | None) -> mx.array:
        cache = cast(list[KVCache], sequence_caches(net.make_cache(), fmt))
        out = [net(ids[:, :24], cache)] + [net(ids[:, i : i + 1], cache) for i in range(24, 32)]
        return mx.concatenate(out, axis=1).astype(mx.float32)

    plain = logits(None)
    quantized = logits(KVFormat(8, 32))
    p, q = mx.softmax(plain, -1), mx.softmax(quantized, -1)
    kl = (p * (mx.log(p) - mx.log(q))).sum(-1)
    assert float_item(kl.max()) < 1e-4
    assert not mx.array_equal(plain, quantized).item()  # the codes were read, not the floats
