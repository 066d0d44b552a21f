"""Kernel predicates and binding, on any backend (mutation tests).

For each kernel: the declaration it was written for is accepted by its `*_fits` predicate, and a
declaration that differs in one declared property alone (dtype, bits, group size, bias, norm
kind, activation, geometry, attention variant, rope kind) is declined. On the CPU backend no
CUDA kernel binds (`*_applies` is false and every binding is the core)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.binding import Declaration, Kernel, register
from mlx_omnia.engine.core.kernels import (
    cuda_backend,
    header_include,
    launch_scratch,
    own_scratch,
)
from mlx_omnia.engine.core.kernels.attention_step import ATTENTION_STEP, PROJECT_ATTEND
from mlx_omnia.engine.core.kernels.moe import (
    EXPERTS_CHAIN,
    EXPERTS_DOWN,
    EXPERTS_GATE_UP,
    PROJECT_ROUTE,
    ROUTE,
    ROUTE_EXPERTS,
    chain_specs,
    experts_fits_decl,
    project_route_specs,
    route_experts_specs,
    routed_spec,
)
from mlx_omnia.engine.core.kernels.qmv import CHAINED_QMV, QMV_LINEAR, QMV_PROJECTIONS
from mlx_omnia.engine.core.layers import (
    AttentionStep,
    ChainedProjections,
    Embedding,
    Linear,
    OffsetRmsNorm,
    ProjectAttend,
    Projections,
    RmsNorm,
    Rope,
)
from mlx_omnia.engine.core.moe import DownCombine, GateUp, ProjectRoute, Route, RouteExperts
from mlx_omnia.engine.core.rope import LongRope

on_cpu = pytest.mark.skipif(cuda_backend(), reason="checks the CPU backend")


def linear(k: int = 256, n: int = 512, *, dtype: mx.Dtype = mx.bfloat16, bits: int | None = None,
           group_size: int = 64, bias: bool = False) -> Linear:
    lin = Linear(k, n, bias=bias)
    lin.weight = lin.weight.astype(dtype)
    if bias:
        lin.bias = lin.bias.astype(dtype)
    if bits is not None:
        lin.to_quantized(bits=bits, group_size=group_size)
        lin.scales = lin.scales.astype(dtype)
        lin.biases = lin.biases.astype(dtype)
    return lin


def norm(dims: int = 256, dtype: mx.Dtype = mx.bfloat16) -> RmsNorm:
    n = RmsNorm(dims, 1e-6)
    n.weight = n.weight.astype(dtype)
    return n


# --- Linear (Qmv) ---------------------------------------------------------------------------
LINEAR_ACCEPTED: dict[str, Callable[[], Linear]] = {
    "dense bf16": lambda: linear(),
    "dense fp16": lambda: linear(dtype=mx.float16),
    "affine 4-bit g64": lambda: linear(bits=4),
    "affine 4-bit g32": lambda: linear(bits=4, group_size=32),
    "affine 8-bit g128": lambda: linear(bits=8, group_size=128),
}


def _mixed_scales() -> Linear:
    lin = linear(bits=4)
    lin.biases = lin.biases.astype(mx.float16)
    return lin


LINEAR_DECLINED: dict[str, Callable[[], Linear]] = {
    "dtype float32": lambda: linear(dtype=mx.float32),
    "bias": lambda: linear(bias=True),
    "bits 3": lambda: linear(bits=3, group_size=64),
    "bits 2": lambda: linear(bits=2, group_size=64),
    "group size 16": lambda: linear(bits=4, group_size=16),
    "scales float32": lambda: linear(bits=4, dtype=mx.float32),
    "scales and biases of two dtypes": _mixed_scales,
    "input width not a multiple of 8": lambda: linear(k=252),
    "input width past the shared-memory stage": lambda: linear(k=32768),
}


@pytest.mark.parametrize("case", sorted(LINEAR_ACCEPTED))
def test_qmv_accepts_what_it_computes(case: str) -> None:
    assert QMV_LINEAR.fits(LINEAR_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(LINEAR_DECLINED))
def test_qmv_declines_a_declaration_differing_in_one_property(case: str) -> None:
    assert not QMV_LINEAR.fits(LINEAR_DECLINED[case]())


# --- Projections ------------------------------------------------------------------------------
def qkv(**kw: object) -> list[Linear]:
    return [linear(n=n, **kw) for n in (512, 128, 128)]  # type: ignore[arg-type]


PROJECTIONS_ACCEPTED: dict[str, Callable[[], Projections]] = {
    "q/k/v after an RMS norm": lambda: Projections(qkv(), norm=norm()),
    "q/k/v 4-bit, no norm": lambda: Projections(qkv(bits=4)),
    "gate/up silu": lambda: Projections([linear(), linear()], norm=norm(), gate="silu"),
    "gate/up gelu_tanh 8-bit": lambda: Projections([linear(bits=8), linear(bits=8)], gate="gelu_tanh"),
    "tied head": lambda: Projections([_embedding()], norm=norm()),
}


def _embedding(bits: int | None = None) -> Embedding:
    e = Embedding(1024, 256)
    e.weight = e.weight.astype(mx.bfloat16)
    if bits is not None:
        e.to_quantized(bits=bits, group_size=64)
        e.scales = e.scales.astype(mx.bfloat16)
        e.biases = e.biases.astype(mx.bfloat16)
    return e


PROJECTIONS_DECLINED: dict[str, Callable[[], Projections]] = {
    "Gemma's offset norm": lambda: Projections(qkv(), norm=_offset_norm()),  # type: ignore[arg-type]
    "norm weight float32": lambda: Projections(qkv(), norm=norm(dtype=mx.float32)),
    "one projection quantized": lambda: Projections([linear(), linear(bits=4)]),
    "two group sizes": lambda: Projections([linear(bits=4), linear(bits=4, group_size=32)]),
    "two input widths": lambda: Projections([linear(k=256), linear(k=512)]),
    "a bias": lambda: Projections([linear(), linear(bias=True)]),
    "gate over unequal rows": lambda: Projections([linear(n=512), linear(n=256)], gate="silu"),
    "four projections": lambda: Projections([linear() for _ in range(4)]),
    "dtype float32": lambda: Projections([linear(dtype=mx.float32)]),
}


@pytest.mark.parametrize("case", sorted(PROJECTIONS_ACCEPTED))
def test_projections_kernel_accepts_what_it_computes(case: str) -> None:
    assert QMV_PROJECTIONS.fits(PROJECTIONS_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(PROJECTIONS_DECLINED))
def test_projections_kernel_declines_a_declaration_differing_in_one_property(case: str) -> None:
    assert not QMV_PROJECTIONS.fits(PROJECTIONS_DECLINED[case]())


def test_gated_projections_need_two() -> None:
    with pytest.raises(ValueError, match="exactly two"):
        Projections([linear()], gate="silu")


# --- AttentionStep ----------------------------------------------------------------------------
def attention(**over: object) -> AttentionStep:
    kw: dict[str, object] = {
        "n_heads": 32, "n_kv_heads": 8, "head_dim": 128,
        "q_norm": norm(128), "k_norm": norm(128), "rope": Rope(128, base=1e6),
    }
    kw.update(over)
    return AttentionStep(**kw)  # type: ignore[arg-type]


def _long_rope() -> LongRope:
    periods = mx.ones((64,))
    return LongRope(128, short_periods=periods, long_periods=periods, original_max=4096,
                    attention_factor=1.0)


ATTENTION_ACCEPTED: dict[str, Callable[[], AttentionStep]] = {
    "qwen3 (head norms, GQA 4)": lambda: attention(),
    "llama (no norms, GQA 8, head 64)": lambda: attention(
        n_heads=32, n_kv_heads=4, head_dim=64, q_norm=None, k_norm=None, rope=Rope(64, base=5e5)
    ),
    "multi-head": lambda: attention(n_kv_heads=32),
    "GQA 8, head 32": lambda: attention(n_heads=16, n_kv_heads=2, head_dim=32, q_norm=None,
                                        k_norm=None, rope=Rope(32, base=1e4)),
    "scaled rope frequencies": lambda: attention(rope=Rope(128, base=1e6, freqs=mx.ones((64,)))),
    "traditional rope": lambda: attention(rope=Rope(128, base=1e4, traditional=True)),
}

ATTENTION_DECLINED: dict[str, Callable[[], AttentionStep]] = {
    "sliding window": lambda: attention(window=4096),
    "soft-capped scores": lambda: attention(softcap=50.0),
    "values wider than keys": lambda: attention(value_dim=256),
    "head_dim 256": lambda: attention(head_dim=256, q_norm=norm(256), k_norm=norm(256),
                                      rope=Rope(256, base=1e6)),
    "partial rope": lambda: attention(rope=Rope(64, base=1e6)),
    "rope attention factor": lambda: attention(rope=Rope(128, base=1e6, attention_factor=0.9)),
    "longrope": lambda: attention(rope=_long_rope()),
    "no rope": lambda: attention(rope=None),
    "offset norm on queries": lambda: attention(q_norm=OffsetRmsNorm(128)),
    "norm over another width": lambda: attention(k_norm=norm(64)),
    "32 query heads per kv head": lambda: attention(n_kv_heads=1),
    "16 query heads per kv head": lambda: attention(n_kv_heads=2),
    "head_dim 96": lambda: attention(head_dim=96, q_norm=norm(96), k_norm=norm(96),
                                     rope=Rope(96, base=1e6)),
    "heads not a multiple of kv heads": lambda: attention(n_heads=30),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_ACCEPTED))
def test_attention_kernel_accepts_what_it_computes(case: str) -> None:
    assert ATTENTION_STEP.fits(ATTENTION_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(ATTENTION_DECLINED))
def test_attention_kernel_declines_a_declaration_differing_in_one_property(case: str) -> None:
    assert not ATTENTION_STEP.fits(ATTENTION_DECLINED[case]())


# --- mixture of experts: Route, GateUp, DownCombine -------------------------------------------
ROUTE_ACCEPTED: dict[str, Callable[[], Route]] = {
    "128 experts, top 8, renormalized": lambda: Route(128, 8, normalize=True),
    "softmax then top-k, not renormalized": lambda: Route(64, 6),
    "top-k then softmax": lambda: Route(8, 2, order="topk_softmax"),
    "512 experts, top 32": lambda: Route(512, 32),
}
ROUTE_DECLINED: dict[str, Callable[[], Route]] = {
    "513 experts": lambda: Route(513, 8),
    "top 33": lambda: Route(128, 33),
}


def experts(cls: type[GateUp] | type[DownCombine], *, dtype: mx.Dtype = mx.bfloat16,
            bits: int | None = None, group_size: int = 64, mode: str = "affine",
            d_in: int = 256, rows: int = 128, **kw: object) -> GateUp | DownCombine:
    decl = cls(8, d_in, rows, **kw)  # type: ignore[arg-type]
    decl.weight = decl.weight.astype(dtype)
    if bits is not None:
        decl.to_quantized(bits=bits, group_size=group_size, mode=mode)  # type: ignore[arg-type]
        if mode == "affine":
            decl.scales = decl.scales.astype(dtype)
            decl.biases = decl.biases.astype(dtype)
    return decl


def _mixed_expert_scales(cls: type[GateUp] | type[DownCombine]) -> GateUp | DownCombine:
    decl = experts(cls, bits=4)
    decl.biases = decl.biases.astype(mx.float16)
    return decl


EXPERTS_ACCEPTED: dict[str, Callable[[type[GateUp] | type[DownCombine]], GateUp | DownCombine]] = {
    "dense bf16": lambda c: experts(c),
    "dense fp16": lambda c: experts(c, dtype=mx.float16),
    "affine 4-bit g64": lambda c: experts(c, bits=4),
    "affine 4-bit g32": lambda c: experts(c, bits=4, group_size=32),
    "affine 8-bit g128": lambda c: experts(c, bits=8, group_size=128),
}
EXPERTS_DECLINED: dict[str, Callable[[type[GateUp] | type[DownCombine]], GateUp | DownCombine]] = {
    "dtype float32": lambda c: experts(c, dtype=mx.float32),
    "per-expert bias": lambda c: experts(c, bias=True),
    "mxfp4": lambda c: experts(c, bits=4, group_size=32, mode="mxfp4"),
    "bits 3": lambda c: experts(c, bits=3),
    "bits 2": lambda c: experts(c, bits=2),
    "group size 16": lambda c: experts(c, bits=4, group_size=16),
    "scales and biases of two dtypes": _mixed_expert_scales,
    "input width not a multiple of 8": lambda c: experts(c, d_in=252),
    "input width past the shared-memory stage": lambda c: experts(c, d_in=16384),
}


def routed(n: int = 128, *, router_norm: RmsNorm | OffsetRmsNorm | None = None,
           **lin: object) -> Route:
    """Route(n, 8) declaring its router: one Linear(256, n) after an RMS norm."""
    router = Projections([linear(256, n, **lin)], norm=router_norm or norm(256))  # type: ignore[arg-type]
    return Route(n, 8, normalize=True, router=router)


def _offset_routed() -> Route:
    n = OffsetRmsNorm(256)
    n.weight = n.weight.astype(mx.bfloat16)
    return routed(router_norm=n)


ROUTED_ACCEPTED: dict[str, Callable[[], Route]] = {
    "dense bf16 router after a norm": lambda: routed(),
    "4-bit router": lambda: routed(bits=4),
    "8-bit g32 router": lambda: routed(bits=8, group_size=32),
    "dense fp16 router": lambda: routed(dtype=mx.float16, router_norm=norm(256, mx.float16)),
    "60 experts": lambda: routed(60),
    "128 experts, 8-bit": lambda: routed(128, bits=8),
}
ROUTED_DECLINED: dict[str, Callable[[], Route]] = {
    "a router bias": lambda: routed(bias=True),
    "129 experts (one block's rows)": lambda: routed(129),
    "offset (Gemma) norm": _offset_routed,
    "router float32": lambda: routed(dtype=mx.float32, router_norm=norm(256, mx.float32)),
    "norm weight of another dtype": lambda: routed(router_norm=norm(256, mx.float16)),
}


@pytest.mark.parametrize("case", sorted(ROUTED_ACCEPTED))
def test_route_kernel_fuses_the_router_it_computes(case: str) -> None:
    decl = ROUTED_ACCEPTED[case]()
    assert ROUTE.fits(decl) and routed_spec(decl) is not None


@pytest.mark.parametrize("case", sorted(ROUTED_DECLINED))
def test_route_kernel_declines_a_router_differing_in_one_property(case: str) -> None:
    assert routed_spec(ROUTED_DECLINED[case]()) is None


def test_a_router_is_one_ungated_projection() -> None:
    with pytest.raises(ValueError, match="one projection"):
        Route(8, 2, router=Projections([linear(), linear()], gate="silu"))


@pytest.mark.parametrize("case", sorted(ROUTE_ACCEPTED))
def test_route_kernel_accepts_what_it_computes(case: str) -> None:
    assert ROUTE.fits(ROUTE_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(ROUTE_DECLINED))
def test_route_kernel_declines_a_declaration_differing_in_one_property(case: str) -> None:
    assert not ROUTE.fits(ROUTE_DECLINED[case]())


@pytest.mark.parametrize("cls", [GateUp, DownCombine], ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", sorted(EXPERTS_ACCEPTED))
def test_experts_kernel_accepts_what_it_computes(case: str, cls: type[GateUp] | type[DownCombine]) -> None:
    assert experts_fits_decl(EXPERTS_ACCEPTED[case](cls))


@pytest.mark.parametrize("cls", [GateUp, DownCombine], ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", sorted(EXPERTS_DECLINED))
def test_experts_kernel_declines_a_declaration_differing_in_one_property(
    case: str, cls: type[GateUp] | type[DownCombine]
) -> None:
    assert not experts_fits_decl(EXPERTS_DECLINED[case](cls))


def _offset_norm() -> OffsetRmsNorm:
    n = OffsetRmsNorm(256)
    n.weight = n.weight.astype(mx.bfloat16)
    return n


def _offset_norm_experts() -> GateUp | DownCombine:
    return experts(GateUp, norm=_offset_norm())


GATE_UP_NORM_DECLINED: dict[str, Callable[[], GateUp | DownCombine]] = {
    "offset (Gemma) norm": _offset_norm_experts,
    "norm weight float32": lambda: experts(GateUp, norm=norm(256, mx.float32)),
    "norm over another width": lambda: experts(GateUp, norm=norm(128)),
}


def test_experts_kernel_accepts_a_declared_rms_norm() -> None:
    for bits in (None, 4, 8):
        assert experts_fits_decl(experts(GateUp, bits=bits, norm=norm(256)))


@pytest.mark.parametrize("case", sorted(GATE_UP_NORM_DECLINED))
def test_experts_kernel_declines_a_norm_differing_in_one_property(case: str) -> None:
    assert not experts_fits_decl(GATE_UP_NORM_DECLINED[case]())


def test_experts_kernel_declines_another_gate_activation() -> None:
    assert experts_fits_decl(experts(GateUp, activation="silu"))
    assert not experts_fits_decl(experts(GateUp, activation="gpt_oss_swiglu"))


def chain(*, up: dict[str, object] | None = None, down: dict[str, object] | None = None,
          hidden: int = 128) -> DownCombine:
    """A DownCombine declaring its GateUp (qwen3_moe's experts, small): both 4-bit g64 bf16
    unless `up` / `down` change one property of either."""
    first = experts(GateUp, **{"bits": 4, "rows": hidden, **(up or {})})
    assert isinstance(first, GateUp)
    decl = experts(DownCombine, **{"bits": 4, "d_in": hidden, "rows": 256, "gate_up": first,
                                   **(down or {})})
    assert isinstance(decl, DownCombine)
    return decl


CHAIN_ACCEPTED: dict[str, Callable[[], DownCombine]] = {
    "affine 4-bit g64": lambda: chain(),
    "affine 8-bit g128": lambda: chain(up={"bits": 8, "group_size": 128},
                                      down={"bits": 8, "group_size": 128}),
    "dense bf16": lambda: chain(up={"bits": None}, down={"bits": None}),
    "gate/up with its RMS norm": lambda: chain(up={"norm": norm(256)}),
}
CHAIN_DECLINED: dict[str, Callable[[], DownCombine]] = {
    "no gate_up declared": lambda: cast(DownCombine, experts(DownCombine, bits=4, d_in=128)),
    "gate/up 8-bit": lambda: chain(up={"bits": 8}),
    "gate/up group size 32": lambda: chain(up={"group_size": 32}),
    "gate/up in float16": lambda: chain(up={"dtype": mx.float16}),
    "gate/up dense": lambda: chain(up={"bits": None}),
    "gate/up another activation": lambda: chain(up={"activation": "gpt_oss_swiglu"}),
    "gate/up bias": lambda: chain(up={"bias": True}),
    "down bias": lambda: chain(down={"bias": True}),
    "down reads another width": lambda: chain(down={"d_in": 64}),
    "gate/up norm of another kind": lambda: chain(up={"norm": _offset_norm()}),
}


@pytest.mark.parametrize("case", sorted(CHAIN_ACCEPTED))
def test_experts_chain_accepts_the_pair_it_computes(case: str) -> None:
    assert EXPERTS_CHAIN.fits(CHAIN_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(CHAIN_DECLINED))
def test_experts_chain_declines_a_pair_differing_in_one_property(case: str) -> None:
    assert not EXPERTS_CHAIN.fits(CHAIN_DECLINED[case]())


def test_experts_chain_declines_more_selected_experts_than_one_block_stages() -> None:
    """Both staged inputs share one block's static shared memory: k * hidden + in <= 10240."""
    decl = chain(hidden=1024)
    assert chain_specs(decl, 8) is not None  # 256 + 8 * 1024
    assert chain_specs(decl, 10) is None  # 256 + 10 * 1024


def test_a_chained_down_projection_runs_its_gate_up_first() -> None:
    """With gate_up declared, DownCombine takes the gate/up projection's input: its core path
    is down(gate_up(x)), as the two declarations called one after the other compute it."""
    decl = chain(up={"bits": None, "dtype": mx.float32}, down={"bits": None, "dtype": mx.float32})
    up = decl.gate_up
    assert up is not None
    up.weight = mx.random.normal(up.weight.shape, key=mx.random.key(1)) * 0.1
    decl.weight = mx.random.normal(decl.weight.shape, key=mx.random.key(2)) * 0.1
    up.bind()
    decl.bind()
    x = mx.random.normal((1, 1, 256), key=mx.random.key(3))
    ids = mx.array([[[3, 5]]], dtype=mx.uint32)
    weights = mx.array([[[0.25, 0.75]]])
    alone = DownCombine(8, 128, 256)
    alone.weight = decl.weight
    alone.bind()
    want = alone(up(x, ids), ids, weights, residual=x)
    got = decl(x, ids, weights, residual=x)
    assert got.shape == want.shape == (1, 1, 256)
    assert mx.array_equal(got, want)


def project_route(*, project: dict[str, object] | None = None,
                  route: dict[str, object] | None = None) -> ProjectRoute:
    """qwen3_moe's o_proj (4096 -> 256 here, 4-bit) then its routing of the sum (128 experts,
    4-bit router after the RMS norm), unless `project` / `route` change one property."""
    return ProjectRoute(linear(**{"k": 4096, "n": 256, "bits": 4, **(project or {})}),  # type: ignore[arg-type]
                        routed(**{"bits": 4, **(route or {})}))  # type: ignore[arg-type]


PROJECT_ROUTE_ACCEPTED: dict[str, Callable[[], ProjectRoute]] = {
    "4-bit o_proj, 4-bit router": lambda: project_route(),
    "8-bit o_proj, dense router": lambda: project_route(project={"bits": 8},
                                                        route={"bits": None}),
    "dense o_proj and router": lambda: project_route(project={"bits": None},
                                                     route={"bits": None}),
    "60 experts": lambda: project_route(route={"n": 60}),
}
PROJECT_ROUTE_DECLINED: dict[str, Callable[[], ProjectRoute]] = {
    "o_proj with a bias": lambda: project_route(project={"bias": True}),
    "o_proj in float16": lambda: project_route(project={"dtype": mx.float16}),
    "o_proj 3-bit": lambda: project_route(project={"bits": 3}),
    "o_proj writes another width": lambda: project_route(project={"n": 512}),
    "router with a bias": lambda: project_route(route={"bias": True}),
    "router norm of another kind": lambda: project_route(route={"router_norm": _offset_norm()}),
    "129 experts (past one block)": lambda: project_route(route={"n": 129}),
    "both inputs past the shared-memory stage": lambda: project_route(project={"k": 10240}),
}


@pytest.mark.parametrize("case", sorted(PROJECT_ROUTE_ACCEPTED))
def test_project_route_accepts_the_pair_it_computes(case: str) -> None:
    assert PROJECT_ROUTE.fits(PROJECT_ROUTE_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(PROJECT_ROUTE_DECLINED))
def test_project_route_declines_a_pair_differing_in_one_property(case: str) -> None:
    assert not PROJECT_ROUTE.fits(PROJECT_ROUTE_DECLINED[case]())


def test_project_route_needs_a_route_declaring_its_router() -> None:
    with pytest.raises(ValueError, match="router"):
        ProjectRoute(linear(4096, 256), Route(128, 8))


def test_project_route_is_the_projection_then_the_routing() -> None:
    """The core path: h = residual + o_proj(a), then route(h), each declaration as bound."""
    decl = project_route(project={"bits": None, "dtype": mx.float32},
                         route={"bits": None, "dtype": mx.float32, "router_norm": norm(256, mx.float32)})
    decl.project.weight = mx.random.normal(decl.project.weight.shape, key=mx.random.key(1)) * 0.02
    gate = decl.route.router.matrices[0] if decl.route.router is not None else None
    assert gate is not None
    gate.weight = mx.random.normal(gate.weight.shape, key=mx.random.key(2))
    for d in (decl.project, decl.route, decl):
        d.bind()
    a = mx.random.normal((1, 1, 4096), key=mx.random.key(3))
    x = mx.random.normal((1, 1, 256), key=mx.random.key(4))
    h, weights, ids = decl(a, x)
    want_h = decl.project(a, residual=x)
    want_w, want_ids = decl.route(want_h)
    assert mx.array_equal(h, want_h) and mx.array_equal(weights, want_w)
    assert mx.array_equal(ids, want_ids) and ids.shape == (1, 1, 8)


def route_experts(*, up: dict[str, object] | None = None, down: dict[str, object] | None = None,
                  route: dict[str, object] | None = None, shared_norm: bool = True,
                  n_experts: int = 8, k_in: int = 4096) -> RouteExperts:
    """qwen3_moe's sparse block after the attention (small): o_proj (4096 -> 256, 4-bit), the
    routing of the sum (a 4-bit router after the post-attention norm), then the experts
    (4-bit, gate/up after that same norm), unless the arguments change one property."""
    post = norm(256)
    pair = ProjectRoute(linear(k_in, 256, bits=4),
                        routed(n_experts, router_norm=post, **{"bits": 4, **(route or {})}))  # type: ignore[arg-type]
    experts = chain(up={"norm": post if shared_norm else norm(256), **(up or {})}, down=down)
    return RouteExperts(pair, experts)


ROUTE_EXPERTS_ACCEPTED: dict[str, Callable[[], RouteExperts]] = {
    "4-bit": lambda: route_experts(),
    "dense experts and router": lambda: route_experts(up={"bits": None}, down={"bits": None},
                                                      route={"bits": None}),
    # its own launch would take 4 warps (8 lanes a row); here it runs at the experts' 8
    "short 4-bit projection": lambda: route_experts(k_in=256),
}
ROUTE_EXPERTS_DECLINED: dict[str, Callable[[], RouteExperts]] = {
    "gate/up after another norm": lambda: route_experts(shared_norm=False),
    "gate/up without a norm": lambda: route_experts(up={"norm": None}),
    "more experts routed than stacked": lambda: route_experts(n_experts=16),
    "router with a bias": lambda: route_experts(route={"bias": True}),
    "gate/up 8-bit": lambda: route_experts(up={"bits": 8}),
    "down bias": lambda: route_experts(down={"bias": True}),
}


@pytest.mark.parametrize("case", sorted(ROUTE_EXPERTS_ACCEPTED))
def test_route_experts_accepts_the_chain_it_computes(case: str) -> None:
    assert ROUTE_EXPERTS.fits(ROUTE_EXPERTS_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(ROUTE_EXPERTS_DECLINED))
def test_route_experts_declines_a_chain_differing_in_one_property(case: str) -> None:
    assert not ROUTE_EXPERTS.fits(ROUTE_EXPERTS_DECLINED[case]())


def test_route_experts_runs_the_projection_at_the_experts_block_size() -> None:
    """The four phases share one block size: a projection whose own launch takes 4 warps runs
    with 8, its lanes (which set its sums) unchanged."""
    decl = route_experts(k_in=256)
    own = project_route_specs(decl.project_route)
    specs = route_experts_specs(decl)
    assert own is not None and specs is not None
    assert own[0].config.warps == 4 and specs[0].config.warps == 8
    assert specs[0].config.lanes == own[0].config.lanes
    assert replace(specs[0], launch=None) == replace(own[0], launch=None)


def test_route_experts_binds_on_a_gpu_unless_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never on the CPU; on a GPU unless OMNIA_ROUTE_EXPERTS=0 (A/B runs)."""
    monkeypatch.delenv("OMNIA_ROUTE_EXPERTS", raising=False)
    assert ROUTE_EXPERTS.applies(route_experts()) == cuda_backend()
    monkeypatch.setenv("OMNIA_ROUTE_EXPERTS", "0")
    assert not ROUTE_EXPERTS.applies(route_experts())


def test_route_experts_is_project_route_then_the_experts() -> None:
    """The core path: (h, weights, ids) = project_route(a, x), then experts(h, ids, weights,
    residual=h), each declaration as bound."""
    decl = route_experts()
    pair, experts = decl.project_route, decl.experts
    gate_up, router = experts.gate_up, pair.route.router
    assert gate_up is not None and router is not None
    for i, m in enumerate((gate_up, experts)):  # random 4-bit experts (the helper's are zeros)
        key = mx.random.key(10 + i)
        m.weight = mx.random.randint(0, 2**30, m.weight.shape, key=key).astype(mx.uint32)
        m.scales = (0.02 * mx.random.uniform(shape=m.scales.shape, key=key)).astype(mx.bfloat16)
        m.biases = (-0.1 * m.scales.astype(mx.float32) * 8).astype(mx.bfloat16)
    for d in (*router.matrices, router, pair.project, pair.route, pair, gate_up, experts, decl):
        d.bind()
    a = mx.random.normal((1, 1, 4096), key=mx.random.key(3)).astype(mx.bfloat16)
    x = mx.random.normal((1, 1, 256), key=mx.random.key(4)).astype(mx.bfloat16)
    got = decl(a, x)
    h, weights, ids = pair(a, x)
    want = experts(h, ids, weights, residual=h)
    assert got.shape == want.shape == (1, 1, 256)
    assert mx.array_equal(got, want) and not mx.array_equal(got, h)


def chained_qmv(*, project: dict[str, object] | None = None, then: dict[str, object] | None = None,
                gate: str | None = "silu", with_norm: bool = True) -> ChainedProjections:
    """qwen3's o_proj (4096 -> 2560, 4-bit) then its gate/up (2560 -> 2 x 9728, 4-bit, after
    the RMS norm, silu), unless `project` / `then` change one property."""
    o_proj = linear(**{"k": 4096, "n": 2560, "bits": 4, **(project or {})})  # type: ignore[arg-type]
    cfg = {"k": 2560, "n": 9728, "bits": 4, **(then or {})}
    pair = [linear(**cfg), linear(**cfg)]  # type: ignore[arg-type]
    nrm = norm(int(cast(int, cfg["k"])), cast(mx.Dtype, cfg.get("dtype", mx.bfloat16))) if with_norm else None
    return ChainedProjections(o_proj, Projections(pair, norm=nrm, gate=gate))  # type: ignore[arg-type]


CHAINED_ACCEPTED: dict[str, Callable[[], ChainedProjections]] = {
    "4-bit o_proj, 4-bit gate/up after the norm": lambda: chained_qmv(),
    "dense bf16": lambda: chained_qmv(project={"bits": None}, then={"bits": None}),
    "gelu_tanh gate": lambda: chained_qmv(gate="gelu_tanh"),
    "gate/up without a norm": lambda: chained_qmv(with_norm=False),
    "8-bit o_proj, 4-bit gate/up": lambda: chained_qmv(project={"bits": 8}),
}
CHAINED_DECLINED: dict[str, Callable[[], ChainedProjections]] = {
    "o_proj with a bias": lambda: chained_qmv(project={"bias": True}),
    "o_proj in float16": lambda: chained_qmv(project={"dtype": mx.float16}),
    "o_proj 3-bit": lambda: chained_qmv(project={"bits": 3}),
    "o_proj writes another width": lambda: chained_qmv(project={"n": 2048}),
    "gate/up with a bias": lambda: chained_qmv(then={"bias": True}),
    "gate/up in float16": lambda: chained_qmv(then={"dtype": mx.float16}),
    "another block size (a 256-wide 4-bit gate/up runs 4 warps)": lambda: chained_qmv(
        project={"n": 256}, then={"k": 256}),
    "both inputs past the shared-memory stage": lambda: chained_qmv(
        project={"k": 8192, "n": 4096}, then={"k": 4096}),
}


@pytest.mark.parametrize("case", sorted(CHAINED_ACCEPTED))
def test_chained_qmv_accepts_the_pair_it_computes(case: str) -> None:
    assert CHAINED_QMV.fits(CHAINED_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(CHAINED_DECLINED))
def test_chained_qmv_declines_a_pair_differing_in_one_property(case: str) -> None:
    assert not CHAINED_QMV.fits(CHAINED_DECLINED[case]())


def test_chained_projections_are_the_projection_then_the_projections() -> None:
    """The core path: h = residual + o_proj(a), then gate/up of norm(h), each as bound."""
    decl = chained_qmv(project={"bits": None, "dtype": mx.float32, "k": 256, "n": 128},
                       then={"bits": None, "dtype": mx.float32, "k": 128, "n": 64})
    decl.project.weight = mx.random.normal(decl.project.weight.shape, key=mx.random.key(1)) * 0.1
    for i, m in enumerate(decl.then.matrices):
        m.weight = mx.random.normal(m.weight.shape, key=mx.random.key(2 + i)) * 0.1
    for d in (decl.project, decl.then, decl):
        d.bind()
    a = mx.random.normal((1, 1, 256), key=mx.random.key(5))
    x = mx.random.normal((1, 1, 128), key=mx.random.key(6))
    h, act = decl(a, x)
    want_h = decl.project(a, residual=x)
    (want_act,) = decl.then(want_h)
    assert mx.array_equal(h, want_h) and mx.array_equal(act, want_act)
    assert act.shape == (1, 1, 64)


def project_attend(*, qkv: dict[str, object] | None = None, with_norm: bool = True,
                   **att: object) -> ProjectAttend:
    """qwen3-4b's q/k/v (2560 -> 4096 + 1024 + 1024, 4-bit, after the RMS norm) then its
    attention (32 heads, 8 kv heads, head norms), unless one property is changed."""
    cfg: dict[str, object] = {"k": 2560, "bits": 4, **(qkv or {})}
    dims = cast(int, att.get("head_dim", 128))
    heads, kv = cast(int, att.get("n_heads", 32)), cast(int, att.get("n_kv_heads", 8))
    rows = cast(tuple[int, int, int], cfg.pop("rows", (heads * dims, kv * dims, kv * dims)))
    mats = [linear(n=n, **cfg) for n in rows]  # type: ignore[arg-type]
    dtype = cast(mx.Dtype, cfg.get("dtype", mx.bfloat16))
    nrm = norm(cast(int, cfg["k"]), dtype) if with_norm else None
    return ProjectAttend(Projections(mats, norm=nrm), attention(**att))


PROJECT_ATTEND_ACCEPTED: dict[str, Callable[[], ProjectAttend]] = {
    "qwen3-4b 4-bit": lambda: project_attend(),
    "qwen3-30b-a3b 4-bit (8 query heads a kv head, K 2048)": lambda: project_attend(
        qkv={"k": 2048}, n_kv_heads=4),
    "K 8192, 8 query heads a kv head (split over two blocks: half the attention's shared "
    "memory)": lambda: project_attend(qkv={"k": 8192}, n_kv_heads=4),
    "dense bf16": lambda: project_attend(qkv={"bits": None}),
    "q/k/v without a norm": lambda: project_attend(with_norm=False),
    "llama (no head norms, head 64)": lambda: project_attend(
        n_kv_heads=4, head_dim=64, q_norm=None, k_norm=None, rope=Rope(64, base=5e5)),
}
PROJECT_ATTEND_DECLINED: dict[str, Callable[[], ProjectAttend]] = {
    "q/k/v with a bias": lambda: project_attend(qkv={"bias": True}),
    "q/k/v in float16, attention norms in bf16": lambda: project_attend(qkv={"dtype": mx.float16}),
    "q/k/v 3-bit": lambda: project_attend(qkv={"bits": 3}),
    "q narrower than the attention's heads": lambda: project_attend(
        qkv={"rows": (2048, 1024, 1024)}),
    "sliding-window attention": lambda: project_attend(window=4096),
    "soft-capped attention": lambda: project_attend(softcap=50.0),
    "both staged inputs past one block's shared memory (K 8192, 7 query heads a kv head: an "
    "odd group, one block a slice)":
        lambda: project_attend(qkv={"k": 8192}, n_heads=28, n_kv_heads=4),
}


@pytest.mark.parametrize("case", sorted(PROJECT_ATTEND_ACCEPTED))
def test_project_attend_accepts_the_pair_it_computes(case: str) -> None:
    assert PROJECT_ATTEND.fits(PROJECT_ATTEND_ACCEPTED[case]())


@pytest.mark.parametrize("case", sorted(PROJECT_ATTEND_DECLINED))
def test_project_attend_declines_a_pair_differing_in_one_property(case: str) -> None:
    assert not PROJECT_ATTEND.fits(PROJECT_ATTEND_DECLINED[case]())


def test_project_attend_is_the_projections_then_the_attention() -> None:
    """The core path: q, k, v of norm(x), then the attention step of them, each as bound; the
    cache advances once."""
    from mlx_omnia.engine.core.cache import KVCache

    decl = project_attend(qkv={"bits": None, "dtype": mx.float32, "k": 64}, n_heads=4,
                          n_kv_heads=2, head_dim=32, q_norm=norm(32, mx.float32),
                          k_norm=norm(32, mx.float32), rope=Rope(32, base=1e4))
    assert decl.qkv.norm is not None
    decl.qkv.norm.weight = decl.qkv.norm.weight.astype(mx.float32)
    for i, m in enumerate(decl.qkv.matrices):
        m.weight = mx.random.normal(m.weight.shape, key=mx.random.key(1 + i)) * 0.1
    for d in (decl.qkv, decl.attention, decl):
        d.bind()
    x = mx.random.normal((1, 3, 64), key=mx.random.key(7))
    mine, theirs = KVCache(), KVCache()
    got = decl(x, mine)
    want = decl.attention(*decl.qkv(x), theirs)
    assert got.shape == (1, 3, 4 * 32) and mx.array_equal(got, want)
    assert mine.offset == theirs.offset == 3


class _Pair(Declaration):
    """A declaration with a chained kernel and a plain one registered, both always applying."""

    def reference(self) -> Callable[[], str]:
        return lambda: "core"


class _Always(Kernel[Declaration]):
    """A kernel that applies to any declaration of its type and returns its own name."""

    def __init__(self, name: str, declaration: type[Declaration], *, chained: bool = False,
                 build: Callable[[Any], Callable[[], str]] | None = None) -> None:
        self.name, self.declaration, self.chained = name, declaration, chained
        self._build = build

    def fits(self, decl: Declaration) -> bool:
        return True

    def applies(self, decl: Declaration) -> bool:
        return True

    def build(self, decl: Declaration) -> Callable[[], str]:
        if self._build is not None:
            return self._build(decl)
        name = self.name
        return lambda: name


register(_Always("pair_chained", _Pair, chained=True))
register(_Always("pair_plain", _Pair))


def test_chained_implementations_can_be_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """bind(chained=False) / bind_layers with OMNIA_CHAINED_KERNELS=0 skips implementations that
    run two declarations in one launch (A/B runs: omnia-bench --unchained)."""
    decl = _Pair()
    assert decl.bind() == "pair_chained"
    assert decl.bind(chained=False) == "pair_plain"
    holder = nn.Module()
    holder.pair = decl
    monkeypatch.setenv("OMNIA_CHAINED_KERNELS", "0")
    assert bind_layers(holder) == {"pair": "pair_plain"}
    monkeypatch.setenv("OMNIA_CHAINED_KERNELS", "1")
    assert bind_layers(holder) == {"pair": "pair_chained"}
    assert bind_layers(holder, force_reference=True) == {"pair": "core"}


TAKEN: list[tuple[int, mx.array]] = []  # (bytes asked, the scratch taken), in binding order


def _take_scratch(decl: _Scratched) -> Callable[[], str]:
    TAKEN.append((decl.nbytes, launch_scratch(decl.nbytes)))
    return lambda: "kernel"


class _Scratched(Declaration):
    """A declaration whose one kernel takes a launch scratch when it is built."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes = nbytes

    def reference(self) -> Callable[[], str]:
        return lambda: "core"


register(_Always("scratched", _Scratched, build=_take_scratch))


def test_one_models_bindings_share_a_launch_scratch_and_independent_ones_do_not() -> None:
    """bind_layers opens a scratch scope: a model's bindings share one buffer (its decode
    launches run one after another), grown to the largest request. Outside a scope, and in
    another model, each gets its own (MLX may run independent launches at once)."""
    TAKEN.clear()
    holder = nn.Module()
    holder.layers = [_Scratched(n) for n in (64, 64, 4096, 100, 64)]
    bind_layers(holder)
    assert len(TAKEN) == 5
    shared = 0
    for (_, before), (asked, taken) in itertools.pairwise(TAKEN):
        assert taken.dtype == mx.float32 and taken.size * 4 >= asked
        if before.size * 4 >= asked:  # fits the scope's buffer: that buffer
            assert taken is before
            shared += 1
        else:  # grown: a new buffer
            assert taken is not before
    assert shared >= 2
    model_buffers = {id(b) for _, b in TAKEN}
    other = nn.Module()
    other.layers = [_Scratched(64)]
    bind_layers(other)
    assert id(TAKEN[-1][1]) not in model_buffers
    assert launch_scratch(64) is not launch_scratch(64)  # no scope: one buffer a call
    made = own_scratch(64)
    assert made() is made() and made() is not own_scratch(64)()


# --- the CPU backend ----------------------------------------------------------------------------
@on_cpu
def test_no_cuda_kernel_applies_on_the_cpu() -> None:
    assert not QMV_LINEAR.applies(LINEAR_ACCEPTED["dense bf16"]())
    assert not QMV_PROJECTIONS.applies(PROJECTIONS_ACCEPTED["q/k/v after an RMS norm"]())
    assert not ATTENTION_STEP.applies(ATTENTION_ACCEPTED["qwen3 (head norms, GQA 4)"]())
    assert not ROUTE.applies(ROUTE_ACCEPTED["128 experts, top 8, renormalized"]())
    assert not EXPERTS_GATE_UP.applies(cast(GateUp, EXPERTS_ACCEPTED["affine 4-bit g64"](GateUp)))
    assert not EXPERTS_DOWN.applies(
        cast(DownCombine, EXPERTS_ACCEPTED["affine 4-bit g64"](DownCombine)))
    assert not EXPERTS_CHAIN.applies(CHAIN_ACCEPTED["affine 4-bit g64"]())
    assert not PROJECT_ROUTE.applies(PROJECT_ROUTE_ACCEPTED["4-bit o_proj, 4-bit router"]())
    assert not CHAINED_QMV.applies(CHAINED_ACCEPTED["4-bit o_proj, 4-bit gate/up after the norm"]())
    assert not PROJECT_ATTEND.applies(PROJECT_ATTEND_ACCEPTED["qwen3-4b 4-bit"]())


@on_cpu
def test_loaded_models_bind_only_core_implementations_on_the_cpu(tiny_llama_dir: object) -> None:
    from mlx_omnia import load

    model = load(str(tiny_llama_dir), dtype="bfloat16")
    assert model.bindings()
    assert set(model.bindings().values()) == {"core"}
    assert bind_layers(model.network) == model.bindings()


# --- kernel headers: written once, included by path -------------------------------------------
def test_a_kernel_header_is_included_from_a_file_named_by_its_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLX hashes a custom kernel's whole source at every launch: the header goes to a file and
    the source includes it; the file's name is the content's hash, so another header is another
    file (and another source to MLX)."""
    monkeypatch.setenv("OMNIA_KERNEL_HEADERS", str(tmp_path / "h"))
    header = "// test header one\n__device__ int omnia_test_one() { return 1; }\n"
    line = header_include(header)
    assert line.startswith('#include "') and line.endswith('"\n')
    path = Path(line[len('#include "'):-2])
    assert path.parent == tmp_path / "h"
    assert path.read_text() == header
    assert hashlib.sha256(header.encode()).hexdigest()[:32] in path.name
    other = header_include(header + "// two\n")
    assert other != line and Path(other[len('#include "'):-2]).read_text() == header + "// two\n"


def test_a_kernel_header_file_with_other_content_is_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIA_KERNEL_HEADERS", str(tmp_path))
    header = "// test header three\n"
    path = tmp_path / f"omnia-{hashlib.sha256(header.encode()).hexdigest()[:32]}.cuh"
    path.write_text("// truncated")
    assert header_include(header) == f'#include "{path}"\n'
    assert path.read_text() == header


def test_a_kernel_header_stays_inline_where_no_file_can_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OMNIA_KERNEL_HEADERS", str(blocker / "below"))
    header = "// test header four\n"
    assert header_include(header) == header
