"""Checkpoints as mlx-lm writes them (`mlx_lm.convert`, what mlx-community publishes) load to the
model the hub's layout of the same weights gives, for the recurrent families whose tensors
mlx-lm's sanitize changes: conv1d weights channels-last, Qwen's (1 + weight) norms stored as
1 + weight, LFM2-MoE's feed-forward renamed and its experts stacked, Qwen3.5's text model
nested as language_model.*.

mlx-lm itself makes each layout from a parity fixture: float32, and 4-bit (its own
quantize_model through convert, with its 8-bit routers). Where mlx-lm 0.32.2 cannot read a
fixture as it stands, `hub_source` writes the copy it can read and says why:

    lfm2-*          mlx-lm's lfm2 requires `block_dim` (the feed-forward's input width), which
                    LiquidAI's configs carry and transformers' Lfm2Config does not write: added
                    (= hidden_size).
    lfm2-bias, lfm2_moe-plain   untied; mlx-lm's lfm2 and lfm2_moe always tie the head to the
                    embedding (as every LFM2 release does): checked as tied copies (embedding as
                    head, lm_head dropped), which keep the variant's convolution biases.
    mamba2-*        mlx-lm's mamba2 requires `intermediate_size` (unused by its model; Codestral
                    Mamba's config carries it, transformers' Mamba2Config does not write it):
                    added (= num_heads * head_dim).
    qwen3_5-*       mlx-lm knows neither qwen3_5_text nor qwen3_5_moe_text (transformers'
                    text-only configs); it reads the hub's image-text checkpoints (model_type
                    qwen3_5 / qwen3_5_moe, text config nested with its rope_parameters and
                    full_attention_interval, tensors under model.language_model.*, MoE experts
                    fused as transformers 5 stores them): that layout is written from the v5
                    fixture (whose config spells rope as the hub's does).

The float layout must give our hub-layout logits within 1e-6 (mlx-lm's +1 and our -1 on the
norms round at float32 once each) and the same greedy tokens; the quantized one mlx-lm's own
logits of that model within IMPLEMENTATION_TOL (see there) and its greedy tokens, except where
mlx-lm computes otherwise (MLX_LM_COMPUTES_OTHERWISE). At bfloat16 the norms read back bit for
bit."""

from __future__ import annotations

import json
import shutil
from itertools import islice
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]

from mlx_omnia import load
from mlx_omnia.engine.core.mxcompat import flat_parameters
from mlx_omnia.engine.generate.loop import generate_tokens
from mlx_omnia.engine.generate.sampling import Sampler, SamplingParams
from mlx_omnia.engine.loading.weights import read_json
from mlx_omnia.engine.model import Model
from tests.fixtures import parity

mlx_lm_convert = pytest.importorskip("mlx_lm.convert")
mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

VARIANTS = [
    "qwen3_next-dense", "qwen3_next-moe", "qwen3_5-dense", "qwen3_5-moe",
    "lfm2-bias", "lfm2-hybrid", "lfm2_moe-bias", "lfm2_moe-plain",
    "mamba2-groups", "mamba2-tied",
]
PROMPT = parity.PROMPT_IDS
NEW_TOKENS = 6
FLOAT_TOL = 1e-6
# Our engine and mlx-lm run the same weights (a quantized model: the same codes, scales and
# biases, dequantized in float32 by MLX's quantized matmuls) and differ only in their float32
# arithmetic: sum orders, and the recurrences' chunking. That gap, measured on the float
# models, is at most 9.3e-6 (qwen3_5-moe; 3.9e-7 to 7e-6 elsewhere), and the quantized models
# show the same (<= 8.8e-6). Five times the largest leaves room for a kernel's other sum order
# and stays far below what one misread tensor moves: a norm left at 1 + weight, 1.26.
IMPLEMENTATION_TOL = 5e-5
# Where mlx-lm's model computes something other than transformers (and this engine), its logits
# are no reference; ours are then held to our own quantization of the hub layout at load, which
# gives the same codes (round to nearest, same groups) for a family mlx-lm quantizes uniformly.
MLX_LM_COMPUTES_OTHERWISE = {
    # mlx-lm's gated RMS norm spans all n_groups groups at once (transformers' and
    # mamba_ssm's, and ours, normalize each group): 0.097 apart at float32 already.
    "mamba2-groups": "mlx-lm normalizes the gated output over all groups at once",
}
Q_BITS, Q_GROUP_SIZE = 4, 32  # groups of 32 reach the 32- and 96-wide inputs too


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _copy_beside(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dest / f.name)


def _tensors(path: Path) -> dict[str, mx.array]:
    loaded = mx.load(str(path))
    assert isinstance(loaded, dict)
    return loaded


def _write(dest: Path, config: dict[str, Any], weights: dict[str, mx.array]) -> Path:
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(dest / "model.safetensors"), weights)  # pyright: ignore[reportUnknownMemberType]
    return dest


def _qwen3_5_image_text(variant: str, dest: Path) -> Path:
    src = parity.checkpoint_dir(variant, "v5")
    _copy_beside(src, dest)
    text = read_json(src / "config.json")
    kinds = list(text["layer_types"])
    interval = kinds.index("full_attention") + 1
    assert kinds == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(len(kinds))]
    text["full_attention_interval"] = interval
    moe = text["model_type"] == "qwen3_5_moe_text"
    config = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
    }
    weights = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.")
               else k: v for k, v in _tensors(src / "model.safetensors").items()}
    if moe:
        for layer in range(int(text["num_hidden_layers"])):
            at = f"model.language_model.layers.{layer}.mlp.experts"
            experts = range(int(text["num_experts"]))
            proj = {p: [weights.pop(f"{at}.{e}.{p}_proj.weight") for e in experts]
                    for p in ("gate", "up", "down")}
            weights[f"{at}.gate_up_proj"] = mx.stack(
                [mx.concatenate([g, u]) for g, u in zip(proj["gate"], proj["up"], strict=True)]
            )
            weights[f"{at}.down_proj"] = mx.stack(proj["down"])
    return _write(dest, config, weights)


def hub_source(variant: str, dest: Path) -> Path:
    """The hub-layout checkpoint of `variant` that mlx-lm reads (the module docstring says what
    each copy adds)."""
    family = variant.split("-")[0]
    if family == "qwen3_5":
        return _qwen3_5_image_text(variant, dest)
    src = parity.checkpoint_dir(variant, "v4")
    config = read_json(src / "config.json")
    weights = _tensors(src / "model.safetensors")
    if family == "lfm2":
        config["block_dim"] = config["hidden_size"]
    if family in ("lfm2", "lfm2_moe") and not config.get("tie_embedding", True):
        config["tie_embedding"] = True
        weights.pop("lm_head.weight")
    if family == "mamba2":
        config["intermediate_size"] = config["num_heads"] * config["head_dim"]
    if config == read_json(src / "config.json"):
        return src
    _copy_beside(src, dest)
    return _write(dest, config, weights)


def mlx_lm_convert_to(src: Path, dest: Path, *, quantize: bool) -> Path:
    mlx_lm_convert.convert(str(src), str(dest), quantize=quantize, q_bits=Q_BITS,
                           q_group_size=Q_GROUP_SIZE)
    return dest


def greedy(model: Model) -> list[int]:
    vocab = int(model.logits(PROMPT[:1]).shape[-1])
    sampler = Sampler(SamplingParams(temperature=0.0), vocab, PROMPT)
    return list(islice(generate_tokens(model.network, PROMPT, sampler), NEW_TOKENS))  # type: ignore[arg-type]


def mlx_lm_logits_and_greedy(path: Path) -> tuple[np.ndarray, list[int]]:
    """mlx-lm's own run of the checkpoint at `path`: the prompt's logits, its greedy tokens."""
    model, _ = mlx_lm_utils.load(str(path))
    logits = model(mx.array([PROMPT]))[0].astype(mx.float32)
    cache = model.make_cache()
    step = model(mx.array([PROMPT]), cache=cache)
    tokens: list[int] = []
    for _ in range(NEW_TOKENS):
        tokens.append(int(mx.argmax(step[0, -1]).item()))
        step = model(mx.array([[tokens[-1]]]), cache=cache)
    return np.array(logits), tokens


def _channels_last_convs(path: Path) -> list[str]:
    weights: dict[str, mx.array] = {}
    for f in path.glob("*.safetensors"):
        weights.update(_tensors(f))
    return [k for k, v in weights.items()
            if k.endswith(("conv1d.weight", "conv.conv.weight")) and v.shape[-1] == 1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlx_lm_float_layout_loads_as_the_hub_layout(variant: str, tmp_path: Path) -> None:
    src = hub_source(variant, tmp_path / "hub")
    converted = mlx_lm_convert_to(src, tmp_path / "mlx", quantize=False)
    assert _channels_last_convs(converted), "mlx-lm wrote no channels-last convolution"
    hub = load(src, dtype="float32")
    ours = load(converted, dtype="float32")
    want = np.array(hub.logits(PROMPT))
    assert _rel(np.array(ours.logits(PROMPT)), want) <= FLOAT_TOL
    assert greedy(ours) == greedy(hub)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlx_lm_quantized_layout_runs_as_mlx_lm_runs_it(variant: str, tmp_path: Path) -> None:
    src = hub_source(variant, tmp_path / "hub")
    converted = mlx_lm_convert_to(src, tmp_path / "mlx-q4", quantize=True)
    config = read_json(converted / "config.json")
    assert config["quantization"]["bits"] == Q_BITS
    ours = load(converted, dtype="float32")
    got = np.array(ours.logits(PROMPT))
    if variant in MLX_LM_COMPUTES_OTHERWISE:
        mine = load(src, dtype="float32", quantize={"bits": Q_BITS, "group_size": Q_GROUP_SIZE})
        np.testing.assert_array_equal(got, np.array(mine.logits(PROMPT)))
        assert greedy(ours) == greedy(mine)
        return
    want, want_tokens = mlx_lm_logits_and_greedy(converted)
    assert _rel(got, want) <= IMPLEMENTATION_TOL
    assert greedy(ours) == want_tokens


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith("qwen3")])
def test_mlx_lm_bfloat16_norms_read_back_bit_for_bit(variant: str, tmp_path: Path) -> None:
    """At bfloat16 mlx-lm stores each (1 + weight) norm as bfloat16(1 + weight): our 1 + weight
    (float32) is that stored value exactly, and the whole model runs as mlx-lm's does on the
    same bfloat16 weights (both at float32)."""
    src = hub_source(variant, tmp_path / "hub")
    converted = tmp_path / "mlx-bf16"
    mlx_lm_convert.convert(str(src), str(converted), dtype="bfloat16")
    model, _ = mlx_lm_utils.load(str(converted))
    stored = dict(tree_flatten(model.parameters()))
    prefix = "language_model." if variant.startswith("qwen3_5") else ""
    ours = load(converted, dtype="float32")
    norms = {k: v for k, v in flat_parameters(ours.network).items()
             if k == "model.norm.weight" or k.endswith(("layernorm.weight", "q_norm.weight",
                                                        "k_norm.weight"))}
    assert norms
    for name, weight in norms.items():
        assert stored[prefix + name].dtype == mx.bfloat16
        assert mx.array_equal(1.0 + weight, stored[prefix + name].astype(mx.float32)), name
    model.set_dtype(mx.float32)
    want = np.array(model(mx.array([PROMPT]))[0])
    assert _rel(np.array(ours.logits(PROMPT)), want) <= IMPLEMENTATION_TOL
