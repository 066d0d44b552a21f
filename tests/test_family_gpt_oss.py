"""gpt_oss family checks beyond tests/test_parity.py: the MXFP4 experts as shipped (kept
quantized, equal to a numpy dequantization of the published format), the MLX-quantized round
trips, the gpt-oss expert arithmetic against numpy, what each gpt-oss feature changes on the
fixture (so parity would catch its loss), the harmony chat template and refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from mlx_omnia import load
from mlx_omnia.engine.core.moe import DownCombine, GateUp
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.models.gpt_oss.model import GptOssForCausalLM
from tests import moe_family_checks as checks
from tests.fixtures import parity
from tests.fixtures.generate_gpt_oss import mxfp4_decode

DENSE, MXFP4 = "gpt_oss-yarn", "gpt_oss-mxfp4"


def deinterleave(x: np.ndarray) -> np.ndarray:
    """Rows gate, up, gate, up, ... -> all gates, then all ups (axis 1)."""
    return np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)


def test_mxfp4_experts_stay_quantized_and_equal_numpy_dequantization() -> None:
    d = parity.checkpoint_dir(MXFP4, "v5")
    shipped = load_file(str(d / "model.safetensors"))
    net = cast(GptOssForCausalLM, load(d, dtype="float32").network)
    for i, layer in enumerate(net.model.layers):
        prefix = f"model.layers.{i}.mlp.experts"
        for proj, module in (("gate_up_proj", layer.mlp.experts.gate_up_proj),
                             ("down_proj", layer.mlp.experts.down_proj)):
            assert (module.mode, module.bits, module.group_size) == ("mxfp4", 4, 32)
            assert module.weight.dtype == mx.uint32 and module.scales.dtype == mx.uint8
            assert "biases" not in module
            ref = mxfp4_decode(shipped[f"{prefix}.{proj}_blocks"], shipped[f"{prefix}.{proj}_scales"])
            if proj == "gate_up_proj":
                ref = deinterleave(ref)
            ours = mx.dequantize(
                module.weight, module.scales, None, group_size=32, bits=4, mode="mxfp4",
                dtype=mx.float32,
            )
            assert np.array_equal(np.array(ours), ref.astype(np.float32)), f"{prefix}.{proj}"


def test_dense_and_mxfp4_fixtures_share_the_rest() -> None:
    """The two variants differ only in the experts (rounded to MXFP4): same seed, same shapes."""
    a = load_file(str(parity.checkpoint_dir(DENSE, "v5") / "model.safetensors"))
    b = load_file(str(parity.checkpoint_dir(MXFP4, "v5") / "model.safetensors"))
    shared = [k for k in a if k in b]
    assert len(shared) == len(a) - 6 and all(np.array_equal(a[k], b[k]) for k in shared)


def test_quantized_round_trip(tmp_path: Path) -> None:
    """4-bit affine from the dense checkpoint: measured max rel error vs float 0.419 (uniform
    random weights, routing flips; qwen3_moe measures 0.238)."""
    assert checks.quantized_round_trip(DENSE, tmp_path) < 0.6


@pytest.mark.parametrize("quantize", [None, 4])
def test_mxfp4_round_trip(tmp_path: Path, quantize: int | None) -> None:
    """The MXFP4 checkpoint (optionally with the other layers 4-bit) saves and reloads to
    bit-identical logits, the experts still MXFP4."""
    q = load(parity.checkpoint_dir(MXFP4, "v5"), dtype="float32", quantize=quantize)
    want = checks.logits(q)
    again = load(q.save(tmp_path / "saved"), dtype="float32")
    assert all(m.mode == "mxfp4" for m in checks.experts(again).values())
    assert np.array_equal(checks.logits(again), want)


def test_expert_declarations_against_numpy() -> None:
    """GateUp (bias, gpt_oss_swiglu) and DownCombine (bias), dense and MXFP4, against numpy."""
    rng = np.random.default_rng(0)
    n, inp, hidden, out, k, alpha, limit = 4, 64, 32, 64, 2, 1.702, 0.5
    x = rng.standard_normal((3, 5, inp)).astype(np.float32)
    ids = np.stack([rng.permutation(n)[:k] for _ in range(15)]).reshape(3, 5, k).astype(np.uint32)
    route = rng.random((3, 5, k)).astype(np.float32)
    gu_w = (rng.standard_normal((n, 2 * hidden, inp)) * 0.1).astype(np.float32)
    gu_b = rng.standard_normal((n, 2 * hidden)).astype(np.float32) * 0.3
    dn_w = (rng.standard_normal((n, out, hidden)) * 0.1).astype(np.float32)
    dn_b = rng.standard_normal((n, out)).astype(np.float32)
    for mode in ("dense", "mxfp4"):
        gu = GateUp(n, inp, hidden, bias=True, activation="gpt_oss_swiglu", alpha=alpha, limit=limit)
        dn = DownCombine(n, hidden, out, bias=True)
        gu.weight, gu.bias, dn.weight, dn.bias = map(mx.array, (gu_w, gu_b, dn_w, dn_b))
        ws = [gu_w, dn_w]
        if mode == "mxfp4":
            for j, m in enumerate((gu, dn)):
                m.quantize_weights(bits=4, group_size=32, mode="mxfp4")
                ws[j] = np.array(mx.dequantize(m.weight, m.scales, None, group_size=32, bits=4,
                                               mode="mxfp4", dtype=mx.float32))
        for m in (gu, dn):
            m.bind()
        h = gu(mx.array(x), mx.array(ids))
        y = np.einsum("bti,btkoi->btko", x, ws[0][ids]) + gu_b[ids]
        g, u = np.minimum(y[..., :hidden], limit), np.clip(y[..., hidden:], -limit, limit)
        want_h = (u + 1) * g / (1 + np.exp(-alpha * g))
        assert np.abs(np.array(h) - want_h).max() < 1e-5, mode
        z = dn(h, mx.array(ids), mx.array(route))
        want_z = ((np.einsum("btki,btkoi->btko", want_h, ws[1][ids]) + dn_b[ids]) * route[..., None]).sum(-2)
        assert np.abs(np.array(z) - want_z).max() < 1e-4, mode


def _variant_with(tmp_path: Path, name: str, change: dict[str, Any]) -> Path:
    src = parity.checkpoint_dir(DENSE, "v5")
    dest = tmp_path / name
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(change)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("no-clamp", {"swiglu_limit": 7.0}),
        ("no-window", {"layer_types": ["full_attention"] * 3}),
        ("plain-rope", {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}),
        ("truncated-yarn", {"rope_parameters": {
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": True}}),
    ],
)
def test_each_feature_bites(tmp_path: Path, name: str, change: dict[str, Any]) -> None:
    """Dropping a gpt-oss feature moves the fixture's logits far past the parity tolerance
    (1e-5): the clamp, the sliding window, yarn, yarn's truncate=false."""
    ref = parity.load_reference(DENSE)
    got = checks.logits(load(_variant_with(tmp_path, name, change), dtype="float32"))
    assert checks.rel(got, ref.logits64) > 1e-4


def test_sinks_bite() -> None:
    ref = parity.load_reference(DENSE)
    m = load(parity.checkpoint_dir(DENSE, "v5"), dtype="float32")
    net = cast(GptOssForCausalLM, m.network)
    for layer in net.model.layers:
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e9)
    assert checks.rel(checks.logits(m), ref.logits64) > 1e-4


def test_harmony_template_matches_transformers() -> None:
    """Turns the parity chats do not exercise: a last assistant turn with thinking (no
    generation prompt: <|return|> and the analysis channel), a tool call and its result."""
    from transformers import AutoTokenizer

    d = parity.checkpoint_dir(DENSE, "v5")
    ours = load(d, dtype="float32").tokenizer
    theirs: Any = AutoTokenizer.from_pretrained(str(d))
    chats: list[tuple[list[dict[str, Any]], bool]] = [
        ([{"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!", "thinking": "Greet back."}], False),
        ([{"role": "developer", "content": "Be brief."},
          {"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"type": "function", "function": {"name": "get_weather",
                                                "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "name": "get_weather", "content": "{\"sunny\": true}"}], True),
    ]
    assert ours.chat_template is not None
    for messages, prompt in chats:
        want = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        assert ours.chat_template.render(messages, add_generation_prompt=prompt) == want
        assert want.startswith("<|start|>system<|message|>")
    assert "<|channel|>analysis<|message|>Greet back.<|end|>" in theirs.apply_chat_template(
        chats[0][0], add_generation_prompt=False, tokenize=False)


def test_refusals() -> None:
    config = read_json(parity.checkpoint_dir(MXFP4, "v4") / "config.json")
    family = family_for("gpt_oss")
    family.build(config)
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        family.build({**config, "layer_types": ["chunked_attention"] * 3})
    with pytest.raises(UnsupportedModelError, match="fp8"):
        family.build({**config, "quantization_config": {"quant_method": "fp8"}})
