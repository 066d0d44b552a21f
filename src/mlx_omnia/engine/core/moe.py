"""Mixture-of-experts declarations: routing and the selected experts' matmuls (design rule 4).

A sparse block is Route (router logits -> top-k expert ids and weights), GateUp (the selected
experts' gate and up projections, silu(gate) * up) and DownCombine (the selected experts' down
projections, weighted by the routing weights and summed over the k experts). Expert matrices are
stacked along a leading expert axis, [n_experts, out, in], dense or affine-quantized along the
input dimension like Linear; the core implementations are mx.gather_mm / mx.gather_qmm, one
product per (token, selected expert) row. `grouped` core calls (bound on a GPU by
kernels/grouped_experts) compute the same products with the rows grouped by expert into blocks
(`ExpertGroups`) where a call has many rows (a prefill chunk): one matrix product a block, so an
expert's weights are read once a block, not once a row.

Options for gpt-oss (defaults keep the plain declarations above): expert matrices in MLX's
"mxfp4" mode (e2m1 values in groups of 32 with an e8m0 power-of-two scale, no biases: how
gpt-oss checkpoints ship their experts), a per-expert `bias` on GateUp / DownCombine, and
GateUp's activation "gpt_oss_swiglu": gate clamped above at `limit`, up clamped to
[-limit, limit], (up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import mlx.core as mx

from mlx_omnia.engine.core.binding import Declaration, Declared
from mlx_omnia.engine.core.layers import Linear, Projections, RmsNorm
from mlx_omnia.engine.core.mxcompat import drop_parameters, reshape, silu

RouteOrder = Literal["softmax_topk", "topk_softmax"]
ExpertQuantMode = Literal["affine", "mxfp4"]
GateActivation = Literal["silu", "gpt_oss_swiglu"]


class Route(Declaration):
    """Top-k routing of router logits [..., n_experts] to (weights [..., k], ids [..., k]).

    order "softmax_topk": softmax over every expert, keep the k largest probabilities, and
    renormalize them to sum to one when `normalize`. order "topk_softmax": keep the k largest
    logits and softmax over those (equal to softmax_topk with normalize, in other arithmetic).
    The softmax runs in float32; weights come back in the logits' dtype.

    `router` (the family's router projection, declared here, not owned: one Projections matrix
    of n_experts rows, optionally after the layer's norm; `with_router`) makes the call take the
    router's input h instead of its logits: route(h) = top-k routing of router(h). A kernel may
    then compute the logits and the routing in one launch."""

    results = 2

    def __init__(
        self, n_experts: int, top_k: int, *, order: RouteOrder = "softmax_topk",
        normalize: bool = False, router: Projections | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be in 1..{n_experts}")
        if router is not None and (len(router.matrices) != 1 or router.gate is not None):
            raise ValueError("a router is one projection, not gated")
        self._router = Declared(router)
        self.n_experts = n_experts
        self.top_k = top_k
        self.order: RouteOrder = order
        self.normalize = normalize
        self._bound: Callable[[mx.array], tuple[mx.array, mx.array]] = self.reference()

    @property
    def router(self) -> Projections | None:
        return self._router.value

    def with_router(self, router: Projections) -> Route:
        """This routing of `router`'s logits: a Route called on the router's input."""
        return Route(self.n_experts, self.top_k, order=self.order, normalize=self.normalize,
                     router=router)

    def reference(self) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
        route = self.reference_logits()
        router = self.router
        if router is None:
            return route

        def routed(h: mx.array) -> tuple[mx.array, mx.array]:
            (logits,) = router(h)
            return route(logits)

        return routed

    def reference_logits(self) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
        """The core routing of router logits (what `reference` runs after the router)."""
        k, order, normalize = self.top_k, self.order, self.normalize

        def top(values: mx.array) -> mx.array:
            return mx.argpartition(-values, kth=k - 1, axis=-1)[..., :k]

        def route(logits: mx.array) -> tuple[mx.array, mx.array]:
            scores = logits.astype(mx.float32)
            if order == "topk_softmax":
                ids = top(scores)
                weights = mx.softmax(mx.take_along_axis(scores, ids, axis=-1), axis=-1)
            else:
                probs = mx.softmax(scores, axis=-1)
                ids = top(probs)
                weights = mx.take_along_axis(probs, ids, axis=-1)
                if normalize:
                    weights = weights / weights.sum(axis=-1, keepdims=True)
            return weights.astype(logits.dtype), ids

        return route

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Routing of logits x, or of router(x) when a router is declared."""
        return self._bound(x)


def sigmoid_group_topk(
    logits: mx.array, bias: mx.array, *, top_k: int, n_group: int, topk_group: int,
    normalize: bool, scale: float,
) -> tuple[mx.array, mx.array]:
    """DeepSeek-V3-style routing of float32 router logits [..., E]: scores = sigmoid(logits);
    experts are chosen by scores + bias (the bias chooses but does not weigh), first among the
    `topk_group` of `n_group` groups with the best two-expert sums, then the `top_k` best;
    weights = the chosen scores (renormalized when `normalize`) times `scale`, float32.
    Returns (weights, ids) [..., top_k]. Families whose checkpoints name the bias differently
    (e_score_correction_bias, expert_bias) call this from their own router module."""
    scores = mx.sigmoid(logits)
    choosing = scores + bias.astype(mx.float32)
    if topk_group < n_group:
        grouped = reshape(choosing, *choosing.shape[:-1], n_group, -1)
        best_two = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # a group's score
        kept = mx.argpartition(-best_two, kth=topk_group - 1, axis=-1)[..., :topk_group]
        keep = mx.put_along_axis(mx.zeros(best_two.shape, dtype=mx.bool_), kept,
                                 mx.array(True), axis=-1)
        choosing = reshape(mx.where(keep[..., None], grouped, -mx.inf), *choosing.shape)
    ids = mx.argpartition(-choosing, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * scale, ids


class ProjectRoute(Declaration):
    """A projection with its residual, then the routing of the sum: (a [..., in], residual
    [..., out]) -> (h = residual + project(a), weights, ids) with (weights, ids) = route(h).
    Declares the two in the order they run (`project` a Linear, `route` a Route declaring its
    router), so a kernel may run both in one launch; owns neither: their weights stay where the
    checkpoint puts them, and each keeps its own binding for what the pair's kernel declines.
    Built by the binding pass (core/fusion.py)."""

    def __init__(self, project: Linear, route: Route) -> None:
        super().__init__()
        if route.router is None:
            raise ValueError("the route must declare its router")
        self._project = Declared(project)
        self._route = Declared(route)
        self._bound: Callable[[mx.array, mx.array], tuple[mx.array, mx.array, mx.array]] = (
            self.reference()
        )

    @property
    def project(self) -> Linear:
        return self._project.value

    @property
    def route(self) -> Route:
        return self._route.value

    def reference(self) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]:
        project, route = self.project, self.route

        def project_route(a: mx.array, residual: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            h = project(a, residual=residual)
            weights, ids = route(h)
            return h, weights, ids

        return project_route

    def __call__(self, a: mx.array, residual: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self._bound(a, residual)


# The core groups the selected experts' rows by expert where a call has at least this many rows
# (tokens x k) per expert on average: fewer, and the padding of each expert's last block costs more
# than reading its weights once a row.
GROUPED_ROWS_PER_EXPERT = 2


@dataclass(frozen=True)
class ExpertGroups:
    """A call's (token, selected expert) rows laid out by expert: `blocks` blocks of `rows` rows,
    each block rows of one expert (`expert` [blocks]), an expert's rows in token order, its last
    block padded with zero rows, then blocks of padding. Flat row r is token r // k's (r % k)-th
    selected expert. `slot` [R]: where flat row r sits in the layout; `source` [blocks * rows]:
    the flat row each place holds, R for padding (a zero row: R // k is one past the last token).
    Shapes depend on R and the number of experts only, never on the ids' values."""

    slot: mx.array
    source: mx.array
    expert: mx.array
    rows: int
    blocks: int

    @staticmethod
    def wanted(ids: mx.array, n_experts: int) -> bool:
        """Whether the core groups a call selecting `ids` [..., k] (enough rows per expert)."""
        return ids.size >= GROUPED_ROWS_PER_EXPERT * n_experts

    @staticmethod
    def of(ids: mx.array, n_experts: int) -> ExpertGroups:
        """The layout of the rows selecting `ids` [..., k] from `n_experts` experts."""
        flat = reshape(ids, -1).astype(mx.int32)
        n = flat.size
        # rows per block: half the mean rows per expert, a power of two in 16..64
        mean = max(1, n // n_experts)
        rows = min(64, max(16, 1 << max(0, (mean // 2).bit_length() - 1)))
        # every expert's rows fill ceil(count / rows) blocks: at most n / rows + one partial
        # block per expert that has rows
        blocks = -(-n // rows) + min(n_experts, n)
        order = mx.argsort(flat)
        experts = flat[order]
        one_hot = flat[:, None] == mx.arange(n_experts, dtype=mx.int32)[None, :]
        counts = one_hot.astype(mx.int32).sum(axis=0)
        padded = (counts + rows - 1) // rows * rows
        padded_end = mx.cumsum(padded)
        first_padded = padded_end - padded
        first_sorted = mx.cumsum(counts) - counts
        place = mx.arange(n, dtype=mx.int32) - first_sorted[experts] + first_padded[experts]
        slot = mx.put_along_axis(mx.zeros((n,), dtype=mx.int32), order, place, axis=0)
        source = mx.put_along_axis(
            mx.full((blocks * rows,), n, dtype=mx.int32), place, order.astype(mx.int32), axis=0
        )
        starts = mx.arange(blocks, dtype=mx.int32) * rows
        expert = (padded_end[None, :] <= starts[:, None]).astype(mx.int32).sum(axis=1)
        expert = mx.minimum(expert, n_experts - 1).astype(mx.uint32)
        return ExpertGroups(slot, source, expert, rows, blocks)

    def take(self, x: mx.array, per: int) -> mx.array:
        """The layout's rows of `x` [N, d]: the tokens (`per` k: flat row r reads token r // k)
        or the flat rows themselves (`per` 1) -> [blocks, rows, d], padding zero."""
        padded = mx.concatenate([x, mx.zeros((1, x.shape[-1]), dtype=x.dtype)], axis=0)
        index = self.source // per if per > 1 else self.source
        return reshape(padded[index], self.blocks, self.rows, x.shape[-1])

    def put_back(self, y: mx.array) -> mx.array:
        """Rows of a product over the layout, y [blocks, rows, d] -> [R, d] in flat-row order."""
        return reshape(y, -1, y.shape[-1])[self.slot]


class ExpertLinear(Declaration):
    """Stacked expert matrices `weight` [n_experts, output_dims, input_dims], dense or
    affine-quantized along the input dimension (`scales`/`biases` [n_experts, out, groups]), as
    Linear is; `select` computes x @ W[e].T for the expert ids given per row. `mode` "mxfp4":
    `weight` packs e2m1 values (uint32), `scales` are uint8 e8m0 exponents per 32 inputs, no
    `biases`. `bias` (the subclasses' option): a per-expert output bias [n_experts, out]."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bias: mx.array

    def __init__(self, n_experts: int, input_dims: int, output_dims: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.input_dims = input_dims
        self.output_dims = output_dims
        self.weight = mx.zeros((n_experts, output_dims, input_dims))
        self.bits: int | None = None
        self.group_size: int | None = None
        self.mode: ExpertQuantMode = "affine"

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def has_bias(self) -> bool:
        return "bias" in self

    def to_quantized(self, *, bits: int, group_size: int, mode: ExpertQuantMode | None = None) -> None:
        """Declare affine quantization (placeholders; weights come from a checkpoint or `quantize`).
        `mode` "mxfp4" declares MXFP4 instead (4 bits, groups of 32); None keeps `self.mode`."""
        e, out = self.n_experts, self.output_dims
        if mode is not None:
            self.mode = mode
        if self.mode == "mxfp4":
            if (bits, group_size) != (4, 32):
                raise ValueError(f"mxfp4 is 4-bit in groups of 32 (got {bits}, {group_size})")
            self.weight = mx.zeros((e, out, self.input_dims // 8), dtype=mx.uint32)
            self.scales = mx.zeros((e, out, self.input_dims // 32), dtype=mx.uint8)
            drop_parameters(self, "biases")
            self.bits, self.group_size = bits, group_size
            return
        self.weight = mx.zeros((e, out, self.input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((e, out, self.input_dims // group_size))
        self.biases = mx.zeros((e, out, self.input_dims // group_size))
        self.bits, self.group_size = bits, group_size

    def quantize_weights(
        self, *, bits: int, group_size: int, mode: ExpertQuantMode = "affine"
    ) -> None:
        """Round-to-nearest affine (or, with `mode` "mxfp4", MXFP4) quantization of the loaded
        dense weight."""
        if mode == "mxfp4":
            # mxfp4 returns (weight, scales) only; the stub types three arrays.
            packed = mx.quantize(self.weight, group_size=group_size, bits=bits, mode="mxfp4")
            self.weight, self.scales, self.mode = packed[0], packed[1], mode
            drop_parameters(self, "biases")
            self.bits, self.group_size = bits, group_size
            return
        w, scales, biases = mx.quantize(self.weight, group_size=group_size, bits=bits)
        self.weight, self.scales, self.biases = w, scales, biases
        self.bits, self.group_size = bits, group_size

    def dequantize_weights(self, dtype: mx.Dtype = mx.float32) -> None:
        """Expand quantized weights to dense `dtype`."""
        if not self.quantized:
            self.weight = self.weight.astype(dtype)
            return
        if self.mode == "mxfp4":
            self.weight = mx.dequantize(
                self.weight, self.scales, None, group_size=self.group_size, bits=self.bits,
                mode="mxfp4", dtype=dtype,
            )
            drop_parameters(self, "scales")
            self.bits = self.group_size = None
            self.mode = "affine"
            return
        self.weight = mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        ).astype(dtype)
        drop_parameters(self, "scales", "biases")
        self.bits = self.group_size = None

    def select(self) -> Callable[[mx.array, mx.array], mx.array]:
        """(x [..., 1, 1, in] or [..., k, 1, in], ids [..., k]) -> [..., k, 1, out]; also
        (blocks [b, rows, in], expert [b]) -> [b, rows, out], each block with its one expert."""
        if self.quantized and self.mode == "mxfp4":
            group = self.group_size

            def gather_mxfp4(x: mx.array, ids: mx.array) -> mx.array:
                return mx.gather_qmm(
                    x, self.weight, self.scales, None, rhs_indices=ids,
                    transpose=True, group_size=group, bits=4, mode="mxfp4",
                )

            return gather_mxfp4
        if self.quantized:
            bits, group_size = self.bits, self.group_size

            def gather_q(x: mx.array, ids: mx.array) -> mx.array:
                return mx.gather_qmm(
                    x, self.weight, self.scales, self.biases, rhs_indices=ids,
                    transpose=True, group_size=group_size, bits=bits,
                )

            return gather_q

        def gather(x: mx.array, ids: mx.array) -> mx.array:
            return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=ids)

        return gather

    def products(self, *, grouped: bool = False) -> Callable[[mx.array, mx.array], mx.array]:
        """(x, ids [..., k]) -> [..., k, out]: x @ W[e].T for each selected expert e, where x is
        one row per token ([..., in]: each token's row meets its k experts) or one row per
        selected expert ([..., k, in]). A row at a time (`select`); with `grouped`, the rows
        grouped by expert (`ExpertGroups`) where a call has enough rows per expert: the same
        products, each block's weights read once (what a GPU wants over a prefill chunk; on a
        CPU the padding costs more than it saves)."""
        select, n_experts = self.select(), self.n_experts

        def products(x: mx.array, ids: mx.array) -> mx.array:
            per_token = x.ndim == ids.ndim
            if not (grouped and ExpertGroups.wanted(ids, n_experts)):
                rows = mx.expand_dims(x, (-2, -3)) if per_token else mx.expand_dims(x, -2)
                return select(rows, ids).squeeze(-2)
            groups = ExpertGroups.of(ids, n_experts)
            blocks = groups.take(reshape(x, -1, x.shape[-1]), ids.shape[-1] if per_token else 1)
            y = select(blocks, groups.expert)
            return reshape(groups.put_back(y), *ids.shape, y.shape[-1])

        return products


E = TypeVar("E", bound=ExpertLinear)


def _view(experts: E, **declared: Declared[Any]) -> E:
    """A copy of `experts` sharing its arrays and naming other declarations: a chain's part,
    built by the binding pass (core/fusion.py), never in the model's tree."""
    view = copy.copy(experts)
    vars(view).update(declared)
    view.bind(force_reference=True)
    return view


class GateUp(ExpertLinear):
    """The selected experts' gate and up projections: x [..., in], ids [..., k] ->
    silu(x @ G[e].T) * (x @ U[e].T) [..., k, hidden]. `weight` stacks [G; U] along the output
    axis: [n_experts, 2 * hidden_dims, input_dims] (transformers' fused gate_up_proj).

    Options: `bias` adds a per-expert bias [n_experts, 2 * hidden_dims] (same [G; U] order) to
    the projections; `activation` "gpt_oss_swiglu" computes, with g, u the projections,
    (clip(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit)); `norm` (the
    layer's RmsNorm, declared here, not owned; `after_norm`) normalizes x first, so the experts
    take the residual stream as it is and no separate norm runs for them."""

    def __init__(
        self,
        n_experts: int,
        input_dims: int,
        hidden_dims: int,
        *,
        bias: bool = False,
        activation: GateActivation = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
        norm: RmsNorm | None = None,
    ) -> None:
        super().__init__(n_experts, input_dims, 2 * hidden_dims)
        self._norm = Declared(norm)
        self.hidden_dims = hidden_dims
        if bias:
            self.bias = mx.zeros((n_experts, 2 * hidden_dims))
        self.activation: GateActivation = activation
        self.alpha = alpha
        self.limit = limit
        self._bound: Callable[[mx.array, mx.array], mx.array] = self.reference()

    @property
    def norm(self) -> RmsNorm | None:
        return self._norm.value

    def after_norm(self, norm: RmsNorm) -> GateUp:
        """These experts (the same arrays) after `norm`: called on the norm's input."""
        return _view(self, _norm=Declared(norm))

    def reference(self, *, grouped: bool = False) -> Callable[[mx.array, mx.array], mx.array]:
        """The core call; `grouped`: its products grouped by expert (`ExpertLinear.products`)."""
        products, hidden, norm = self.products(grouped=grouped), self.hidden_dims, self.norm
        if self.has_bias or self.activation != "silu":
            return self._reference_options(products)

        def gate_up(x: mx.array, ids: mx.array) -> mx.array:
            if norm is not None:
                x = norm(x)
            y = products(x, ids)
            return silu(y[..., :hidden]) * y[..., hidden:]

        return gate_up

    def _reference_options(
        self, products: Callable[[mx.array, mx.array], mx.array]
    ) -> Callable[[mx.array, mx.array], mx.array]:
        hidden, norm = self.hidden_dims, self.norm
        activation, alpha, limit = self.activation, self.alpha, self.limit

        def gate_up(x: mx.array, ids: mx.array) -> mx.array:
            if norm is not None:
                x = norm(x)
            y = products(x, ids)
            if "bias" in self:
                y = y + self.bias[ids]
            gate, up = y[..., :hidden], y[..., hidden:]
            if activation == "gpt_oss_swiglu":
                gate = mx.minimum(gate, limit)
                up = mx.clip(up, -limit, limit)
                return (up + 1.0) * (gate * mx.sigmoid(alpha * gate))
            return silu(gate) * up

        return gate_up

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        return self._bound(x, ids)


class DownCombine(ExpertLinear):
    """The selected experts' down projections, weighted and summed: h [..., k, in],
    ids [..., k], weights [..., k] -> sum_j weights[j] * (h[j] @ D[ids[j]].T) [..., out].
    `weight`: [n_experts, output_dims, input_dims]. Option `bias`: a per-expert bias
    [n_experts, output_dims] added to each selected expert's output before the weighting.
    `residual` (a call argument) declares what follows: the sum is added to it (h + moe(h)).
    `gate_up` (declared here, not owned) declares what precedes: the call then takes the gate/up
    projection's input x [..., in] in place of h and computes down(gate_up(x, ids)), so a kernel
    may run both in one launch (`after`)."""

    def __init__(
        self, n_experts: int, input_dims: int, output_dims: int, *, bias: bool = False,
        gate_up: GateUp | None = None,
    ) -> None:
        super().__init__(n_experts, input_dims, output_dims)
        self._gate_up = Declared(gate_up)
        if bias:
            self.bias = mx.zeros((n_experts, output_dims))
        self._bound: Callable[..., mx.array] = self.reference()

    @property
    def gate_up(self) -> GateUp | None:
        return self._gate_up.value

    def after(self, gate_up: GateUp) -> DownCombine:
        """These experts (the same arrays) after `gate_up`: called on the gate/up's input."""
        return _view(self, _gate_up=Declared(gate_up))

    def reference(self, *, grouped: bool = False) -> Callable[..., mx.array]:
        """The core call; `grouped`: its products grouped by expert (`ExpertLinear.products`)."""
        return self.after_gate_up(self.reference_down(grouped=grouped))

    def after_gate_up(self, down: Callable[..., mx.array]) -> Callable[..., mx.array]:
        """`down` (a call on h), run after the declared gate_up when there is one (then a call
        on the gate/up's input x, through the gate_up's own binding); `down` itself otherwise."""
        gate_up = self.gate_up
        if gate_up is None:
            return down

        def chained(
            x: mx.array, ids: mx.array, weights: mx.array, residual: mx.array | None = None
        ) -> mx.array:
            return down(gate_up(x, ids), ids, weights, residual)

        return chained

    def reference_down(self, *, grouped: bool = False) -> Callable[..., mx.array]:
        """The core down projections and combine of h (what `reference` runs after gate_up)."""
        products = self.products(grouped=grouped)

        def down_combine(
            h: mx.array, ids: mx.array, weights: mx.array, residual: mx.array | None = None
        ) -> mx.array:
            y = products(h, ids)
            if "bias" in self:
                y = y + self.bias[ids]
            out = (y * mx.expand_dims(weights, -1)).sum(axis=-2).astype(h.dtype)
            return out if residual is None else residual + out

        return down_combine

    def __call__(
        self, h: mx.array, ids: mx.array, weights: mx.array, residual: mx.array | None = None
    ) -> mx.array:
        if residual is None:
            return self._bound(h, ids, weights)
        return self._bound(h, ids, weights, residual)


class RouteExperts(Declaration):
    """A sparse block after the attention: (a [..., in], residual [..., out]) -> h + the
    experts' MLP of h, with (h, weights, ids) = project_route(a, residual) and the experts a
    DownCombine declaring its GateUp (`experts(h, ids, weights, residual=h)`). Declares the
    chain in the order it runs, so a kernel may run it in one launch; owns neither part: each
    keeps its own binding for what the chain's kernel declines. Built by the binding pass
    (core/fusion.py)."""

    def __init__(self, project_route: ProjectRoute, experts: DownCombine) -> None:
        super().__init__()
        if experts.gate_up is None:
            raise ValueError("the experts must declare their gate/up projection")
        self._project_route = Declared(project_route)
        self._experts = Declared(experts)
        self._bound: Callable[[mx.array, mx.array], mx.array] = self.reference()

    @property
    def project_route(self) -> ProjectRoute:
        return self._project_route.value

    @property
    def experts(self) -> DownCombine:
        return self._experts.value

    def reference(self) -> Callable[[mx.array, mx.array], mx.array]:
        project_route, experts = self.project_route, self.experts

        def route_experts(a: mx.array, residual: mx.array) -> mx.array:
            h, weights, ids = project_route(a, residual)
            return experts(h, ids, weights, residual=h)

        return route_experts

    def __call__(self, a: mx.array, residual: mx.array) -> mx.array:
        return self._bound(a, residual)

