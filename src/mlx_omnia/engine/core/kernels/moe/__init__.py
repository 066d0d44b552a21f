"""Mixture-of-experts kernels bound to Route, GateUp and DownCombine (and their chained pairs):
each accepts only what it computes exactly (docs/kernels.md lists what they decline), and the
bound calls run one token (or a batch's rows), handing anything else to the core (the experts'
core calls grouped by expert, as kernels/grouped_experts binds them on any GPU)."""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx

from mlx_omnia.engine.core.binding import register
from mlx_omnia.engine.core.kernels import CudaKernel, cuda_backend, launch_counters, launch_scratch
from mlx_omnia.engine.core.kernels.cuda_common import CUDA_TYPES
from mlx_omnia.engine.core.kernels.moe.cuda import (
    MAX_BATCH_ROWS,
    MAX_TOP_K,
    ExpertsSpec,
    RouteSpec,
    chain_fits,
    chain_launcher,
    experts_fits,
    experts_launcher,
    experts_rows_launcher,
    project_route_fits,
    project_route_launcher,
    route_experts_fits,
    route_experts_launcher,
    route_experts_project,
    route_experts_scratch,
    route_fits,
    route_launcher,
    route_rows_launcher,
    routed_fits,
    routed_launcher,
)
from mlx_omnia.engine.core.kernels.qmv import linear_spec, matrix_inputs, projections_spec
from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec
from mlx_omnia.engine.core.layers import RmsNorm
from mlx_omnia.engine.core.moe import (
    DownCombine,
    ExpertLinear,
    GateUp,
    ProjectRoute,
    Route,
    RouteExperts,
)
from mlx_omnia.engine.core.mxcompat import evaluate


def route_spec(decl: Route, dtype: mx.Dtype) -> RouteSpec:
    return RouteSpec(dtype=dtype, n_experts=decl.n_experts, top_k=decl.top_k,
                     topk_first=decl.order == "topk_softmax", normalize=decl.normalize)


def routed_spec(decl: Route) -> tuple[RouteSpec, QmvSpec] | None:
    """(routing, router GEMV) for the one-launch router + routing, or None when the declared
    router is not one the kernel computes (a bias, a mixed format, Gemma's norm, over
    ROUTED_MAX_EXPERTS rows)."""
    if decl.router is None:
        return None
    router = projections_spec(decl.router)
    if router is None:
        return None
    spec = route_spec(decl, router.dtype)
    return (spec, router) if routed_fits(spec, router) else None


class RouteKernel(CudaKernel[Route]):
    """Top-k routing of one row of logits (or of the declared router's logits of h: the router
    GEMV and the routing) in one launch."""

    name = "route_cuda"
    declaration = Route

    def fits(self, decl: Route) -> bool:
        return route_fits(route_spec(decl, mx.bfloat16))

    def build(self, decl: Route) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
        reference_logits = decl.reference_logits()

        def route(logits: mx.array) -> tuple[mx.array, mx.array]:
            rows = logits.size // decl.n_experts
            if (
                rows > 1 and logits.shape[-1] == decl.n_experts and rows <= MAX_BATCH_ROWS
                and logits.dtype in CUDA_TYPES
            ):
                return route_rows_launcher(route_spec(decl, logits.dtype), rows,
                                           tuple(logits.shape[:-1]))(logits)
            if logits.size != decl.n_experts or logits.dtype not in CUDA_TYPES:
                return reference_logits(logits)
            return route_launcher(route_spec(decl, logits.dtype), tuple(logits.shape[:-1]))(logits)

        router = decl.router
        if router is None:
            return route
        fused = routed_spec(decl)

        def routed(h: mx.array) -> tuple[mx.array, mx.array]:
            if fused is not None and h.size == fused[1].k and h.dtype == fused[1].dtype:
                inputs = [h, *matrix_inputs(router.matrices[0])]
                if router.norm is not None:
                    inputs.append(router.norm.weight)
                return routed_launcher(*fused, tuple(h.shape[:-1]))(inputs)
            (logits,) = router(h)  # the router's own binding, then the routing kernel
            return route(logits)

        return routed


def expert_format(decl: ExpertLinear) -> tuple[mx.Dtype, int | None, int | None] | None:
    """(activation dtype, bits, group size) of stacked expert matrices; None when the kernels
    cannot take them (mxfp4, a per-expert bias, scales and biases of two dtypes)."""
    if decl.has_bias or decl.mode != "affine":
        return None
    if decl.bits is None:
        return decl.weight.dtype, None, None
    if decl.scales.dtype != decl.biases.dtype:
        return None
    return decl.scales.dtype, decl.bits, decl.group_size


def experts_spec(decl: GateUp | DownCombine, top_k: int, *, residual: bool = False) -> ExpertsSpec | None:
    fmt = expert_format(decl)
    if fmt is None:
        return None
    dtype, bits, group = fmt
    norm_eps: float | None = None
    if isinstance(decl, GateUp):
        if decl.activation != "silu":
            return None
        norm = decl.norm
        if norm is not None:
            # only a plain RMS norm over the input, its weight in the activation dtype
            if (type(norm) is not RmsNorm or norm.weight.dtype != dtype
                    or tuple(norm.weight.shape) != (decl.input_dims,)):
                return None
            norm_eps = norm.eps
        rows = decl.hidden_dims
    else:
        rows = decl.output_dims
    return ExpertsSpec(dtype=dtype, k=decl.input_dims, rows=rows, top_k=top_k, bits=bits,
                       group_size=group, gate_up=isinstance(decl, GateUp), residual=residual,
                       norm_eps=norm_eps)


def experts_fits_decl(decl: GateUp | DownCombine) -> bool:
    """Every declared property is one the kernel computes (the backend aside; the number of
    selected experts is Route's, checked per call)."""
    spec = experts_spec(decl, 1)
    return spec is not None and experts_fits(spec)


def _weights(decl: ExpertLinear) -> list[mx.array]:
    return [decl.weight] if decl.bits is None else [decl.weight, decl.scales, decl.biases]


def _fitted(decl: GateUp | DownCombine) -> Callable[[int, bool], ExpertsSpec | None]:
    """The kernel spec for k selected experts (with or without the residual), or None where the
    kernel cannot take that k; worked out once per (k, residual)."""
    specs: dict[tuple[int, bool], ExpertsSpec | None] = {}

    def fitted(top_k: int, residual: bool) -> ExpertsSpec | None:
        key = (top_k, residual)
        if key not in specs:
            spec = experts_spec(decl, top_k, residual=residual)
            specs[key] = spec if spec is not None and experts_fits(spec) else None
        return specs[key]

    return fitted


def _dtype(decl: ExpertLinear) -> mx.Dtype:
    """The activation dtype of a declaration the predicate accepted."""
    fmt = expert_format(decl)
    assert fmt is not None
    return fmt[0]


class ExpertsGateUp(CudaKernel[GateUp]):
    """silu(x G[e].T) * (x U[e].T) for the selected experts of one token (after the declared
    norm), in one launch."""

    name = "experts_cuda"
    declaration = GateUp

    def fits(self, decl: GateUp) -> bool:
        return experts_fits_decl(decl)

    def build(self, decl: GateUp) -> Callable[[mx.array, mx.array], mx.array]:
        reference = decl.reference(grouped=True)  # many rows: grouped by expert, as on any GPU
        dtype = _dtype(decl)
        fitted = _fitted(decl)

        def gate_up(x: mx.array, ids: mx.array) -> mx.array:
            top_k = ids.shape[-1] if ids.ndim else 0
            spec = fitted(top_k, False)
            rows = ids.size // top_k if top_k else 0
            if (
                spec is not None and 1 < rows <= MAX_BATCH_ROWS
                and x.shape[:-1] == ids.shape[:-1] and x.shape[-1] == decl.input_dims
                and x.dtype == dtype and ids.dtype == mx.uint32
            ):
                inputs = [x, ids, *_weights(decl)]
                if decl.norm is not None:
                    inputs.append(decl.norm.weight)
                return experts_rows_launcher(spec, rows, tuple(ids.shape[:-1]))(inputs)
            if (
                spec is None or x.size != decl.input_dims or ids.size != top_k
                or x.dtype != dtype or ids.dtype != mx.uint32
            ):
                return reference(x, ids)
            inputs = [x, ids, *_weights(decl)]
            if decl.norm is not None:
                inputs.append(decl.norm.weight)
            return experts_launcher(spec, tuple(ids.shape[:-1]))(inputs)

        return gate_up


class ExpertsDown(CudaKernel[DownCombine]):
    """The selected experts' down projections of one token, weighted and summed (+ residual), in
    one launch; a declared gate/up runs first on its own binding."""

    name = "experts_cuda"
    declaration = DownCombine

    def fits(self, decl: DownCombine) -> bool:
        return experts_fits_decl(decl)

    def build(self, decl: DownCombine) -> Callable[..., mx.array]:
        return decl.after_gate_up(_down_combine(decl))


def _down_combine(decl: DownCombine) -> Callable[..., mx.array]:
    reference = decl.reference_down(grouped=True)  # many rows: grouped by expert
    dtype = _dtype(decl)
    fitted = _fitted(decl)

    def down_combine(
        h: mx.array, ids: mx.array, weights: mx.array, residual: mx.array | None = None
    ) -> mx.array:
        top_k = ids.shape[-1] if ids.ndim else 0
        spec = fitted(top_k, residual is not None)
        rows = ids.size // top_k if top_k else 0
        if (
            spec is not None and 1 < rows <= MAX_BATCH_ROWS
            and h.shape == (*ids.shape, decl.input_dims) and weights.shape == ids.shape
            and h.dtype == dtype and weights.dtype == dtype and ids.dtype == mx.uint32
            and (residual is None
                 or (residual.dtype == dtype and residual.shape == (*ids.shape[:-1], decl.output_dims)))
        ):
            inputs = [h, ids, weights, *_weights(decl)]
            if residual is not None:
                inputs.append(residual)
            return experts_rows_launcher(spec, rows, tuple(h.shape[:-2]))(inputs)
        if (
            spec is None or h.size != top_k * decl.input_dims or ids.size != top_k
            or weights.size != top_k or h.dtype != dtype or weights.dtype != dtype
            or ids.dtype != mx.uint32
            or (residual is not None
                and (residual.dtype != dtype or residual.size != decl.output_dims))
        ):
            return reference(h, ids, weights, residual)
        inputs = [h, ids, weights, *_weights(decl)]
        if residual is not None:
            inputs.append(residual)
        return experts_launcher(spec, tuple(h.shape[:-2]))(inputs)

    return down_combine


def chain_specs(decl: DownCombine, top_k: int, *, residual: bool = False
                ) -> tuple[ExpertsSpec, ExpertsSpec] | None:
    """(gate/up, down) specs of the one-launch chain for a DownCombine declaring its gate_up,
    or None where chain_launcher does not compute the pair exactly."""
    if decl.gate_up is None:
        return None
    up = experts_spec(decl.gate_up, top_k)
    down = experts_spec(decl, top_k, residual=residual)
    if up is None or down is None or not chain_fits(up, down):
        return None
    return up, down


class ExpertsChain(CudaKernel[DownCombine]):
    """A DownCombine's declared gate/up, then its down projections, in one launch."""

    name = "experts_chain_cuda"
    declaration = DownCombine
    chained = True

    def fits(self, decl: DownCombine) -> bool:
        """The declared gate_up and down are a pair the chain computes (the number of selected
        experts is Route's, checked per call)."""
        return chain_specs(decl, 1) is not None

    def build(self, decl: DownCombine) -> Callable[..., mx.array]:
        """Gate/up and down in one launch for one token; anything else goes through the gate_up
        declaration's binding and the down kernel (or the core)."""
        gate_up = decl.gate_up
        assert gate_up is not None
        separate = decl.after_gate_up(_down_combine(decl))
        dtype = _dtype(decl)
        specs: dict[tuple[int, bool], tuple[ExpertsSpec, ExpertsSpec] | None] = {}
        # the chained launch's tickets and counts, zero between launches (the last block zeroes them);
        # written in place, so owned here: one array per declaration
        counters = launch_counters(3)
        evaluate(counters)
        # the intermediate rows at the most selected experts, before any launch is traced
        scratch = launch_scratch(MAX_TOP_K * gate_up.hidden_dims * 4)

        def chained(
            x: mx.array, ids: mx.array, weights: mx.array, residual: mx.array | None = None
        ) -> mx.array:
            top_k = ids.shape[-1] if ids.ndim else 0
            key = (top_k, residual is not None)
            if key not in specs:
                specs[key] = chain_specs(decl, top_k, residual=residual is not None)
            pair = specs[key]
            if (
                pair is None or x.size != gate_up.input_dims or ids.size != top_k
                or weights.size != top_k or x.dtype != dtype or weights.dtype != dtype
                or ids.dtype != mx.uint32
                or (residual is not None
                    and (residual.dtype != dtype or residual.size != decl.output_dims))
            ):
                return separate(x, ids, weights, residual)
            inputs = [x, ids, weights, *_weights(gate_up), *_weights(decl)]
            if gate_up.norm is not None:
                inputs.append(gate_up.norm.weight)
            if residual is not None:
                inputs.append(residual)
            inputs.append(counters)
            return chain_launcher(*pair, tuple(x.shape[:-1]))(inputs, scratch)

        return chained


def project_route_specs(decl: ProjectRoute) -> tuple[QmvSpec, RouteSpec, QmvSpec] | None:
    """(projection with residual, routing, router) of the one-launch pair, or None where the
    kernel does not compute the declared pair exactly."""
    project = linear_spec(decl.project, residual=True)
    routed = routed_spec(decl.route)
    if project is None or routed is None or not project_route_fits(project, *routed):
        return None
    return project, *routed


class ProjectRouteKernel(CudaKernel[ProjectRoute]):
    """A projection with its residual, then the router and the routing of the sum, in one
    launch."""

    name = "project_route_cuda"
    declaration = ProjectRoute
    chained = True

    def fits(self, decl: ProjectRoute) -> bool:
        return project_route_specs(decl) is not None

    def build(
        self, decl: ProjectRoute,
    ) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]:
        """The projection, the router and the routing in one launch for one token; anything else
        goes through the projection's and the route's own bindings."""
        specs = project_route_specs(decl)
        router = decl.route.router
        assert specs is not None and router is not None
        project, width = specs[0], specs[2].k
        separate = decl.reference()
        # the launch's tickets and counts (the chain's three and the router blocks' one), zero
        # between launches (their last blocks zero them); written in place, so owned here: one
        # array per declaration
        counters = launch_counters(4)
        evaluate(counters)
        scratch = launch_scratch(specs[1].n_experts * 4)  # the router logits, taken before tracing

        def project_route(a: mx.array, residual: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            if (
                a.size != project.k or a.dtype != project.dtype
                or residual.dtype != project.dtype or residual.shape != (*a.shape[:-1], width)
            ):
                return separate(a, residual)
            inputs = [a, *matrix_inputs(decl.project), residual, *matrix_inputs(router.matrices[0])]
            if router.norm is not None:
                inputs.append(router.norm.weight)
            inputs.append(counters)
            return project_route_launcher(*specs, tuple(a.shape[:-1]))(inputs, scratch)

        return project_route


# OMNIA_ROUTE_EXPERTS=0 leaves RouteExperts' one launch out (the pair's two launches run), for
# A/B runs on a device.
ROUTE_EXPERTS_ENV = "OMNIA_ROUTE_EXPERTS"


def route_experts_specs(
    decl: RouteExperts,
) -> tuple[QmvSpec, RouteSpec, QmvSpec, ExpertsSpec, ExpertsSpec] | None:
    """(projection, routing, router, gate/up, down) of the one-launch sparse block, or None
    where the kernel does not compute the declared chain exactly: the pair's own kernels must
    fit, and the router and the gate/up must normalize with one norm."""
    pair = project_route_specs(decl.project_route)
    route = decl.project_route.route
    gate_up = decl.experts.gate_up
    if pair is None or gate_up is None or route.router is None:
        return None
    if gate_up.norm is None or gate_up.norm is not route.router.norm:
        return None
    if not route.n_experts == gate_up.n_experts == decl.experts.n_experts:
        return None
    chain = chain_specs(decl.experts, route.top_k, residual=True)
    project = route_experts_project(pair[0])
    if chain is None or not route_experts_fits(project, *pair[1:], *chain):
        return None
    return (project, *pair[1:], *chain)


class RouteExpertsKernel(CudaKernel[RouteExperts]):
    """A sparse block after the attention (projection, router, routing, expert gate/up and
    down) in one launch; OMNIA_ROUTE_EXPERTS=0 leaves it out."""

    name = "route_experts_cuda"
    declaration = RouteExperts
    chained = True

    def fits(self, decl: RouteExperts) -> bool:
        return route_experts_specs(decl) is not None

    def applies(self, decl: RouteExperts) -> bool:
        return (cuda_backend() and os.environ.get(ROUTE_EXPERTS_ENV, "") != "0"
                and self.fits(decl))

    def build(self, decl: RouteExperts) -> Callable[[mx.array, mx.array], mx.array]:
        """The sparse block after the attention in one launch for one token; anything else goes
        through the pair's declarations (and their bindings)."""
        specs = route_experts_specs(decl)
        assert specs is not None
        project, route, gate_up = specs[0], decl.project_route.route, decl.experts.gate_up
        router = route.router
        assert router is not None and router.norm is not None and gate_up is not None
        width, norm_weight = specs[2].k, router.norm.weight
        separate = decl.reference()
        # the launch's tickets and counts (six), zero between launches (its last block zeroes
        # them); written in place, so owned here
        counters = launch_counters(6)
        evaluate(counters)
        scratch = launch_scratch(route_experts_scratch(specs[1], specs[3], specs[4])[-1])

        def run(a: mx.array, residual: mx.array) -> mx.array:
            if (
                a.size != project.k or a.dtype != project.dtype
                or residual.dtype != project.dtype or residual.shape != (*a.shape[:-1], width)
            ):
                return separate(a, residual)
            inputs = [a, *matrix_inputs(decl.project_route.project), residual,
                      *matrix_inputs(router.matrices[0]), norm_weight, *_weights(gate_up),
                      *_weights(decl.experts), counters]
            return route_experts_launcher(*specs, tuple(a.shape[:-1]))(inputs, scratch)

        return run


ROUTE = RouteKernel()
EXPERTS_GATE_UP = ExpertsGateUp()
EXPERTS_CHAIN = ExpertsChain()  # before EXPERTS_DOWN: DownCombine tries the chain first
EXPERTS_DOWN = ExpertsDown()
PROJECT_ROUTE = ProjectRouteKernel()
ROUTE_EXPERTS = RouteExpertsKernel()
for _kernel in (ROUTE, EXPERTS_GATE_UP, EXPERTS_CHAIN, EXPERTS_DOWN, PROJECT_ROUTE, ROUTE_EXPERTS):
    register(_kernel)
