"""Quantizing at load, saving in the MLX layout, and loading MLX-format quantized checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from mlx_omnia import CheckpointError, InvalidOptionsError, Model, load
from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.layers import Embedding, Linear
from mlx_omnia.engine.core.mxcompat import named_modules
from tests.fixtures.tiny import tiny_weights

PROMPT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"


def _logits(model: Model) -> np.ndarray:
    return np.array(model.logits(model.encode(PROMPT)))


def _quantized(model: Model) -> dict[str, tuple[int | None, int | None]]:
    return {
        name: (m.bits, m.group_size)
        for name, m in named_modules(model.network)
        if isinstance(m, Linear | Embedding)
    }


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


@pytest.fixture(scope="module")
def float_logits(tiny_llama_dir: Path) -> np.ndarray:
    return _logits(load(tiny_llama_dir))


@pytest.mark.parametrize(
    ("quantize", "bits", "group_size", "min_corr"),
    [
        # Measured on the tiny model: 4-bit/64 0.955, 8-bit/64 0.9998, 8-bit/32 0.9999.
        (4, 4, 64, 0.93),
        (8, 8, 64, 0.999),
        ({"bits": 8, "group_size": 32}, 8, 32, 0.999),
        ({"bits": 4, "group_size": 32}, 4, 32, 0.94),
    ],
)
def test_quantize_at_load(
    tiny_llama_dir: Path,
    float_logits: np.ndarray,
    quantize: int | dict[str, int],
    bits: int,
    group_size: int,
    min_corr: float,
) -> None:
    model = load(tiny_llama_dir, quantize=quantize)
    layers = _quantized(model)
    assert layers, "no Linear/Embedding declarations found"
    assert set(layers.values()) == {(bits, group_size)}
    assert set(model.bindings().values()) == {"core"}
    linear = model.network.model.layers[0].mlp.down_proj
    assert linear.weight.dtype == mx.uint32
    assert linear.weight.shape == (64, 128 * bits // 32)
    logits = _logits(model)
    assert logits.shape == float_logits.shape
    assert _corr(logits, float_logits) > min_corr
    if bits == 8:
        assert np.abs(logits - float_logits).max() < 0.1
        assert (logits.argmax(-1) == float_logits.argmax(-1)).mean() > 0.95


@pytest.mark.parametrize(
    "quantize", [7, 1, 16, {"bits": 4, "group_size": 48}, {"bits": 3, "group_size": 16}]
)
def test_quantize_rejects_unsupported_settings(tiny_llama_dir: Path, quantize: object) -> None:
    with pytest.raises(InvalidOptionsError, match="bits must be"):
        load(tiny_llama_dir, quantize=quantize)  # type: ignore[arg-type]


def test_save_float_round_trip(
    tiny_llama_dir: Path, tmp_path: Path, float_logits: np.ndarray
) -> None:
    model = load(tiny_llama_dir)
    out = model.save(tmp_path / "saved")
    assert out == tmp_path / "saved"
    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert (out / "tokenizer.json").read_bytes() == (tiny_llama_dir / "tokenizer.json").read_bytes()
    again = load(out)
    assert np.array_equal(_logits(again), float_logits)
    assert again.encode(PROMPT) == model.encode(PROMPT)


def test_save_quantized_round_trip_is_bit_identical(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = load(tiny_llama_dir, quantize=4)
    out = model.save(tmp_path / "q4")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4}
    assert config["quantization_config"] == config["quantization"]
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == np.uint32
    assert "model.layers.0.self_attn.q_proj.scales" in tensors
    assert "model.embed_tokens.biases" in tensors
    again = load(out)
    assert _quantized(again) == _quantized(model)
    assert np.array_equal(_logits(again), _logits(model))
    # Quantizing an already-quantized checkpoint again leaves it as it is.
    assert np.array_equal(_logits(load(out, quantize=8)), _logits(model))


def test_save_bfloat16_records_dtype(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = load(tiny_llama_dir, dtype="bfloat16", quantize=8)
    out = model.save(tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = load(out, dtype="bfloat16")
    assert np.array_equal(_logits(again), _logits(model))


def test_save_mixed_bits_per_layer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = load(tiny_llama_dir, quantize=4)
    # An mlx-community style mix: one layer at 8 bits, the LM head left dense.
    down = model.network.model.layers[0].mlp.down_proj
    down.dequantize_weights()
    down.quantize_weights(bits=8, group_size=32)
    model.network.lm_head.dequantize_weights()
    bind_layers(model.network)
    out = model.save(tmp_path / "mixed")
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization == {
        "group_size": 64,
        "bits": 4,
        "lm_head": False,
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
    }
    again = load(out)
    layers = _quantized(again)
    assert layers["model.layers.0.mlp.down_proj"] == (8, 32)
    assert layers["lm_head"] == (None, None)
    assert layers["model.layers.1.mlp.down_proj"] == (4, 64)
    assert layers["model.embed_tokens"] == (4, 64)
    assert np.array_equal(_logits(again), _logits(model))


def _write_mlx_checkpoint(src: Path, dst: Path, plan: dict[str, tuple[int, int] | None]) -> dict:
    """Copy `src`'s config/tokenizer and write its weights quantized with mx.quantize per
    `plan` (module path -> (bits, group_size); absent or None = dense), as mlx-lm lays them out."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    weights = {k: mx.array(v) for k, v in tiny_weights(config).items()}
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        spec = plan.get(module)
        if spec is None or not name.endswith(".weight"):
            out[name] = w
            continue
        bits, group_size = spec
        q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        out[f"{module}.weight"], out[f"{module}.scales"], out[f"{module}.biases"] = (
            q,
            scales,
            biases,
        )
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
    return config


def test_load_mlx_checkpoint_with_per_layer_overrides(tiny_llama_dir: Path, tmp_path: Path) -> None:
    plan: dict[str, tuple[int, int] | None] = {
        f"model.layers.{i}.{part}": (4, 64)
        for i in range(2)
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    plan["model.layers.1.mlp.down_proj"] = (8, 64)
    plan["model.layers.0.self_attn.v_proj"] = (6, 32)
    plan["model.embed_tokens"] = (4, 64)
    dst = tmp_path / "mlx"
    config = _write_mlx_checkpoint(tiny_llama_dir, dst, plan)
    config["quantization"] = {
        "group_size": 64,
        "bits": 4,
        "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8},
        "model.layers.0.self_attn.v_proj": {"group_size": 32, "bits": 6},
        "lm_head": False,
    }
    (dst / "config.json").write_text(json.dumps(config))
    model = load(dst)
    layers = _quantized(model)
    assert layers["model.layers.1.mlp.down_proj"] == (8, 64)
    assert layers["model.layers.0.self_attn.v_proj"] == (6, 32)
    assert layers["model.layers.0.mlp.down_proj"] == (4, 64)
    assert layers["model.embed_tokens"] == (4, 64)
    assert layers["lm_head"] == (None, None)
    # The same arithmetic as quantizing the float model in memory with the same plan.
    reference = load(tiny_llama_dir)
    for name, module in named_modules(reference.network):
        if isinstance(module, Linear | Embedding) and (spec := plan.get(name)) is not None:
            module.quantize_weights(bits=spec[0], group_size=spec[1])
    bind_layers(reference.network)
    assert np.array_equal(_logits(model), _logits(reference))
    # HF-style quantization_config (mlx-lm writes both) is read the same way.
    del config["quantization"]
    config["quantization_config"] = {
        "group_size": 64,
        "bits": 4,
        "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8},
        "model.layers.0.self_attn.v_proj": {"group_size": 32, "bits": 6},
    }
    (dst / "config.json").write_text(json.dumps(config))
    assert _quantized(load(dst))["model.layers.0.self_attn.v_proj"] == (6, 32)


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"group_size": 64, "bits": 8}, "config says 8-bit groups of 64"),
        ({"group_size": 32, "bits": 4}, "config says 4-bit groups of 32"),
        (
            {
                "group_size": 64,
                "bits": 4,
                "model.layers.1.mlp.up_proj": {"group_size": 64, "bits": 2},
            },
            r"model\.layers\.1\.mlp\.up_proj: config says 2-bit",
        ),
    ],
)
def test_config_bits_disagreeing_with_tensors(
    tiny_llama_dir: Path, tmp_path: Path, quantization: dict, message: str
) -> None:
    out = load(tiny_llama_dir, quantize=4).save(tmp_path / "q4")
    config = json.loads((out / "config.json").read_text())
    config["quantization"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as info:
        load(out)
    assert "4-bit groups of 64" in str(info.value)


def test_save_refuses_a_non_empty_directory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = load(tiny_llama_dir)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(InvalidOptionsError, match="not empty"):
        model.save(tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    assert model.save(tmp_path / "empty") == tmp_path / "empty"
