"""qwen3_5 family checks beyond tests/test_parity.py: the hub's image-text layout (config nested
under text_config, the text model under model.language_model.*, a vision tower beside it) loads
to the same network, batched == alone, a resent conversation resumes from the prefix cache, the
MLX-quantized round trip, and refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.errors import UnsupportedModelError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests import hybrid_checks
from tests.fixtures import parity

VARIANTS = ["qwen3_5-dense", "qwen3_5-moe"]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def image_text_checkpoint(variant: str, dest: Path) -> Path:
    """The fixture as the hub ships Qwen3.5: model_type qwen3_5 (or qwen3_5_moe) with the text
    config nested, tie_word_embeddings at the top, tensors under model.language_model.*, and a
    vision tower's tensors (random) under model.visual.*."""
    src = parity.checkpoint_dir(variant, "v5")
    config = read_json(src / "config.json")
    text_type = str(config["model_type"])
    outer = {
        "model_type": text_type.removesuffix("_text"),
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": config.pop("tie_word_embeddings"),
        "text_config": config,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32},
        "image_token_id": 248056,
    }
    dest.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            (dest / f.name).write_bytes(f.read_bytes())
    (dest / "config.json").write_text(json.dumps(outer, indent=2))
    weights = mx.load(str(src / "model.safetensors"))
    assert isinstance(weights, dict)
    renamed = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.")
               else k: v for k, v in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = mx.ones((32, 3, 2, 16, 16))
    mx.save_safetensors(str(dest / "model.safetensors"), renamed)  # pyright: ignore[reportUnknownMemberType]
    return dest


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_image_text_layout_loads_the_same_text_model(variant: str, tmp_path: Path) -> None:
    text = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    both = load(image_text_checkpoint(variant, tmp_path / "vl"), dtype="float32")
    np.testing.assert_array_equal(np.array(both.logits(parity.PROMPT_IDS)),
                                  np.array(text.logits(parity.PROMPT_IDS)))
    assert both.signature.inputs == frozenset({"text"})


def config(variant: str) -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, "v5") / "config.json")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
         "mamba"),
        ({"linear_num_value_heads": 3}, "multiple"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7, "factor": 2.0}}, "yarn"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        family_for("qwen3_5_text").build({**config("qwen3_5-dense"), **change})


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_greedy_equals_each_alone(variant: str) -> None:
    hybrid_checks.batched_equals_alone(load(parity.checkpoint_dir(variant, "v5"), dtype="float32"))


def test_a_resent_conversation_resumes_from_the_prefix_cache(tmp_path: Path) -> None:
    model = load(parity.checkpoint_dir("qwen3_5-moe", "v5"), dtype="float32")
    hybrid_checks.prefix_resumes_recurrent_layers(model, tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_round_trip(variant: str, tmp_path: Path) -> None:
    """load(quantize=4), save, load again: bit-identical logits. Near the float model at 8 bits
    (max rel error) only where the tiny random model is not chaotic: dense 0.131 (4 bits 1.05);
    the MoE variant moves 0.95 at 8 bits, as much from its embedding alone at 8 bits (0.90) or
    its routers alone (0.70: top-2 of 8 flips), while its experts alone move it 0.035."""
    d = parity.checkpoint_dir(variant, "v5")
    q = load(d, quantize=4, dtype="float32")
    ql = np.array(q.logits(parity.PROMPT_IDS))
    again = load(q.save(tmp_path / "q4"), dtype="float32")
    np.testing.assert_array_equal(np.array(again.logits(parity.PROMPT_IDS)), ql)
    if variant == "qwen3_5-dense":
        ref = np.array(load(d, dtype="float32").logits(parity.PROMPT_IDS))
        q8 = np.array(load(d, quantize=8, dtype="float32").logits(parity.PROMPT_IDS))
        assert _rel(q8, ref) < 0.3
