"""A family's table (core/fusion.py): the chains the binding pass finds in a plain forward, the
plan that runs them, and what a forward may not do."""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_omnia import load
from mlx_omnia.engine.core import fusion
from mlx_omnia.engine.core.binder import bind_layers, bindings
from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.fusion import (
    NORM_INTO_PROJECTIONS,
    RESIDUAL_INTO_PROJECTION,
    Fusions,
)
from mlx_omnia.engine.core.layers import Linear, RmsNorm
from mlx_omnia.engine.core.mxcompat import named_modules
from mlx_omnia.engine.core.trace import Untraceable
from tests.fixtures import parity

TABLED = ("qwen3-qknorm", "qwen3_moe-sparse", "llama-default", "llama-llama3-tied",
          "qwen2-bias-tied", "mistral-full", "mistral-sliding")


def chains(model: Any, layer: int) -> list[str]:
    """The declarations layer `layer`'s plan calls, in order (a family's own by type name)."""
    layers = model.network.model.layers
    plan = fusion.plans_of(layers[layer])["__call__"]
    return [type(op.decl).__name__ if op.decl is not None else op.call.__name__ for op in plan.ops]


def test_qwen3_layer_runs_as_three_chains() -> None:
    """input_layernorm and q/k/v then the attention; o_proj with the residual then
    post_attention_layernorm and gate/up; down_proj with the residual."""
    model = load(str(parity.checkpoint_dir("qwen3-qknorm", "v5")))
    assert chains(model, 0) == ["ProjectAttend", "ChainedProjections", "Linear"]
    names = set(model.bindings())
    assert ("model.layers.0/ProjectAttend(self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, "
            "input_layernorm, self_attn.attention)") in names
    assert "Projections(lm_head, model.norm)" in names


def test_qwen3_moe_sparse_layer_runs_as_two_chains_and_a_dense_one_as_four() -> None:
    model = load(str(parity.checkpoint_dir("qwen3_moe-sparse", "v5")), quantize=4)
    assert chains(model, 0) == ["ProjectAttend", "RouteExperts"]
    assert chains(model, 1) == ["ProjectAttend", "Linear", "Projections", "Linear"]


def test_llama_keeps_its_attention_apart_from_the_projections() -> None:
    """Its table names no projections+attention chain: q/k/v, then the attention."""
    model = load(str(parity.checkpoint_dir("llama-default", "v5")))
    assert chains(model, 0) == ["Projections", "AttentionStep", "ChainedProjections", "Linear"]


def test_a_family_without_a_table_runs_as_written() -> None:
    model = load(str(parity.checkpoint_dir("mixtral-default", "v5")))
    assert all(not fusion.plans_of(m) for _, m in named_modules(model.network))
    assert all("/" not in path and "(" not in path for path in model.bindings())


def _logits(net: Any, ids: list[int], steps: list[int]) -> np.ndarray:
    cache: list[KVCache] = net.make_cache()
    rows = [np.array(net(mx.array([ids], dtype=mx.int32), cache)[0])]
    rows += [np.array(net(mx.array([[t]], dtype=mx.int32), cache)[0]) for t in steps]
    return np.concatenate(rows)


def _activate(net: nn.Module, active: bool) -> None:
    for _, module in named_modules(net):
        for plan in fusion.plans_of(module).values():
            plan.active = active


@pytest.mark.parametrize("variant", TABLED)
def test_a_plan_of_core_chains_computes_the_forward_bit_for_bit(variant: str) -> None:
    """The CPU binds no kernel, so the forward runs as written; made to run its plan (each chain
    on its core implementation) it gives the same logits, bit for bit."""
    model = load(str(parity.checkpoint_dir(variant, "v5")))
    net = model.network
    written = _logits(net, [3, 17, 42, 9, 101], [11, 12])
    _activate(net, True)
    try:
        planned = _logits(net, [3, 17, 42, 9, 101], [11, 12])
    finally:
        _activate(net, False)
    np.testing.assert_array_equal(planned, written)


class _Tabled(nn.Module):
    def __init__(self, *, reads_shape: bool) -> None:
        super().__init__()
        self.norm = RmsNorm(8)
        self.proj = Linear(8, 8)
        self.reads_shape = reads_shape

    @Fusions(NORM_INTO_PROJECTIONS, RESIDUAL_INTO_PROJECTION)
    def __call__(self, x: mx.array) -> mx.array:
        if self.reads_shape:
            _ = x.shape[-1]
        return x + self.proj(self.norm(x))


def test_a_tabled_forward_that_reads_a_shape_cannot_be_bound() -> None:
    with pytest.raises(Untraceable, match=re.escape("_Tabled.__call__ cannot be traced")):
        bind_layers(_Tabled(reads_shape=True))


def test_a_tabled_forward_becomes_its_chains_and_stays_plain_on_the_cpu() -> None:
    block = _Tabled(reads_shape=False)
    bound = bind_layers(block)
    assert bound == bindings(block)
    assert "/Projections(proj, norm)" not in bound  # the root's chains have no leading path
    assert bound["Projections(proj, norm)"] == "core"
    plan = fusion.plans_of(block)["__call__"]
    ops = [type(op.decl).__name__ if op.decl is not None else op.call.__name__ for op in plan.ops]
    assert ops == ["Projections", "add"]  # a Projections takes no residual
    assert not plan.active  # nothing bound a kernel: the forward runs as written
    x = mx.random.normal((1, 2, 8))
    written = block(x)
    plan.active = True
    np.testing.assert_array_equal(np.array(block(x)), np.array(written))


def test_a_table_names_known_chains_only() -> None:
    with pytest.raises(ValueError, match="unknown fusions"):
        Fusions("norm+everything")
