"""AttentionStep for one new token on MLX's CUDA backend: append its key/value to a fixed-capacity
cache in place, then causal grouped-query attention over every filled row.

Two launches. `split`: one block per (kv head, slice of KEYS_PER_BLOCK cache rows) scores the
slice for all of the kv head's query heads, and writes unnormalized partial outputs with their
running max and sum; the block of slice 0 also stores the new key/value row at `pos`. Slices past
`pos` write empty partials, so the grid depends on the capacity only, never on the length (one
traced step serves every position). `combine`: one block per query head merges the slices.

The new row itself is read from the kernel's inputs, never from the cache, so no block reads a
row another block of the same launch writes. The cache buffers are written in place: they must
be owned by the cache alone (StaticKVCache holds them), and every reader of the cache runs on
the same stream after this launch."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.kernels import cuda_kernel
from mlx_omnia.engine.core.kernels.cuda_common import CUDA_TYPES, HEADER, flag

KEYS_PER_BLOCK = 64

ATTENTION_HEADER = HEADER + r"""
namespace omnia {

// Queries and the new key arrive as raw projections: each block normalizes (optional per-head
// RMS norm) and rotates its kv head's query heads and key itself (a few hundred values).
template <typename T, int H, int HKV, int D, int KPB, bool QN, bool KN, bool TRAD>
__device__ __forceinline__ void attention_split(
    const T* q, const T* k_new, const T* v_new, const T* qw, const T* kw, const float* inv_freq,
    const T* k_cache, const T* v_cache, const int* pos_p, float* part_o, float* part_ml,
    float eps_q, float eps_k, float scale, int cap) {
  constexpr int G = H / HKV;
  constexpr int NT = 128;
  constexpr int NW = NT / 32;
  constexpr int CH = D / 8;  // 16-byte chunks of a row
  static_assert(KPB <= NT, "one thread per key");
  __shared__ float hs[G + 1][D];           // rotated query heads, then the rotated new key
  __shared__ __align__(16) T vs[KPB][D];   // this slice's values
  __shared__ float p[G][KPB];
  __shared__ float stat[G][2];
  const int kvh = blockIdx.x / (cap / KPB);
  const int split = blockIdx.x % (cap / KPB);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pos = pos_p[0];
  const int t0 = split * KPB;
  const int n = min(KPB, pos + 1 - t0);  // keys of this slice (<= 0: empty)
  T* kc = const_cast<T*>(k_cache) + (size_t)kvh * cap * D;
  T* vc = const_cast<T*>(v_cache) + (size_t)kvh * cap * D;
  if (n <= 0) {
    for (int i = tid; i < G * D; i += NT) part_o[((size_t)split * H + kvh * G) * D + i] = 0.f;
    if (tid < G) {
      part_ml[((size_t)split * H + kvh * G + tid) * 2] = -omnia_inf();
      part_ml[((size_t)split * H + kvh * G + tid) * 2 + 1] = 0.f;
    }
    return;
  }
  // Values of the slice into shared memory, and this thread's key row into registers: every
  // load is issued before the heads are prepared, so their latencies overlap.
  constexpr int VLOADS = (KPB * CH + NT - 1) / NT;
#pragma unroll
  for (int u = 0; u < VLOADS; ++u) {
    const int i = tid + u * NT;
    if (i < n * CH) {
      const int r = i / CH, c = i % CH, t = t0 + r;
      const uint4* src = reinterpret_cast<const uint4*>(t == pos ? v_new + kvh * D : vc + (size_t)t * D);
      reinterpret_cast<uint4*>(&vs[r][0])[c] = src[c];
    }
  }
  const int my_t = t0 + tid;
  const bool my_key = tid < n && my_t != pos;
  uint4 kv[CH];
  if (my_key) {
    const uint4* krow = reinterpret_cast<const uint4*>(kc + (size_t)my_t * D);
#pragma unroll
    for (int c = 0; c < CH; ++c) kv[c] = krow[c];
  }
  // Norm (optional) then rope of each query head of the group and of the new key: warp per head.
  for (int j = warp; j <= G; j += NW) {
    const bool is_k = j == G;
    const T* src = is_k ? k_new + kvh * D : q + (kvh * G + j) * D;
    float ss = 0.f;
    for (int d = lane; d < D; d += 32) {
      const float v = to_f<T>(src[d]);
      hs[j][d] = v;
      ss = fmaf(v, v, ss);
    }
    if (is_k ? KN : QN) {
      ss = warp_sum(ss);
      const float inv = rsqrtf(ss / D + (is_k ? eps_k : eps_q));
      const T* wt = is_k ? kw : qw;
      for (int d = lane; d < D; d += 32) hs[j][d] = rnd<T>(to_f<T>(wt[d]) * rnd<T>(hs[j][d] * inv));
    }
    __syncwarp();
    const float fpos = (float)pos;
    float out[D / 32];
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int d = lane + 32 * e;
      const int i = TRAD ? d / 2 : d % (D / 2);
      float sn, cs;
      sincosf(fpos * inv_freq[i], &sn, &cs);
      if constexpr (TRAD) {
        const float x1 = hs[j][d & ~1], x2 = hs[j][d | 1];
        out[e] = (d & 1) ? x1 * sn + x2 * cs : x1 * cs - x2 * sn;
      } else {
        out[e] = d < D / 2 ? hs[j][d] * cs - hs[j][d + D / 2] * sn
                           : hs[j][d - D / 2] * sn + hs[j][d] * cs;
      }
    }
    __syncwarp();
#pragma unroll
    for (int e = 0; e < D / 32; ++e) hs[j][lane + 32 * e] = rnd<T>(out[e]);
  }
  __syncthreads();
  if (split == 0) {
    for (int d = tid; d < D; d += NT) {
      kc[(size_t)pos * D + d] = from_f<T>(hs[G][d]);
      vc[(size_t)pos * D + d] = v_new[kvh * D + d];
    }
  }
  // Scores: one thread per key.
  if (tid < n) {
    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.f;
    if (!my_key) {
      for (int d = 0; d < D; ++d) {
#pragma unroll
        for (int g = 0; g < G; ++g) acc[g] = fmaf(hs[g][d], hs[G][d], acc[g]);
      }
    } else {
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        float kf[8];
        unpack8<T>(kv[c], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g] = fmaf(hs[g][c * 8 + e], kf[e], acc[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) p[g][tid] = acc[g] * scale;
  }
  __syncthreads();
  for (int g = warp; g < G; g += NW) {
    float m = -omnia_inf();
    for (int i = lane; i < n; i += 32) m = fmaxf(m, p[g][i]);
    m = warp_max(m);
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = __expf(p[g][i] - m);
      p[g][i] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) { stat[g][0] = m; stat[g][1] = l; }
  }
  __syncthreads();
  for (int d = tid; d < D; d += NT) {
    float o[G];
#pragma unroll
    for (int g = 0; g < G; ++g) o[g] = 0.f;
    for (int i = 0; i < n; ++i) {
      const float v = to_f<T>(vs[i][d]);
#pragma unroll
      for (int g = 0; g < G; ++g) o[g] = fmaf(p[g][i], v, o[g]);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) part_o[((size_t)split * H + kvh * G + g) * D + d] = o[g];
  }
  if (tid < G) {
    part_ml[((size_t)split * H + kvh * G + tid) * 2] = stat[tid][0];
    part_ml[((size_t)split * H + kvh * G + tid) * 2 + 1] = stat[tid][1];
  }
}

template <typename T, int H, int D>
__device__ __forceinline__ void attention_combine(const float* part_o, const float* part_ml, T* out,
                                                  int splits) {
  const int h = blockIdx.x, d = threadIdx.x;
  float m = -omnia_inf();
#pragma unroll 8
  for (int s = 0; s < splits; ++s) m = fmaxf(m, part_ml[((size_t)s * H + h) * 2]);
  float l = 0.f, o = 0.f;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const float ms = part_ml[((size_t)s * H + h) * 2];
    const float w = ms == -omnia_inf() ? 0.f : __expf(ms - m);
    l = fmaf(part_ml[((size_t)s * H + h) * 2 + 1], w, l);
    o = fmaf(part_o[((size_t)s * H + h) * D + d], w, o);
  }
  out[h * D + d] = from_f<T>(o / l);
}

}  // namespace omnia
"""


@dataclass(frozen=True)
class AttentionStepSpec:
    dtype: mx.Dtype
    n_heads: int
    n_kv_heads: int
    head_dim: int
    capacity: int            # cache rows (a multiple of KEYS_PER_BLOCK); not baked in the source
    scale: float
    q_eps: float | None = None  # per-head RMS norm of the queries (weight input `qw`)
    k_eps: float | None = None
    traditional: bool = False   # rope pairs (2i, 2i+1) instead of (i, i + D/2)

    @property
    def splits(self) -> int:
        return self.capacity // KEYS_PER_BLOCK

    def tag(self) -> str:
        consts = hashlib.sha1(repr((self.scale, self.q_eps, self.k_eps)).encode()).hexdigest()[:8]
        return (
            f"{str(self.dtype).split('.')[-1]}_h{self.n_heads}_kv{self.n_kv_heads}"
            f"_d{self.head_dim}{'_trad' if self.traditional else ''}_{consts}"
        )

    def input_names(self) -> tuple[str, ...]:
        names = ["q", "k_new", "v_new"]
        if self.q_eps is not None:
            names.append("qw")
        if self.k_eps is not None:
            names.append("kw")
        return (*names, "inv_freq", "k_cache", "v_cache", "pos")


@cache
def launcher(spec: AttentionStepSpec, lead: tuple[int, ...]) -> Callable[[list[mx.array]], mx.array]:
    t = CUDA_TYPES[spec.dtype]
    h, d = spec.n_heads, spec.head_dim
    qn, kn = spec.q_eps is not None, spec.k_eps is not None
    split = cuda_kernel(
        f"omnia_attention_split_{spec.tag()}", spec.input_names(), ("part_o", "part_ml"),
        f"omnia::attention_split<{t}, {h}, {spec.n_kv_heads}, {d}, "
        f"{KEYS_PER_BLOCK}, {flag(qn)}, {flag(kn)}, {flag(spec.traditional)}>(q, k_new, v_new, "
        f"{'qw' if qn else 'nullptr'}, {'kw' if kn else 'nullptr'}, inv_freq, k_cache, v_cache, "
        f"pos, part_o, part_ml, {float(spec.q_eps or 0.0)!r}f, {float(spec.k_eps or 0.0)!r}f, "
        f"{float(spec.scale)!r}f, k_cache_shape[2]);\n",
        ATTENTION_HEADER,
    )
    combine = cuda_kernel(
        f"omnia_attention_combine_{spec.tag()}", ("part_o", "part_ml"), ("out",),
        f"omnia::attention_combine<{t}, {h}, {d}>(part_o, part_ml, out, part_ml_shape[0]);\n",
        ATTENTION_HEADER,
    )
    part_shapes = [(spec.splits, h, d), (spec.splits, h, 2)]
    part_types = [mx.float32, mx.float32]
    split_grid = (spec.n_kv_heads * spec.splits * 128, 1, 1)
    out_shape = [(*lead, h * d)]

    def call(inputs: list[mx.array]) -> mx.array:
        parts: Any = split(
            inputs=inputs, output_shapes=part_shapes, output_dtypes=part_types, grid=split_grid,
            threadgroup=(128, 1, 1),
        )
        out: Any = combine(
            inputs=[parts[0], parts[1]], output_shapes=out_shape, output_dtypes=[spec.dtype],
            grid=(h * d, 1, 1), threadgroup=(d, 1, 1),
        )
        return out[0]

    return call


def spec_fits(spec: AttentionStepSpec) -> bool:
    """Geometry this kernel computes: head_dim a multiple of 32 up to 128 (one block of 128
    threads covers a row), at most 16 query heads per kv head, a capacity in whole slices."""
    return (
        spec.dtype in CUDA_TYPES
        and spec.head_dim % 32 == 0
        and spec.head_dim <= 128
        and spec.n_heads % spec.n_kv_heads == 0
        and spec.n_heads // spec.n_kv_heads <= 16
        and spec.capacity % KEYS_PER_BLOCK == 0
    )
