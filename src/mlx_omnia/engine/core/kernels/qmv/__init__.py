"""Qmv kernels bound to Linear, Projections and ChainedProjections declarations: each accepts a
declaration only where it computes exactly what it declares (docs/kernels.md lists what it
declines). The bound call runs one activation row (qmv), or 2 to 16 rows of 4-bit weights on
tensor cores (a batch's decode step: the rows kernel), handing anything else to the core."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import mlx.core as mx

from mlx_omnia.engine.core.binding import register
from mlx_omnia.engine.core.kernels import CudaKernel, launch_counters
from mlx_omnia.engine.core.kernels.dequantized_matmul import DEQUANTIZED_ROWS
from mlx_omnia.engine.core.kernels.qmv.cuda import (
    MAX_ROWS,
    QmvSpec,
    chained_fits,
    chained_launcher,
    launcher,
    rows_fits,
    rows_launcher,
    spec_fits,
)
from mlx_omnia.engine.core.layers import (
    ChainedProjections,
    Embedding,
    Linear,
    Projections,
    RmsNorm,
)
from mlx_omnia.engine.core.mxcompat import evaluate


def matrix_format(m: Linear | Embedding) -> tuple[mx.Dtype, int | None, int | None] | None:
    """(activation dtype, bits, group size) of a Linear or an Embedding used as one; None when
    it has a bias (not fused) or a mixed format."""
    if "bias" in m:
        return None
    if m.bits is None:
        return m.weight.dtype, None, None
    if m.scales.dtype != m.biases.dtype:
        return None
    return m.scales.dtype, m.bits, m.group_size


def _shape(m: Linear | Embedding) -> tuple[int, int]:
    """(input features, output rows)."""
    if isinstance(m, Linear):
        return m.input_dims, m.output_dims
    return m.dims, m.num_embeddings


def matrix_inputs(m: Linear | Embedding) -> list[mx.array]:
    """The kernel inputs of one matrix: weight, or weight, scales, biases."""
    return [m.weight] if m.bits is None else [m.weight, m.scales, m.biases]


def linear_spec(decl: Linear, *, residual: bool) -> QmvSpec | None:
    fmt = matrix_format(decl)
    if fmt is None:
        return None
    dtype, bits, group = fmt
    k, n = _shape(decl)
    return QmvSpec(dtype=dtype, k=k, rows=(n,), bits=bits, group_size=group, residual=residual)


def _single_row(x: mx.array, k: int, dtype: mx.Dtype) -> bool:
    return x.size == k and x.dtype == dtype


def _few_rows(x: mx.array, k: int, dtype: mx.Dtype) -> bool:
    """2 to MAX_ROWS rows of k values in `dtype` (the rows kernel's inputs)."""
    return x.dtype == dtype and x.ndim >= 2 and x.shape[-1] == k and 2 <= x.size // k <= MAX_ROWS


class QmvLinear(CudaKernel[Linear]):
    """y = W x (+ residual) for one row, in one launch."""

    name = "qmv_cuda"
    declaration = Linear

    def fits(self, decl: Linear) -> bool:
        spec = linear_spec(decl, residual=True)
        return spec is not None and spec_fits(spec)

    def build(self, decl: Linear) -> Callable[..., mx.array]:
        plain, fused = linear_spec(decl, residual=False), linear_spec(decl, residual=True)
        assert plain is not None and fused is not None
        # many rows (prefill): the dense matmul of the dequantized weight, as on any CUDA Linear
        reference = decl.reference(dequantized_rows=DEQUANTIZED_ROWS if decl.quantized else None)
        rows_ok = {False: rows_fits(plain), True: rows_fits(fused)}  # by residual
        calls: dict[tuple[tuple[int, ...], bool], Callable[[Sequence[mx.array]], list[mx.array]]] = {}

        def call(x: mx.array, residual: mx.array | None = None) -> mx.array:
            if residual is not None and (
                residual.dtype != plain.dtype or residual.shape != (*x.shape[:-1], plain.rows[0])
            ):
                return reference(x, residual)
            if _few_rows(x, plain.k, plain.dtype):
                if not rows_ok[residual is not None]:
                    return reference(x, residual)
                spec = fused if residual is not None else plain
                inputs = [x, *matrix_inputs(decl)]
                if residual is not None:
                    inputs.append(residual)
                return rows_launcher(spec, tuple(x.shape[:-1]))(inputs)[0]
            if not _single_row(x, plain.k, plain.dtype):
                return reference(x, residual)
            key = (x.shape[:-1], residual is not None)
            run = calls.get(key)
            if run is None:
                run = calls[key] = launcher(fused if residual is not None else plain, key[0])
            inputs = [x, *matrix_inputs(decl)]
            if residual is not None:
                inputs.append(residual)
            return run(inputs)[0]

        return call


def projections_spec(decl: Projections) -> QmvSpec | None:
    fmts = {matrix_format(m) for m in decl.matrices}
    if len(fmts) != 1 or None in fmts:
        return None
    fmt = fmts.pop()
    assert fmt is not None
    dtype, bits, group = fmt
    shapes = [_shape(m) for m in decl.matrices]
    if len({k for k, _ in shapes}) != 1:
        return None
    norm = decl.norm
    if norm is not None and (type(norm) is not RmsNorm or norm.weight.dtype != dtype):
        return None
    return QmvSpec(
        dtype=dtype, k=shapes[0][0], rows=tuple(n for _, n in shapes), bits=bits,
        group_size=group, norm_eps=None if norm is None else norm.eps, gate=decl.gate,
    )


class QmvProjections(CudaKernel[Projections]):
    """Up to three projections of one row (after an optional RMS norm, optionally gated) in one
    launch."""

    name = "qmv_cuda"
    declaration = Projections

    def fits(self, decl: Projections) -> bool:
        spec = projections_spec(decl)
        return spec is not None and spec_fits(spec)

    def build(self, decl: Projections) -> Callable[[mx.array], tuple[mx.array, ...]]:
        spec = projections_spec(decl)
        assert spec is not None
        reference = decl.reference()
        calls: dict[tuple[int, ...], Callable[[Sequence[mx.array]], list[mx.array]]] = {}

        rows_spec = replace(spec, norm_eps=None)
        rows_ok = rows_fits(rows_spec)
        norm = decl.norm

        def call(x: mx.array) -> tuple[mx.array, ...]:
            if rows_ok and _few_rows(x, spec.k, spec.dtype):
                # the declared norm (its core module) first, then the rows kernel
                h = norm(x) if norm is not None else x
                inputs: list[mx.array] = [h]
                for m in decl.matrices:
                    inputs += matrix_inputs(m)
                return tuple(rows_launcher(rows_spec, tuple(x.shape[:-1]))(inputs))
            if not _single_row(x, spec.k, spec.dtype):
                return reference(x)
            lead = x.shape[:-1]
            run = calls.get(lead)
            if run is None:
                run = calls[lead] = launcher(spec, lead)
            inputs = [x]
            for m in decl.matrices:
                inputs += matrix_inputs(m)
            if decl.norm is not None:
                inputs.append(decl.norm.weight)
            return tuple(run(inputs))

        return call


def chained_specs(decl: ChainedProjections) -> tuple[QmvSpec, QmvSpec] | None:
    """(projection with residual, the projections after it) of the one-launch pair, or None
    where the kernel does not compute the declared pair exactly."""
    project = linear_spec(decl.project, residual=True)
    then = projections_spec(decl.then)
    if project is None or then is None or not chained_fits(project, then):
        return None
    return project, then


class ChainedQmv(CudaKernel[ChainedProjections]):
    """A projection with its residual, then the projections of the sum, in one launch."""

    name = "chained_qmv_cuda"
    declaration = ChainedProjections
    chained = True

    def fits(self, decl: ChainedProjections) -> bool:
        return chained_specs(decl) is not None

    def build(
        self, decl: ChainedProjections
    ) -> Callable[[mx.array, mx.array], tuple[mx.array, ...]]:
        """Both in one launch for one token; anything else goes through the projection's and the
        projections' own bindings."""
        specs = chained_specs(decl)
        assert specs is not None
        project, then = specs
        separate = decl.reference()
        # the launch's tickets and counts, zero between launches (its last block zeroes them);
        # written in place, so owned here: one array per declaration
        counters = launch_counters(3)
        evaluate(counters)

        def chained(a: mx.array, residual: mx.array) -> tuple[mx.array, ...]:
            if (
                not _single_row(a, project.k, project.dtype) or residual.dtype != project.dtype
                or residual.shape != (*a.shape[:-1], then.k)
            ):
                return separate(a, residual)
            inputs = [a, *matrix_inputs(decl.project), residual]
            for m in decl.then.matrices:
                inputs += matrix_inputs(m)
            if decl.then.norm is not None:
                inputs.append(decl.then.norm.weight)
            inputs.append(counters)
            return tuple(chained_launcher(project, then, tuple(a.shape[:-1]))(inputs))

        return chained


QMV_LINEAR = QmvLinear()
QMV_PROJECTIONS = QmvProjections()
CHAINED_QMV = ChainedQmv()
for _kernel in (QMV_LINEAR, QMV_PROJECTIONS, CHAINED_QMV):
    register(_kernel)
