"""Checks shared by the mixture-of-experts family tests (tests/test_family_{qwen3_moe,mixtral,
olmoe,qwen2_moe}.py): the MLX-quantized round trip and the stacked expert layouts."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_omnia import load
from mlx_omnia.engine.core.moe import DownCombine, ExpertLinear, GateUp
from mlx_omnia.engine.core.mxcompat import flat_parameters, named_modules
from mlx_omnia.engine.model import Model
from tests.fixtures import parity


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def logits(model: Model) -> np.ndarray:
    return np.array(model.logits(parity.PROMPT_IDS).astype(mx.float32))


def experts(model: Model) -> dict[str, ExpertLinear]:
    return {p: m for p, m in named_modules(model.network) if isinstance(m, ExpertLinear)}


def quantized_round_trip(variant: str, tmp_path: Path) -> float:
    """load(quantize=4), save, load again: bit-identical logits, the expert declarations
    quantized in both; returns the quantized-vs-float relative logit error."""
    d = parity.checkpoint_dir(variant, "v5")
    ref = logits(load(d, dtype="float32"))
    q = load(d, quantize=4, dtype="float32")
    found = experts(q)
    assert found and all(m.bits == 4 and m.group_size == 64 for m in found.values())
    assert {type(m) for m in found.values()} == {GateUp, DownCombine}
    ql = logits(q)
    out = q.save(tmp_path / "q4")
    again = load(out, dtype="float32")
    assert all(m.bits == 4 for m in experts(again).values())
    assert np.array_equal(logits(again), ql)
    return rel(ql, ref)


def _copy_checkpoint(src: Path, dest: Path, weights: dict[str, mx.array]) -> Path:
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, dest / f.name)
    mx.save_safetensors(str(dest / "model.safetensors"), weights)  # pyright: ignore[reportUnknownMemberType]
    return dest


def stacked_layouts_load_alike(variant: str, tmp_path: Path, block: str = "mlp", fused_block: str = "mlp") -> None:
    """The per-expert checkpoint (what save_pretrained writes) and the same weights in
    transformers 5's fused layout (experts.gate_up_proj / experts.down_proj without .weight,
    the block renamed to `fused_block`) and in mlx-community's switch_mlp layout load to
    bit-identical logits."""
    d = parity.checkpoint_dir(variant, "v5")
    base = load(d, dtype="float32")
    want = logits(base)
    params = flat_parameters(base.network)
    pattern = re.compile(rf"^(.+)\.{block}\.experts\.(gate_up_proj|down_proj)\.weight$")
    fused: dict[str, mx.array] = {}
    switch: dict[str, mx.array] = {}
    for name, value in params.items():
        if m := pattern.match(name):
            layer, proj = m[1], m[2]
            fused[f"{layer}.{fused_block}.experts.{proj}"] = value
            if proj == "down_proj":
                switch[f"{layer}.{block}.switch_mlp.down_proj.weight"] = value
            else:
                half = value.shape[1] // 2
                switch[f"{layer}.{block}.switch_mlp.gate_proj.weight"] = value[:, :half]
                switch[f"{layer}.{block}.switch_mlp.up_proj.weight"] = value[:, half:]
        else:
            fused[name.replace(f".{block}.", f".{fused_block}.")] = value
            switch[name] = value
    assert len(fused) < len(params) + 1 and any(k.endswith("experts.gate_up_proj") for k in fused)
    for kind, weights in (("fused", fused), ("switch", switch)):
        other = load(_copy_checkpoint(d, tmp_path / kind, weights), dtype="float32")
        assert np.array_equal(logits(other), want), kind
