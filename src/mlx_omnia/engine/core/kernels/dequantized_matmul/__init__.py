"""Dequantized matmuls bound to quantized Linear declarations on CUDA: a call with many rows (a
prefill chunk) multiplies by the weight dequantized to the activation dtype, in MLX's dense
matmul (cuBLAS), instead of MLX's quantized_matmul, which dequantizes in its own GEMM kernel.
The products are the declared ones (on the H100 both agree bit for bit with the bf16 product of
the dequantized weight, `scripts/device/dense_prefill.py`; only the order of sums may differ); fewer rows keep quantized_matmul,
which reads a quarter of the bytes. Registered as a general kernel: the qmv kernel (one row, a
batch's rows) is tried first and hands many-row calls to the same core call."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlx_omnia.engine.core.binding import register
from mlx_omnia.engine.core.kernels import CudaKernel
from mlx_omnia.engine.core.layers import Linear

# Rows from which a CUDA call dequantizes first. H100, Qwen3-4B's matrices, 4-bit g64
# (2026-12-07): a 2,048-row chunk's matmuls 150.7 ms quantized, 51.1 ms dequantized first
# (bf16 weights: 40.3 ms); 8,192 rows 494.3 / 139.3 / 122.1 ms.
DEQUANTIZED_ROWS = 256


class DequantizedMatmul(CudaKernel[Linear]):
    """y = x @ dequantize(W).T (+ bias) (+ residual) for calls of DEQUANTIZED_ROWS rows or more;
    quantized_matmul below."""

    name = "dequantized_matmul"
    declaration = Linear
    general = True

    def fits(self, decl: Linear) -> bool:
        return decl.quantized

    def build(self, decl: Linear) -> Callable[..., mx.array]:
        return decl.reference(dequantized_rows=DEQUANTIZED_ROWS)


register(DequantizedMatmul())
