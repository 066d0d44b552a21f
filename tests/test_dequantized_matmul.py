"""Quantized Linears over many rows multiply by the dequantized weight on CUDA
(kernels/dequantized_matmul, and the qmv kernel's own many-row calls): the same products as
quantized_matmul, and which calls take which path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.core.binding import kernels_for
from mlx_omnia.engine.core.kernels.dequantized_matmul import DEQUANTIZED_ROWS
from mlx_omnia.engine.core.layers import Linear

RNG = np.random.default_rng(5)


def linear(*, bias: bool = False, quantized: bool = True) -> Linear:
    layer = Linear(256, 96, bias=bias)
    layer.weight = mx.array(RNG.standard_normal((96, 256)) * 0.05, dtype=mx.float32)
    if bias:
        layer.bias = mx.array(RNG.standard_normal(96), dtype=mx.float32)
    if quantized:
        layer.quantize_weights(bits=4, group_size=64)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_dequantized_rows_equal_quantized_matmul(bias: bool) -> None:
    layer = linear(bias=bias)
    x = mx.array(RNG.standard_normal((2, 40, 256)), dtype=mx.float32)
    residual = mx.array(RNG.standard_normal((2, 40, 96)), dtype=mx.float32)
    quantized, dequantized = layer.reference(), layer.reference(dequantized_rows=80)
    # float32 on the CPU: the dense product is a BLAS GEMM (its own order of sums)
    close = {"rtol": 1e-5, "atol": 1e-6}
    np.testing.assert_allclose(np.array(dequantized(x)), np.array(quantized(x)), **close)
    np.testing.assert_allclose(
        np.array(dequantized(x, residual)), np.array(quantized(x, residual)), **close
    )
    few = x[:, :3]  # under the threshold: quantized_matmul itself, the same bits
    assert np.array_equal(np.array(quantized(few)), np.array(dequantized(few)))


def test_binds_quantized_linears_on_cuda_only_after_qmv(monkeypatch: pytest.MonkeyPatch) -> None:
    biased = linear(bias=True)  # qmv declines a bias: the general kernel takes it
    assert biased.bind() == "core"  # this CPU
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert biased.bind() == "dequantized_matmul"
    assert linear(quantized=False).bind() == "core"  # a dense weight: nothing to dequantize
    order = kernels_for(Linear)
    assert order[-1].name == "dequantized_matmul" and order[-1].general
    assert [k.name for k in order[:-1]] == ["qmv_cuda"]
    assert 16 < DEQUANTIZED_ROWS <= 2048  # past a batch's rows, within one prefill chunk
