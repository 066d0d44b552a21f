"""Mixture-of-experts declarations: routing and the selected experts' matmuls (design rule 4).

A sparse block is Route (router logits -> top-k expert ids and weights), GateUp (the selected
experts' gate and up projections, silu(gate) * up) and DownCombine (the selected experts' down
projections, weighted by the routing weights and summed over the k experts). Expert matrices are
stacked along a leading expert axis, [n_experts, out, in], dense or affine-quantized along the
input dimension like Linear; the core implementations are mx.gather_mm / mx.gather_qmm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import mlx.core as mx

from mlx_omnia.engine.core.binding import Declaration
from mlx_omnia.engine.core.mxcompat import drop_parameters, silu

RouteOrder = Literal["softmax_topk", "topk_softmax"]


class Route(Declaration):
    """Top-k routing of router logits [..., n_experts] to (weights [..., k], ids [..., k]).

    order "softmax_topk": softmax over every expert, keep the k largest probabilities, and
    renormalize them to sum to one when `normalize`. order "topk_softmax": keep the k largest
    logits and softmax over those (equal to softmax_topk with normalize, in other arithmetic).
    The softmax runs in float32; weights come back in the logits' dtype."""

    def __init__(
        self, n_experts: int, top_k: int, *, order: RouteOrder = "softmax_topk", normalize: bool = False
    ) -> None:
        super().__init__()
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be in 1..{n_experts}")
        self.n_experts = n_experts
        self.top_k = top_k
        self.order: RouteOrder = order
        self.normalize = normalize
        self._bound: Callable[[mx.array], tuple[mx.array, mx.array]] = self.reference()

    def reference(self) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
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

    def __call__(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return self._bound(logits)


class ExpertLinear(Declaration):
    """Stacked expert matrices `weight` [n_experts, output_dims, input_dims], dense or
    affine-quantized along the input dimension (`scales`/`biases` [n_experts, out, groups]), as
    Linear is; `select` computes x @ W[e].T for the expert ids given per row."""

    weight: mx.array
    scales: mx.array
    biases: mx.array

    def __init__(self, n_experts: int, input_dims: int, output_dims: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.input_dims = input_dims
        self.output_dims = output_dims
        self.weight = mx.zeros((n_experts, output_dims, input_dims))
        self.bits: int | None = None
        self.group_size: int | None = None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def to_quantized(self, *, bits: int, group_size: int) -> None:
        """Declare affine quantization (placeholders; weights come from a checkpoint or `quantize`)."""
        e, out = self.n_experts, self.output_dims
        self.weight = mx.zeros((e, out, self.input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((e, out, self.input_dims // group_size))
        self.biases = mx.zeros((e, out, self.input_dims // group_size))
        self.bits, self.group_size = bits, group_size

    def quantize_weights(self, *, bits: int, group_size: int) -> None:
        """Round-to-nearest affine quantization of the loaded dense weight."""
        w, scales, biases = mx.quantize(self.weight, group_size=group_size, bits=bits)
        self.weight, self.scales, self.biases = w, scales, biases
        self.bits, self.group_size = bits, group_size

    def dequantize_weights(self, dtype: mx.Dtype = mx.float32) -> None:
        """Expand quantized weights to dense `dtype`."""
        if not self.quantized:
            self.weight = self.weight.astype(dtype)
            return
        self.weight = mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        ).astype(dtype)
        drop_parameters(self, "scales", "biases")
        self.bits = self.group_size = None

    def select(self) -> Callable[[mx.array, mx.array], mx.array]:
        """(x [..., 1, 1, in] or [..., k, 1, in], ids [..., k]) -> [..., k, 1, out]."""
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


class GateUp(ExpertLinear):
    """The selected experts' gate and up projections: x [..., in], ids [..., k] ->
    silu(x @ G[e].T) * (x @ U[e].T) [..., k, hidden]. `weight` stacks [G; U] along the output
    axis: [n_experts, 2 * hidden_dims, input_dims] (transformers' fused gate_up_proj)."""

    def __init__(self, n_experts: int, input_dims: int, hidden_dims: int) -> None:
        super().__init__(n_experts, input_dims, 2 * hidden_dims)
        self.hidden_dims = hidden_dims
        self._bound: Callable[[mx.array, mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array, mx.array], mx.array]:
        select, hidden = self.select(), self.hidden_dims

        def gate_up(x: mx.array, ids: mx.array) -> mx.array:
            y = select(mx.expand_dims(x, (-2, -3)), ids).squeeze(-2)
            return silu(y[..., :hidden]) * y[..., hidden:]

        return gate_up

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        return self._bound(x, ids)


class DownCombine(ExpertLinear):
    """The selected experts' down projections, weighted and summed: h [..., k, in],
    ids [..., k], weights [..., k] -> sum_j weights[j] * (h[j] @ D[ids[j]].T) [..., out].
    `weight`: [n_experts, output_dims, input_dims]."""

    def __init__(self, n_experts: int, input_dims: int, output_dims: int) -> None:
        super().__init__(n_experts, input_dims, output_dims)
        self._bound: Callable[[mx.array, mx.array, mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
        select = self.select()

        def down_combine(h: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
            y = select(mx.expand_dims(h, -2), ids).squeeze(-2)
            return (y * mx.expand_dims(weights, -1)).sum(axis=-2).astype(h.dtype)

        return down_combine

    def __call__(self, h: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return self._bound(h, ids, weights)
