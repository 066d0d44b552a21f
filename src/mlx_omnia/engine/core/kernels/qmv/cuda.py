"""Qmv for one activation row on MLX's CUDA backend: y = W x for dense (bf16/fp16) or affine
4/8-bit weights, with the fusions decode wants.

One launch computes up to three projections of the same input (rows concatenated: q/k/v), or
two combined through a gate (act(gate x) * (up x)), optionally RMS-normalizing the input first
and adding a residual to the result. Each warp computes R whole rows: lanes stride 16-byte
chunks of the row, the input sits in shared memory (normalized once per block), partial sums
meet through warp shuffles. Rounding follows the core modules: the norm rounds as
mx.fast.rms_norm does, each matmul output is rounded to the activation dtype before the gate
or the residual, as separate MLX ops would round it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import mlx.core as mx

from mlx_omnia.engine.core.kernels import cuda_kernel
from mlx_omnia.engine.core.kernels.cuda_common import CUDA_TYPES, HEADER, flag

Gate = Literal["silu", "gelu_tanh"]
WARPS = 8

QMV_HEADER = HEADER + r"""
namespace omnia {

template <typename T, int BITS, int GROUP, int K>
struct QmvRow {
  static constexpr int VPC = BITS == 0 ? 8 : 128 / BITS;  // values per 16-byte chunk
  static constexpr int CHUNKS = K / VPC;                   // chunks per row

  // Partial dot product of chunk c of `row` with xf (the chunk's inputs; sx their sum).
  static __device__ __forceinline__ float dot(const void* w, const T* s, const T* b, int row,
                                              int c, const float* xf, float sx) {
    const uint4 wv = __ldg(reinterpret_cast<const uint4*>(w) + (size_t)row * CHUNKS + c);
    if constexpr (BITS == 0) {
      float wf[8];
      unpack8<T>(wv, wf);
      float d0 = 0.f, d1 = 0.f;
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        d0 = fmaf(wf[j], xf[j], d0);
        d1 = fmaf(wf[j + 1], xf[j + 1], d1);
      }
      return d0 + d1;
    } else {
      const unsigned int ws[4] = {wv.x, wv.y, wv.z, wv.w};
      float part[4];  // one chain per word: short dependency chains
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        part[i] = 0.f;
        if constexpr (BITS == 4) {
          // xf holds x * 16^-(m % 4) (prescale): nibble m of a half-word, masked in place and
          // made a float by the 2^23 exponent trick, is q * 16^(m % 4) exactly: no shifts.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const unsigned int half = h == 0 ? (ws[i] & 0xFFFFu) : (ws[i] >> 16);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float q =
                  __uint_as_float((half & (0xFu << (4 * j))) | 0x4B000000u) - 8388608.0f;
              part[i] = fmaf(q, xf[i * 8 + h * 4 + j], part[i]);
            }
          }
        } else {
          constexpr int PER = 32 / BITS;
          constexpr unsigned int MASK = (1u << BITS) - 1u;
#pragma unroll
          for (int j = 0; j < PER; ++j) {
            part[i] = fmaf(small_uint_to_float((ws[i] >> (BITS * j)) & MASK), xf[i * PER + j],
                           part[i]);
          }
        }
      }
      const float d = (part[0] + part[1]) + (part[2] + part[3]);
      const size_t gi = (size_t)row * (K / GROUP) + (c * VPC) / GROUP;
      return fmaf(to_f<T>(s[gi]), d, to_f<T>(b[gi]) * sx);
    }
  }
};

// silu(g) = g * sigmoid(g), each op rounded to T by the caller's rnd.
template <typename T> __device__ __forceinline__ float silu_r(float g) {
  const float s = rnd<T>(1.f / (1.f + expf(-g)));
  return rnd<T>(g * s);
}
template <typename T> __device__ __forceinline__ float gelu_tanh_r(float g) {
  // 0.5 * g * (1 + tanh(0.79788456 * (g + 0.044715 * g^3))), as the core module's op chain.
  // Python float constants meet a T array as T (MLX's weak scalar types): round them first.
  const float c1 = rnd<T>(0.044715f), c2 = rnd<T>(0.7978845608028654f);
  const float g3 = rnd<T>(rnd<T>(rnd<T>(c1 * g) * g) * g);
  const float inner = rnd<T>(c2 * rnd<T>(g + g3));
  const float t = rnd<T>(1.f + rnd<T>(tanhf(inner)));
  return rnd<T>(rnd<T>(0.5f * g) * t);
}

// ACT: 0 rows of up to three segments concatenated; 1 silu-gated, 2 gelu_tanh-gated (segment 0
// the gate, segment 1 the up projection, N0 == N1 rows out).
template <typename T, int BITS, int GROUP, int K, int N0, int N1, int N2, int R, int NWARPS,
          bool NORM, int ACT, bool RESID>
__device__ __forceinline__ void qmv(
    const T* x, const void* w0, const T* s0, const T* b0, const void* w1, const T* s1,
    const T* b1, const void* w2, const T* s2, const T* b2, const T* g, const T* res, T* y0, T* y1, T* y2,
    float eps) {
  using Row = QmvRow<T, BITS, GROUP, K>;
  constexpr int VPC = Row::VPC;
  constexpr int XCH = K / 8;  // 16-byte chunks of the input
  constexpr int ROWS = ACT == 0 ? N0 + N1 + N2 : N0;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[NWARPS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  uint4* xs4 = reinterpret_cast<uint4*>(xs);
  if constexpr (NORM) {
    float ss = 0.f;
    for (int i = tid; i < XCH; i += NWARPS * 32) {
      float f[8];
      unpack8<T>(x4[i], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = fmaf(f[j], f[j], ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < NWARPS; ++i) total += red[i];
    const float inv = rsqrtf(total / K + eps);
    const uint4* g4 = reinterpret_cast<const uint4*>(g);
    for (int i = tid; i < XCH; i += NWARPS * 32) {
      float f[8], gf[8];
      unpack8<T>(x4[i], f);
      unpack8<T>(g4[i], gf);
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = gf[j] * rnd<T>(f[j] * inv);
      xs4[i] = pack8<T>(f);
    }
  } else {
    for (int i = tid; i < XCH; i += NWARPS * 32) xs4[i] = x4[i];
  }
  __syncthreads();

  const int row0 = (blockIdx.x * NWARPS + warp) * R;
  if (row0 >= ROWS) return;
  const void* w = w0; const T* s = s0; const T* b = b0;
  T* y = y0;
  int local = row0;
  if constexpr (ACT == 0) {
    if (row0 >= N0 + N1) { w = w2; s = s2; b = b2; y = y2; local = row0 - N0 - N1; }
    else if (row0 >= N0) { w = w1; s = s1; b = b1; y = y1; local = row0 - N0; }
  }
  float acc[R], acc2[R];
#pragma unroll
  for (int r = 0; r < R; ++r) { acc[r] = 0.f; acc2[r] = 0.f; }
#pragma unroll 2
  for (int c = lane; c < Row::CHUNKS; c += 32) {
    float xf[VPC];
#pragma unroll
    for (int q = 0; q < VPC / 8; ++q) unpack8<T>(xs4[c * (VPC / 8) + q], xf + 8 * q);
    float sx = 0.f;
    if constexpr (BITS != 0) {
#pragma unroll
      for (int j = 0; j < VPC; ++j) sx += xf[j];
    }
    if constexpr (BITS == 4) {
#pragma unroll
      for (int j = 0; j < VPC; ++j) xf[j] *= (j % 4 == 0 ? 1.f : j % 4 == 1 ? 0.0625f : j % 4 == 2 ? 0.00390625f : 0.000244140625f);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[r] += Row::dot(w, s, b, local + r, c, xf, sx);
      if constexpr (ACT != 0) acc2[r] += Row::dot(w1, s1, b1, local + r, c, xf, sx);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = warp_sum(acc[r]);
    float u = 0.f;
    if constexpr (ACT != 0) u = warp_sum(acc2[r]);
    if (lane == 0) {
      v = rnd<T>(v);
      if constexpr (ACT == 1) v = rnd<T>(silu_r<T>(v) * rnd<T>(u));
      if constexpr (ACT == 2) v = rnd<T>(gelu_tanh_r<T>(v) * rnd<T>(u));
      if constexpr (RESID) v = rnd<T>(v + to_f<T>(res[local + r]));
      y[local + r] = from_f<T>(v);
    }
  }
}

}  // namespace omnia
"""


@dataclass(frozen=True)
class QmvSpec:
    """Everything baked into one kernel: formats, geometry, fusions."""

    dtype: mx.Dtype              # activations (and dense weights, scales, biases, norm weight)
    k: int                       # input features
    rows: tuple[int, ...]        # output rows of each segment (1 to 3; 2 equal when gated)
    bits: int | None = None      # None: dense weights in `dtype`
    group_size: int | None = None
    norm_eps: float | None = None  # RMS-normalize the input first (weight input `g`)
    gate: Gate | None = None
    residual: bool = False

    @property
    def out_rows(self) -> int:
        return self.rows[0] if self.gate is not None else sum(self.rows)

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("y0",) if self.gate is not None else tuple(f"y{i}" for i in range(len(self.rows)))

    @property
    def rows_per_warp(self) -> int:
        for r in ((2, 1) if self.bits is not None else (4, 2, 1)):
            # Enough blocks to cover the H200's 132 multiprocessors twice over.
            if all(n % r == 0 for n in self.rows) and self.out_rows // (r * WARPS) >= 264:
                return r
        return 1

    def input_names(self) -> tuple[str, ...]:
        names = ["x"]
        for i in range(len(self.rows)):
            names.append(f"w{i}")
            if self.bits is not None:
                names += [f"s{i}", f"b{i}"]
        if self.norm_eps is not None:
            names.append("g")
        if self.residual:
            names.append("res")
        return tuple(names)

    def name(self) -> str:
        fmt = "dense" if self.bits is None else f"q{self.bits}g{self.group_size}"
        parts = [
            "omnia_qmv", str(self.dtype).split(".")[-1], fmt, f"k{self.k}",
            "n" + "_".join(map(str, self.rows)), f"r{self.rows_per_warp}",
        ]
        if self.norm_eps is not None:
            parts.append("norm" + hashlib.sha1(repr(self.norm_eps).encode()).hexdigest()[:8])
        if self.gate is not None:
            parts.append(self.gate)
        if self.residual:
            parts.append("res")
        return "_".join(parts)

    def source(self) -> str:
        t = CUDA_TYPES[self.dtype]
        names = set(self.input_names())
        n = list(self.rows) + [0] * (3 - len(self.rows))

        def arg(name: str) -> str:
            return name if name in names else "nullptr"

        act = {None: 0, "silu": 1, "gelu_tanh": 2}[self.gate]
        outs = [*self.outputs, "nullptr", "nullptr"][:3]
        bits = self.bits or 0
        group = self.group_size or 1
        eps = repr(float(self.norm_eps)) + "f" if self.norm_eps is not None else "0.f"
        return (
            f"omnia::qmv<{t}, {bits}, {group}, {self.k}, {n[0]}, {n[1]}, {n[2]}, "
            f"{self.rows_per_warp}, {WARPS}, {flag(self.norm_eps is not None)}, {act}, "
            f"{flag(self.residual)}>(\n"
            f"    x, {arg('w0')}, {arg('s0')}, {arg('b0')}, {arg('w1')}, {arg('s1')}, "
            f"{arg('b1')}, {arg('w2')}, {arg('s2')}, {arg('b2')}, {arg('g')}, {arg('res')}, "
            f"{', '.join(outs)}, "
            f"{eps});\n"
        )


@cache
def launcher(spec: QmvSpec, lead: tuple[int, ...]) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """The kernel call for `spec`, with everything but the inputs worked out once (a decode step
    calls it hundreds of times per token)."""
    kernel = cuda_kernel(spec.name(), spec.input_names(), spec.outputs, spec.source(), QMV_HEADER)
    warps = spec.out_rows // spec.rows_per_warp
    blocks = (warps + WARPS - 1) // WARPS
    rows = (spec.rows[0],) if spec.gate is not None else spec.rows
    shapes = [(*lead, n) for n in rows]
    dtypes = [spec.dtype] * len(rows)
    grid, threads = (blocks * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)

    def call(inputs: Sequence[mx.array]) -> list[mx.array]:
        out: Any = kernel(
            inputs=list(inputs), output_shapes=shapes, output_dtypes=dtypes, grid=grid,
            threadgroup=threads,
        )
        return list(out)

    return call


def spec_fits(spec: QmvSpec) -> bool:
    """Geometry and formats this kernel computes exactly (the rest stays with the core)."""
    if spec.dtype not in CUDA_TYPES or spec.gate not in (None, "silu", "gelu_tanh"):
        return False
    if spec.k % 8 or spec.k * 2 > 40_000 or not 1 <= len(spec.rows) <= 3:
        return False
    if spec.gate is not None and (len(spec.rows) != 2 or spec.rows[0] != spec.rows[1]):
        return False
    if spec.residual and (len(spec.rows) != 1 or spec.gate is not None):
        return False
    if spec.bits is None:
        return spec.group_size is None
    if spec.bits not in (4, 8) or spec.group_size not in (32, 64, 128):
        return False
    values_per_chunk = 128 // spec.bits
    return spec.k % spec.group_size == 0 and spec.k % values_per_chunk == 0
