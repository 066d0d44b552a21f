"""gpt2 family checks beyond tests/test_parity.py: hub files of the older layout (no
"transformer." prefix, causal-mask buffers) load to the same logits, saved files (dense and
MLX-quantized; not in Conv1D layout) load back bit-identical, and variants the family cannot
run are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.mxcompat import flat_parameters, load_safetensors, set_parameters
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests.fixtures import parity


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_older_layout_without_prefix_with_mask_buffers(tmp_path: Path) -> None:
    """openai-community/gpt2's file: names without "transformer.", attn.bias/masked_bias
    buffers, and (older transformers) a saved lm_head copy: same logits."""
    src = parity.checkpoint_dir("gpt2-tied", "v4")
    dst = tmp_path / "old"
    shutil.copytree(src, dst)
    weights = load_safetensors(src / "model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in weights.items()}
    n = int(read_json(src / "config.json")["n_positions"])
    for i in range(int(read_json(src / "config.json")["n_layer"])):
        old[f"h.{i}.attn.bias"] = mx.tril(mx.ones((n, n))).reshape(1, 1, n, n)
        old[f"h.{i}.attn.masked_bias"] = mx.array(-1e4)
    old["lm_head.weight"] = weights["transformer.wte.weight"]
    assert not any(k.startswith("transformer.") for k in old)
    mx.save_safetensors(str(dst / "model.safetensors"), old)  # pyright: ignore[reportUnknownMemberType]  # stub: untyped
    ours = np.array(load(dst, dtype="float32").logits(parity.PROMPT_IDS))
    ref = np.array(load(src, dtype="float32").logits(parity.PROMPT_IDS))
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("variant", ["gpt2-tied", "gpt2-layerscale"])
def test_dense_save_round_trip(variant: str, tmp_path: Path) -> None:
    """A saved dense model holds Linear-layout ([out, in]) weights; loading it must not
    transpose them again (attn.c_proj is square, so a wrong guess would still load)."""
    d = parity.checkpoint_dir(variant, "v5")
    model = load(d, dtype="float32")
    ref = np.array(model.logits(parity.PROMPT_IDS))
    again = load(model.save(tmp_path / "dense"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ref)


@pytest.mark.parametrize("variant", ["gpt2-tied", "gpt2-layerscale"])
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits to the in-memory quantized
    model, and close to the float model. Measured max rel error: 4 bits 0.20 (tied) / 0.17
    (layerscale), 8 bits 0.011 / 0.0094."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    assert np.array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    assert _rel(ql, ref) < 0.3
    q8 = np.array(load(d, quantize=8, dtype="float32").logits(parity.PROMPT_IDS))
    assert _rel(q8, ref) < 0.02


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"activation_function": "gelu"}, "activation_function"),
        ({"activation_function": "relu"}, "activation_function"),
        ({"add_cross_attention": True}, "add_cross_attention"),
    ],
)
def test_refused_variants(change: dict[str, Any], named: str) -> None:
    config = read_json(parity.checkpoint_dir("gpt2-tied", "v5") / "config.json")
    with pytest.raises(UnsupportedModelError, match=named):
        family_for("gpt2").build({**config, **change})


def test_layerscale_fixture_exercises_the_attention_scales() -> None:
    """Same weights without scale_attn_by_inverse_layer_idx: logits far beyond the parity
    tolerance (measured 4.4e-2), so parity checks the per-layer scale."""
    d = parity.checkpoint_dir("gpt2-layerscale", "v5")
    config = read_json(d / "config.json")
    model = load(d, dtype="float32")
    other = family_for("gpt2").build({**config, "scale_attn_by_inverse_layer_idx": False})
    set_parameters(other, list(flat_parameters(model.network).items()))
    bind_layers(other)
    ids = mx.array([parity.PROMPT_IDS], dtype=mx.int32)
    assert _rel(np.array(other(ids)[0]), np.array(model.network(ids)[0])) > 1e-2
