"""The hybrid shapes of omnia-bench (Qwen3-Next, Granite 4.0-H, Nemotron-H): their parameter
counts are the hub checkpoints', a cut (`--layers`) keeps each family's layer pattern, and a
random checkpoint of each, shrunk and cut to its first whole pattern, loads in this engine and in
mlx-lm to the same logits: as the hub lays it out (float32) and quantized in mlx-lm's layout,
which is the hub's layout quantized, code for code."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.bench import gate, results_file
from mlx_omnia.bench import main as bench
from mlx_omnia.bench.shapes import (
    SHAPES,
    build_checkpoint,
    checkpoint_bytes,
    cut,
    tensor_shapes,
)

mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

# each test shape, and the released checkpoint's shape it shrinks
HYBRIDS = {
    "tiny-qwen3-next": "qwen3-next-80b-a3b",
    "tiny-granite-4.0-h": "granite-4.0-h-tiny",
    "tiny-nemotron-h": "nemotron-h-8b",
}
PROMPT = [1, 5, 9, 200, 33, 7, 400, 2, 3, 77, 12, 500]
# The bench's own gate at float32 on the CPU: 2^-14 of the largest |logit|. Both engines run the
# same weights, so only their float32 sum orders part them: 3.5e-7 (Qwen3-Next) and 0 (Granite,
# Nemotron-H) here, hub layout or quantized; a misread tensor moves the logits by far more.
TOLERANCE = gate.gate_tolerance("float32", quantized=False, backend="cpu")


def layer_kinds(names: Any) -> set[str]:
    """Tensor names with the layer number left out: what kinds of layers a model has."""
    return {re.sub(r"\.layers\.\d+\.", ".layers.#.", n) for n in names}


def first_whole_pattern(config: dict[str, Any]) -> int:
    """The fewest first layers holding every kind of layer (every tensor name, layer number
    aside) of the whole model."""
    every = layer_kinds(tensor_shapes(config))
    return next(n for n in range(1, int(config["num_hidden_layers"]) + 1)
                if layer_kinds(tensor_shapes(cut(config, n))) == every)


def stored(path: Path) -> dict[str, dict[str, Any]]:
    """Every tensor of the checkpoint's safetensors files as their headers describe it."""
    tensors: dict[str, dict[str, Any]] = {}
    for file in path.glob("*.safetensors"):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        tensors |= header
    return tensors


def test_hybrid_shapes_have_the_hub_checkpoints_parameter_counts() -> None:
    counts = {name: sum(math.prod(s) for s in tensor_shapes(SHAPES[name]).values())
              for name in HYBRIDS.values()}
    # The hub's bfloat16 safetensors: 151.49 GiB for Qwen3-Next (148.41 here, and its
    # multi-token-prediction head, ~1.65 B, which neither engine loads and which is not drawn),
    # 12.93 GiB for granite-4.0-h-tiny (12.925 here); Nemotron-H-8B is published as 8.1 B.
    assert counts["qwen3-next-80b-a3b"] == 79_674_391_296
    assert counts["granite-4.0-h-tiny"] == 6_939_037_248
    assert counts["nemotron-h-8b"] == 8_100_852_736


@pytest.mark.parametrize("tiny", HYBRIDS)
def test_a_shrunk_shape_keeps_the_structure_of_the_released_one(tiny: str) -> None:
    small, real = SHAPES[tiny], SHAPES[HYBRIDS[tiny]]
    assert small.keys() == real.keys() and small["model_type"] == real["model_type"]
    for key in ("layer_types", "hybrid_override_pattern", "full_attention_interval",
                "num_hidden_layers", "tie_word_embeddings", "position_embedding_type"):
        assert small.get(key) == real.get(key)
    # the same tensors, layer for layer (gates, shared experts, convolutions, A_log, D...),
    # only fewer experts and smaller
    expert = re.compile(r"\.experts\.\d+\.")
    assert ({expert.sub(".experts.#.", n) for n in tensor_shapes(small)}
            == {expert.sub(".experts.#.", n) for n in tensor_shapes(real)})


def test_a_cut_keeps_the_first_layers_and_their_pattern() -> None:
    qwen = cut(SHAPES["qwen3-next-80b-a3b"], 12)
    assert qwen["num_hidden_layers"] == 12 and qwen["full_attention_interval"] == 4
    attention = [i for i in range(12) if f"model.layers.{i}.self_attn.q_proj.weight" in
                 tensor_shapes(qwen)]
    assert attention == [3, 7, 11]
    granite = cut(SHAPES["granite-4.0-h-tiny"], 6)
    assert granite["layer_types"] == ["mamba"] * 5 + ["attention"]
    nemotron = cut(SHAPES["nemotron-h-8b"], 8)
    assert nemotron["hybrid_override_pattern"] == "M-M-M-M*"
    assert nemotron["num_hidden_layers"] == 8
    assert [first_whole_pattern(SHAPES[t]) for t in HYBRIDS] == [4, 6, 8]
    assert cut(SHAPES["nemotron-h-8b"], None) == SHAPES["nemotron-h-8b"]
    with pytest.raises(SystemExit, match="give 1 to 52"):
        cut(SHAPES["nemotron-h-8b"], 53)


@pytest.mark.parametrize("quantize", [None, (4, 64)], ids=["hub-float32", "mlx-lm-q4"])
@pytest.mark.parametrize("shape", HYBRIDS)
def test_both_engines_load_a_hybrid_shape_to_the_same_logits(
    tmp_path: Path, shape: str, quantize: tuple[int, int] | None
) -> None:
    layers = first_whole_pattern(SHAPES[shape])
    path = build_checkpoint(shape, tmp_path / shape, dtype="float32", quantize=quantize,
                            layers=layers)
    tensors = stored(path)
    written = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in tensors.values())
    assert written == checkpoint_bytes(shape, dtype="float32", quantize=quantize, layers=layers)
    convs = [t["shape"] for name, t in tensors.items() if name.endswith(".conv1d.weight")]
    assert convs
    if quantize is None:  # the hub's names and shapes, experts per expert, torch's convolutions
        assert {n: tuple(t["shape"]) for n, t in tensors.items()} == tensor_shapes(
            cut(SHAPES[shape], layers))
        assert all(s[1] == 1 for s in convs)
    else:  # mlx-lm's: experts stacked as switch_mlp, convolutions channels-last
        assert not any(".experts." in n for n in tensors)
        assert all(s[2] == 1 for s in convs)
        assert any(n.endswith(".scales") for n in tensors)

    ours = np.array(load(str(path), dtype="float32").logits(PROMPT), dtype=np.float32)
    model, _ = mlx_lm_utils.load(str(path))
    theirs = np.array(model(mx.array([PROMPT]))[0], dtype=np.float32)
    assert ours.shape == theirs.shape == (len(PROMPT), 512)
    scale = float(np.abs(theirs).max())
    assert scale > 0 and np.isfinite(ours).all()
    assert float(np.abs(ours - theirs).max()) <= TOLERANCE * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("shape", HYBRIDS)
def test_the_quantized_layout_is_the_hub_layout_quantized(tmp_path: Path, shape: str) -> None:
    """Written in mlx-lm's layout (split, transposed, 1 + weight), the same random weights
    quantize to the same codes as the hub's layout quantized at load: the same model."""
    layers = first_whole_pattern(SHAPES[shape])
    hub = build_checkpoint(shape, tmp_path / "hub", dtype="float32", layers=layers)
    mlx = build_checkpoint(shape, tmp_path / "mlx", dtype="float32", layers=layers,
                           quantize=(4, 64))
    at_load = load(str(hub), dtype="float32", quantize={"bits": 4, "group_size": 64})
    written = load(str(mlx), dtype="float32")
    assert at_load.nbytes == written.nbytes == checkpoint_bytes(
        shape, dtype="float32", quantize=(4, 64), layers=layers)
    assert np.array_equal(np.array(at_load.logits(PROMPT), dtype=np.float32),
                          np.array(written.logits(PROMPT), dtype=np.float32))


def test_interleaved_runs_a_cut_hybrid_and_names_the_cut(tmp_path: Path) -> None:
    into, report_file = tmp_path / "results", tmp_path / "bench.json"
    out = io.StringIO()
    assert bench.main(["interleaved", "--model", "tiny-qwen3-next", "--layers", "4", "--runs", "1",
                       "--prompt", "16", "--generate", "4", "--dtype", "float32",
                       "--bandwidth-mib", "8", "--json", str(report_file),
                       "--results", str(into)], out=out) == 0
    text, report = out.getvalue(), json.loads(report_file.read_text())
    assert "model: random tiny-qwen3-next (first 4 of 48 layers)  dtype float32" in text
    assert report["options"]["layers"] == {"first": 4, "of": 48}
    assert report["model"]["config"]["num_hidden_layers"] == 4
    assert [r["arm"] for r in report["table"]] == ["omnia", "mlx-lm"]
    assert report["gate_passed"] is True, report["checks"]
    (saved,) = into.glob("*.json")
    assert saved.name.endswith("_tiny-qwen3-next_fp32_p16-g4_layers4-of-48_interleaved.json")
    (row,) = results_file.interleaved_table([json.loads(saved.read_text())]).splitlines()[2:]
    assert "| tiny-qwen3-next (4 of 48 layers) | fp32, both arms | 16 / 4 | 1 |" in row


def test_layers_needs_a_named_shape(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--layers cuts a named shape"):
        bench.main(["interleaved", "--model", str(tmp_path), "--layers", "2"], out=io.StringIO())
    with pytest.raises(SystemExit, match="--layers 3: this shape has 2 layers"):
        bench.main(["interleaved", "--model", "tiny", "--layers", "3"], out=io.StringIO())
