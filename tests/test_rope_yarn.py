"""The yarn rope kind of core/rope.py against a numpy computation of the published formula
(YaRN, Peng et al. 2023, "NTK-by-parts" interpolation with the mscale attention factor, as
DeepSeek-V2, Qwen and gpt-oss configs parametrize it), against transformers' own
_compute_yarn_parameters, and the declared Rope applied to features (interleaved and
rotate-half layouts, with the attention factor)."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.core.rope import build_rope, rope_parameters, yarn_periods

CASES: dict[str, tuple[int, dict[str, Any]]] = {
    # DeepSeek-V2-Lite: qk_rope_head_dim 64, mscale == mscale_all_dim (attention factor 1).
    "deepseek-v2-lite": (64, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707,
    }),
    # Qwen2.5 / Qwen3 long context: no mscale, defaults for beta_fast/beta_slow.
    "qwen": (128, {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }),
    # gpt-oss: truncate false (an unrounded correction range).
    "gpt-oss": (64, {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False,
    }),
    # mscale != mscale_all_dim, and an explicit attention_factor overriding both.
    "mscale-ratio": (16, {
        "rope_type": "yarn", "rope_theta": 1000.0, "factor": 40.0,
        "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 0.8,
    }),
    "explicit-factor": (32, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 2048, "attention_factor": 1.25,
    }),
}


def published(dims: int, p: dict[str, Any]) -> tuple[np.ndarray, float]:
    """inv_freq [dims/2] and the attention factor, straight from the formula:
    r(d) = dims * ln(L / (2 pi * rotations)) / (2 ln base)   (the dim where a pair turns
    `rotations` times over the pretraining length L), ramp gamma_i = clip((i - lo) / (hi - lo))
    with lo = floor r(beta_fast), hi = ceil r(beta_slow) clamped to [0, dims - 1],
    inv_i = theta_i * (1 - gamma_i) + theta_i / s * gamma_i,   theta_i = base^(-2i/dims),
    attention = mscale(s, mscale) / mscale(s, mscale_all_dim), or mscale(s) = 0.1 ln s + 1."""
    base, s, length = p["rope_theta"], p["factor"], p["original_max_position_embeddings"]
    fast, slow = p.get("beta_fast", 32), p.get("beta_slow", 1)
    r_fast = dims * math.log(length / (2 * math.pi * fast)) / (2 * math.log(base))
    r_slow = dims * math.log(length / (2 * math.pi * slow)) / (2 * math.log(base))
    if p.get("truncate", True):
        r_fast, r_slow = math.floor(r_fast), math.ceil(r_slow)
    lo, hi = max(r_fast, 0), min(r_slow, dims - 1)
    i = np.arange(dims // 2)
    gamma = np.clip((i - lo) / ((hi - lo) or 0.001), 0, 1)
    theta = base ** (-2.0 * i / dims)
    inv = theta * (1 - gamma) + theta / s * gamma

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1

    if "attention_factor" in p:
        attention = p["attention_factor"]
    elif p.get("mscale") and p.get("mscale_all_dim"):
        attention = m(s, p["mscale"]) / m(s, p["mscale_all_dim"])
    else:
        attention = m(s)
    return inv, attention


@pytest.mark.parametrize("case", CASES)
def test_periods_follow_the_published_formula(case: str) -> None:
    dims, params = CASES[case]
    periods, attention = yarn_periods(dims, params["rope_theta"], params)
    inv, want = published(dims, params)
    np.testing.assert_allclose(1.0 / periods, inv, rtol=1e-12)
    assert attention == pytest.approx(want, rel=1e-12)
    # Both ends of the blend occur with these parameters: kept and fully interpolated pairs.
    theta = params["rope_theta"] ** (-np.arange(0, dims, 2) / dims)
    assert np.isclose(1.0 / periods[0], theta[0]) and not np.isclose(1.0 / periods[-1], theta[-1])


@pytest.mark.parametrize("case", CASES)
def test_periods_match_transformers(case: str) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dims, params = CASES[case]
    config = transformers.LlamaConfig(
        hidden_size=dims * 4, num_attention_heads=4, head_dim=dims,
        max_position_embeddings=int(params["original_max_position_embeddings"] * params["factor"]),
        rope_parameters=dict(params),
    )
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    periods, ours = yarn_periods(dims, params["rope_theta"], params)
    np.testing.assert_allclose(1.0 / periods, inv.double().numpy(), rtol=2e-6)  # torch: float32
    assert ours == pytest.approx(attention, rel=1e-12)


def test_config_schemas_read_alike() -> None:
    """transformers 4 / hub remote-code configs ({"type": "yarn"} in rope_scaling) and
    transformers 5 rope_parameters give the same parameters."""
    dims, params = CASES["deepseek-v2-lite"]
    v5 = rope_parameters({"rope_parameters": params})
    old = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    v4 = rope_parameters({"rope_theta": params["rope_theta"], "rope_scaling": {**old, "type": "yarn"}})
    assert v4["rope_type"] == v5["rope_type"] == "yarn"
    assert yarn_periods(dims, 10000.0, v4)[1] == yarn_periods(dims, 10000.0, v5)[1]
    np.testing.assert_array_equal(yarn_periods(dims, 10000.0, v4)[0], yarn_periods(dims, 10000.0, v5)[0])


@pytest.mark.parametrize("traditional", [True, False])
def test_rope_rotates_with_yarn_frequencies(traditional: bool) -> None:
    """The declared Rope rotates pair i at position t by t * inv_i and scales by the attention
    factor: interleaved pairs (x[2i], x[2i+1]) when traditional, else (x[i], x[i + dims/2])."""
    dims, params = CASES["mscale-ratio"]
    inv, attention = published(dims, params)
    rope = build_rope(dims, params, traditional=traditional)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 5, dims)).astype(np.float32)
    offset = 7
    got = np.array(rope(mx.array(x), offset), dtype=np.float32)
    angle = (offset + np.arange(5))[:, None] * inv[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : dims // 2], x[..., dims // 2 :]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    want = np.empty_like(x, dtype=np.float64)
    if traditional:
        want[..., 0::2], want[..., 1::2] = ra, rb
    else:
        want[..., : dims // 2], want[..., dims // 2 :] = ra, rb
    np.testing.assert_allclose(got, want * attention, rtol=1e-4, atol=1e-5)


def test_missing_lengths_are_refused() -> None:
    """Without original_max_position_embeddings (or factor) the ramp is undefined: refused by
    name, never guessed (a family fills it in from max_position_embeddings as transformers
    does, or refuses yarn itself)."""
    from mlx_omnia.engine.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings"):
        build_rope(32, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0})
    with pytest.raises(UnsupportedModelError, match="factor"):
        build_rope(32, {"rope_type": "yarn", "rope_theta": 1e6, "original_max_position_embeddings": 4096})


def test_attention_factor_scales_only_the_rotated_features() -> None:
    import mlx.core as mx
    import numpy as np

    from mlx_omnia.engine.core.layers import Rope

    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 3, 8)).astype(np.float32))
    partial = Rope(4, base=10000.0, attention_factor=1.5)
    plain = Rope(4, base=10000.0)
    got, ref = np.array(partial(x, 0)), np.array(plain(x, 0))
    assert np.allclose(got[..., :4], 1.5 * ref[..., :4], atol=1e-6)
    assert np.array_equal(got[..., 4:], np.array(x)[..., 4:])
