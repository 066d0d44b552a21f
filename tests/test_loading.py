"""Loading HF directories: sharded weights, dtypes, a tied head saved anyway."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from mlx_omnia import load

IDS = [5, 17, 42, 99, 3, 250, 7]


def test_sharded_checkpoint_loads_like_the_single_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map: dict[str, str] = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    whole = np.array(load(tiny_llama_dir).logits(IDS))
    parts = np.array(load(sharded).logits(IDS))
    assert np.array_equal(whole, parts)


def test_dtype_choices(tiny_llama_dir: Path) -> None:
    import mlx.core as mx

    for name, dtype in (("float32", mx.float32), ("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        model = load(tiny_llama_dir, dtype=name)
        assert model.network.model.embed_tokens.weight.dtype == dtype  # type: ignore[attr-defined]
    model = load(tiny_llama_dir, dtype=mx.bfloat16)
    reference = np.array(load(tiny_llama_dir).logits(IDS))
    got = np.array(model.logits(IDS))
    assert np.abs(got - reference).max() / np.abs(reference).max() < 0.05


def test_tied_checkpoint_that_still_saves_lm_head(tmp_path: Path) -> None:
    from tests.fixtures.tiny import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = load(path)
    assert "lm_head" not in model.bindings()
    assert np.isfinite(np.array(model.logits(IDS))).all()
