"""AttentionStep for one new token on MLX's CUDA backend: append its key/value to a fixed-capacity
cache in place, then causal grouped-query attention over every filled row, in one launch.

One block per (kv head, slice of KPB cache rows). A block first issues the loads of its slice's
keys and values (16 bytes per thread per row: a row is spread over D/8 lanes), then normalizes
(optional per-head RMS norm) and rotates its query heads and the new key, scores the slice for
every query head of the group (partial dot products meet through lane shuffles), takes the
slice's softmax statistics and its unnormalized output. The new row is read from the kernel's
inputs, never from the cache (no block reads a row another block writes); the block whose slice
holds it stores it in the cache. The last block of a kv head to finish (a counter per kv head,
reset by that block) merges the slices' partial outputs. Slices past the new row write nothing,
so the grid depends on the capacity only, never on the length: one traced step serves every
position. The new offset is an output of the launch too (every slot of the static cache's
offset array, core/cache.py).

The cache buffers and the counters are written in place: they must be owned by the cache and
the binding alone, and every reader runs on the same stream after this launch."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.cache import OFFSET_SLOTS
from mlx_omnia.engine.core.kernels import cuda_kernel, own_scratch
from mlx_omnia.engine.core.kernels.cuda_common import CUDA_TYPES, HEADER, STATIC_SMEM, flag
from mlx_omnia.engine.core.kernels.qmv.cuda import (
    QMV_HEADER,
    Launch,
    QmvSpec,
    blocks_of,
    chain_source,
    chain_wait,
    qmv_smem,
)
from mlx_omnia.engine.core.kernels.qmv.cuda import spec_fits as qmv_fits

MAX_SLICES = 640  # slices one merge can take (its weights sit in shared memory): 40960 rows
MAX_HEAD_SPLIT = 2  # blocks a slice's query heads can be split over (counters per kv head)
THREADS = 128      # a block's threads (NT in the kernel)

ATTENTION_DEVICE = r"""
namespace omnia {

// A load of q, k_new or v_new: through L2 (ld.global.cg) when CG, they being written by other
// blocks of this launch (a chained launch's first phase).
template <bool CG, typename U> __device__ __forceinline__ U ld_new(const U* p) {
  if constexpr (CG) return __ldcg(p); else return *p;
}

// `block`: this block's index among the attention's blocks (blockIdx.x, or a chained launch's
// ticket). CG: q, k_new and v_new come from the first phase of a chained launch: `wait`,
// `wait_for` say when they are there (wait_published), after the loads that do not need them.
// HS: the query heads of a kv head are split over HS blocks of a slice (GB = G / HS heads
// each, their own partials, counter and merge); every head's arithmetic is the same at any HS.
template <typename T, int H, int HKV, int D, int KPB, bool QN, bool KN, bool TRAD, bool CG = false,
          int HS = 1>
__device__ __forceinline__ void attention_step(
    const T* q, const T* k_new, const T* v_new, const T* qw, const T* kw, const float* inv_freq,
    const T* k_cache, const T* v_cache, const int* pos_p, const int* counters, float* part_o,
    float* part_ml, T* out, int* next_pos, float eps_q, float eps_k, float scale, int cap,
    int block, const int* wait = nullptr, int wait_for = 0) {
  constexpr int G = H / HKV;          // query heads of a kv head
  constexpr int GB = G / HS;          // of them, this block's
  constexpr int NT = 128, NW = NT / 32;
  constexpr int CH = D / 8;          // 16-byte chunks of a row: the lanes of one key
  constexpr int SLOTS = NT / CH;     // keys the block holds at once
  constexpr int ITER = KPB / SLOTS;  // keys per thread
  constexpr int MAXS = @MAX_SLICES@;
  constexpr int BUF = NW * GB * D > GB * MAXS ? NW * GB * D : GB * MAXS;
  static_assert(KPB % SLOTS == 0 && (CH & (CH - 1)) == 0 && CH <= 32 && G % HS == 0, "geometry");
  __shared__ __align__(16) float hs[GB + 1][D];  // rotated query heads, then the rotated new key
  __shared__ float p[GB][KPB];
  __shared__ float stat[GB][2];
  __shared__ __align__(16) float buf[BUF];      // per-warp outputs, then the merge weights
  __shared__ int last;
  const int slices = cap / KPB;
  const int kvh = block / (slices * HS), split = block % slices;
  const int hh = HS == 1 ? 0 : block / slices % HS;  // which GB heads of the kv head
  const int hoff = hh * GB;  // this block's first query head within its kv head's (0: HS 1)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = tid / CH, c = tid % CH;
  const int pos = pos_p[0];
  const int t0 = split * KPB;
  const int n = min(KPB, pos + 1 - t0);  // keys of this slice (<= 0: nothing to do)
  if (block == 0 && tid < @OFFSET_SLOTS@) next_pos[tid] = pos + 1;  // every slot (core/cache.py)
  if (n <= 0) return;
  T* kc = const_cast<T*>(k_cache) + (size_t)kvh * cap * D;
  T* vc = const_cast<T*>(v_cache) + (size_t)kvh * cap * D;
  // Every load of the slice's cached rows first, so their latencies overlap each other and the
  // head work (the new row's value is read below, with q and k_new).
  uint4 kr[ITER], vr[ITER];
#pragma unroll
  for (int u = 0; u < ITER; ++u) {
    const int r = u * SLOTS + slot, t = t0 + r;
    kr[u] = make_uint4(0u, 0u, 0u, 0u);
    vr[u] = make_uint4(0u, 0u, 0u, 0u);
    if (r < n && t != pos) {
      vr[u] = reinterpret_cast<const uint4*>(vc + (size_t)t * D)[c];
      kr[u] = reinterpret_cast<const uint4*>(kc + (size_t)t * D)[c];
    }
  }
  // The head work's inputs too, before any of it: this warp's heads (j = warp + h * NW, the GB
  // query heads then the new key), their norm weights and the rope frequencies, so the loads
  // of the head work overlap the slice's instead of following each other.
  constexpr int E = D / 32;              // dimensions per lane of one head
  constexpr int HPW = (GB + NW) / NW;    // heads per warp, rounded up (GB + 1 heads)
  float hv[HPW][E], hw[HPW][E], fr[E];
#pragma unroll
  for (int h = 0; h < HPW; ++h) {
    const int j = warp + h * NW;
    const bool nrm = j == GB ? KN : QN;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      hw[h][e] = 0.f;
      if (j <= GB && nrm) hw[h][e] = to_f<T>((j == GB ? kw : qw)[lane + 32 * e]);  // null: no norm
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = lane + 32 * e;
    fr[e] = inv_freq[TRAD ? d / 2 : d % (D / 2)];
  }
  wait_published(wait, wait_for);
#pragma unroll
  for (int h = 0; h < HPW; ++h) {
    const int j = warp + h * NW;
    if (j <= GB) {
      const T* src = j == GB ? k_new + kvh * D : q + (kvh * G + hoff + j) * D;
#pragma unroll
      for (int e = 0; e < E; ++e) hv[h][e] = to_f<T>(ld_new<CG>(src + lane + 32 * e));
    }
  }
#pragma unroll
  for (int u = 0; u < ITER; ++u) {
    const int r = u * SLOTS + slot;
    if (r < n && t0 + r == pos) vr[u] = ld_new<CG>(reinterpret_cast<const uint4*>(v_new + kvh * D) + c);
  }
  // Norm (optional) then rope of each query head of the group and of the new key: warp per head.
#pragma unroll
  for (int h = 0; h < HPW; ++h) {
    const int j = warp + h * NW;
    if (j > GB) continue;  // uniform over the warp
    const bool is_k = j == GB;
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float v = hv[h][e];
      hs[j][lane + 32 * e] = v;
      ss = fmaf(v, v, ss);
    }
    if (is_k ? KN : QN) {
      ss = warp_sum(ss);
      const float inv = rsqrtf(ss / D + (is_k ? eps_k : eps_q));
#pragma unroll
      for (int e = 0; e < E; ++e) hs[j][lane + 32 * e] = rnd<T>(hw[h][e] * rnd<T>(hv[h][e] * inv));
    }
    __syncwarp();
    const float fpos = (float)pos;
    float rot[D / 32];
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int d = lane + 32 * e;
      float sn, cs;
      sincosf(fpos * fr[e], &sn, &cs);
      if constexpr (TRAD) {
        const float x1 = hs[j][d & ~1], x2 = hs[j][d | 1];
        rot[e] = (d & 1) ? x1 * sn + x2 * cs : x1 * cs - x2 * sn;
      } else {
        rot[e] = d < D / 2 ? hs[j][d] * cs - hs[j][d + D / 2] * sn
                           : hs[j][d - D / 2] * sn + hs[j][d] * cs;
      }
    }
    __syncwarp();
#pragma unroll
    for (int e = 0; e < D / 32; ++e) hs[j][lane + 32 * e] = rnd<T>(rot[e]);
  }
  __syncthreads();
  if (hh == 0 && pos < t0 + KPB) {  // one block of the kv head stores the new row
    for (int d = tid; d < D; d += NT) {
      kc[(size_t)pos * D + d] = from_f<T>(hs[GB][d]);
      vc[(size_t)pos * D + d] = ld_new<CG>(v_new + kvh * D + d);
    }
  }
  // Scores: the CH lanes of a key each take 8 dimensions; their sums meet through shuffles.
#pragma unroll
  for (int u = 0; u < ITER; ++u) {
    const int r = u * SLOTS + slot;
    float kf[8];
    if (t0 + r == pos) {
#pragma unroll
      for (int e = 0; e < 8; ++e) kf[e] = hs[GB][c * 8 + e];
    } else {
      unpack8<T>(kr[u], kf);
    }
    float sc[GB];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
      const float4 qa = *reinterpret_cast<const float4*>(&hs[g][c * 8]);
      const float4 qb = *reinterpret_cast<const float4*>(&hs[g][c * 8 + 4]);
      float a = qa.x * kf[0];
      a = fmaf(qa.y, kf[1], a); a = fmaf(qa.z, kf[2], a); a = fmaf(qa.w, kf[3], a);
      a = fmaf(qb.x, kf[4], a); a = fmaf(qb.y, kf[5], a); a = fmaf(qb.z, kf[6], a);
      sc[g] = fmaf(qb.w, kf[7], a);
    }
#pragma unroll
    for (int o = CH / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int g = 0; g < GB; ++g) sc[g] += __shfl_xor_sync(0xFFFFFFFFu, sc[g], o);
    }
    if (c == 0 && r < n) {
#pragma unroll
      for (int g = 0; g < GB; ++g) p[g][r] = sc[g] * scale;
    }
  }
  __syncthreads();
  for (int g = warp; g < GB; g += NW) {
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
  // Values: each thread accumulates its 8 dimensions over its keys, GH heads at a time (fewer
  // registers); the slots of a warp meet through shuffles, the warps in `buf`.
  constexpr int GH = GB < 4 ? GB : 4;
  for (int g0 = 0; g0 < GB; g0 += GH) {
    float o[GH][8];
#pragma unroll
    for (int g = 0; g < GH; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] = 0.f;
    }
#pragma unroll
    for (int u = 0; u < ITER; ++u) {
      const int r = u * SLOTS + slot;
      if (r < n) {
        float vf[8];
        unpack8<T>(vr[u], vf);
#pragma unroll
        for (int g = 0; g < GH; ++g) {
          const float pg = g0 + g < GB ? p[g0 + g][r] : 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) o[g][e] = fmaf(pg, vf[e], o[g][e]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GH; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
#pragma unroll
        for (int off = CH; off < 32; off <<= 1) o[g][e] += __shfl_xor_sync(0xFFFFFFFFu, o[g][e], off);
      }
    }
    if (lane < CH) {
#pragma unroll
      for (int g = 0; g < GH; ++g) {
        if (g0 + g >= GB) continue;
        float4* dst = reinterpret_cast<float4*>(&buf[(warp * GB + g0 + g) * D + c * 8]);
        dst[0] = make_float4(o[g][0], o[g][1], o[g][2], o[g][3]);
        dst[1] = make_float4(o[g][4], o[g][5], o[g][6], o[g][7]);
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < GB * D; i += NT) {
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) acc += buf[w * GB * D + i];
    part_o[((size_t)split * H + kvh * G + hoff) * D + i] = acc;
  }
  if (tid < GB) {
    part_ml[((size_t)split * H + kvh * G + hoff + tid) * 2] = stat[tid][0];
    part_ml[((size_t)split * H + kvh * G + hoff + tid) * 2 + 1] = stat[tid][1];
  }
  // The last block of this kv head to get here merges every slice.
  const int active = (pos + KPB) / KPB;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* counter = const_cast<int*>(counters) + kvh * HS + hh;
    const int done = atomicAdd(counter, 1);
    last = done == active - 1;
    if (last) *counter = 0;  // every block of the launch has counted: ready for the next one
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Merge weights: each warp takes its heads (g = warp + h * NW); a lane reads (m, l) of slices
  // lane, lane + 32, ... (the first 32 of every head of the warp requested at once), the
  // weights exp(m - max) go to buf[g * active + slice] and the head's sum of l * weight to stat.
  constexpr int GPW = (GB + NW - 1) / NW;
  float2 ml0[GPW];
#pragma unroll
  for (int h = 0; h < GPW; ++h) {
    const int g = warp + h * NW;
    ml0[h] = make_float2(-omnia_inf(), 0.f);
    if (g < GB && lane < active)
      ml0[h] = __ldcg(reinterpret_cast<const float2*>(part_ml + ((size_t)lane * H + kvh * G + hoff + g) * 2));
  }
#pragma unroll
  for (int h = 0; h < GPW; ++h) {
    const int g = warp + h * NW;
    if (g >= GB) continue;  // uniform over the warp
    const float* ml = part_ml + (size_t)(kvh * G + hoff + g) * 2;
    float* wg = buf + g * active;
    float m = ml0[h].x;
    for (int sp = lane + 32; sp < active; sp += 32) {
      const float v = __ldcg(ml + (size_t)sp * H * 2);
      wg[sp] = v;
      m = fmaxf(m, v);
    }
    m = warp_max(m);
    float l = 0.f;
    if (lane < active) {
      const float w = __expf(ml0[h].x - m);
      l = fmaf(ml0[h].y, w, l);
      wg[lane] = w;
    }
    for (int sp = lane + 32; sp < active; sp += 32) {
      const float w = __expf(wg[sp] - m);
      l = fmaf(__ldcg(ml + (size_t)sp * H * 2 + 1), w, l);
      wg[sp] = w;
    }
    l = warp_sum(l);
    if (lane == 0) stat[g][1] = l;
  }
  __syncthreads();
  // Each thread owns OUT4 groups of 4 neighbouring outputs and reads their partials SB slices
  // at a time, every load of a batch in flight together (16 per thread; past the last slice
  // they read nothing and weigh 0): the merge is latency bound.
  constexpr int F4 = GB * D / 4, OUT4 = (F4 + NT - 1) / NT, SB = 16 / OUT4;
  static_assert(OUT4 >= 1 && OUT4 <= 2, "merge geometry");
  constexpr size_t STRIDE4 = (size_t)H * D / 4;
  const float4* po4 = reinterpret_cast<const float4*>(part_o + (size_t)kvh * G * D + (size_t)hoff * D);
  float4 acc[OUT4];
#pragma unroll
  for (int o = 0; o < OUT4; ++o) acc[o] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int sp0 = 0; sp0 < active; sp0 += SB) {
    float4 v[OUT4][SB];
#pragma unroll
    for (int o = 0; o < OUT4; ++o) {
      const int i4 = tid + o * NT;
#pragma unroll
      for (int u = 0; u < SB; ++u) {
        v[o][u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i4 < F4 && sp0 + u < active) v[o][u] = __ldcg(po4 + (size_t)(sp0 + u) * STRIDE4 + i4);
      }
    }
#pragma unroll
    for (int o = 0; o < OUT4; ++o) {
      const float* wg = buf + min((tid + o * NT) / (D / 4), GB - 1) * active;
#pragma unroll
      for (int u = 0; u < SB; ++u) {
        const float w = sp0 + u < active ? wg[sp0 + u] : 0.f;
        acc[o].x = fmaf(v[o][u].x, w, acc[o].x); acc[o].y = fmaf(v[o][u].y, w, acc[o].y);
        acc[o].z = fmaf(v[o][u].z, w, acc[o].z); acc[o].w = fmaf(v[o][u].w, w, acc[o].w);
      }
    }
  }
#pragma unroll
  for (int o = 0; o < OUT4; ++o) {
    const int i4 = tid + o * NT;
    if (i4 >= F4) continue;
    const float l = stat[i4 / (D / 4)][1];
    T* dst = out + kvh * G * D + hoff * D + i4 * 4;
    dst[0] = from_f<T>(acc[o].x / l); dst[1] = from_f<T>(acc[o].y / l);
    dst[2] = from_f<T>(acc[o].z / l); dst[3] = from_f<T>(acc[o].w / l);
  }
}

}  // namespace omnia
""".replace("@MAX_SLICES@", str(MAX_SLICES)).replace("@OFFSET_SLOTS@", str(OFFSET_SLOTS))
ATTENTION_HEADER = HEADER + ATTENTION_DEVICE


def keys_per_block(capacity: int) -> int:
    """Rows per slice: 32 up to 2048 rows of capacity, then 64."""
    return 32 if capacity <= 2048 else 64


@dataclass(frozen=True)
class AttentionStepSpec:
    dtype: mx.Dtype
    n_heads: int
    n_kv_heads: int
    head_dim: int
    capacity: int            # cache rows; only the slice size it implies is baked in the source
    scale: float
    q_eps: float | None = None  # per-head RMS norm of the queries (weight input `qw`)
    k_eps: float | None = None
    traditional: bool = False   # rope pairs (2i, 2i+1) instead of (i, i + D/2)
    head_split: int = 1         # blocks a slice's query heads are split over (HS)

    @property
    def keys_per_block(self) -> int:
        return keys_per_block(self.capacity)

    @property
    def slices(self) -> int:
        return self.capacity // self.keys_per_block

    def tag(self) -> str:
        consts = hashlib.sha1(repr((self.scale, self.q_eps, self.k_eps)).encode()).hexdigest()[:8]
        return (
            f"{str(self.dtype).split('.')[-1]}_h{self.n_heads}_kv{self.n_kv_heads}"
            f"_d{self.head_dim}_s{self.keys_per_block}{'_trad' if self.traditional else ''}"
            f"{f'_hs{self.head_split}' if self.head_split != 1 else ''}_{consts}"
        )

    def input_names(self) -> tuple[str, ...]:
        names = ["q", "k_new", "v_new"]
        if self.q_eps is not None:
            names.append("qw")
        if self.k_eps is not None:
            names.append("kw")
        return (*names, "inv_freq", "k_cache", "v_cache", "pos", "counters")


def attention_call(spec: AttentionStepSpec, *, block: str = "blockIdx.x", coherent: bool = False,
                   wait: str | None = None, names: Mapping[str, str] | None = None) -> str:
    """The attention_step call. `block`: this block's index among the attention's blocks;
    `coherent` / `wait`: q, k_new, v_new come from the first phase of a chained launch ("count,
    n": chain_wait); `names`: the launch's variable for an input or output where it differs."""
    t = CUDA_TYPES[spec.dtype]
    qn, kn = spec.q_eps is not None, spec.k_eps is not None
    rename = dict(names or {})

    def n(name: str) -> str:
        return rename.get(name, name)

    return (
        f"omnia::attention_step<{t}, {spec.n_heads}, {spec.n_kv_heads}, {spec.head_dim}, "
        f"{spec.keys_per_block}, {flag(qn)}, {flag(kn)}, {flag(spec.traditional)}, "
        f"{flag(coherent)}{f', {spec.head_split}' if spec.head_split != 1 else ''}>("
        f"{n('q')}, {n('k_new')}, {n('v_new')}, "
        f"{n('qw') if qn else 'nullptr'}, {n('kw') if kn else 'nullptr'}, {n('inv_freq')}, "
        f"{n('k_cache')}, {n('v_cache')}, {n('pos')}, {n('counters')}, {n('part_o')}, "
        f"{n('part_ml')}, {n('out')}, {n('next_pos')}, {float(spec.q_eps or 0.0)!r}f, "
        f"{float(spec.k_eps or 0.0)!r}f, {float(spec.scale)!r}f, {n('k_cache')}_shape[2], "
        f"{block}{', ' + wait if wait else ''});\n"
    )


def output_shapes(spec: AttentionStepSpec, lead: tuple[int, ...]) -> list[tuple[int, ...]]:
    """out, next_pos. next_pos has the static cache offset's own shape (OFFSET_SLOTS copies): a
    reshape after the launch would be one more primitive per layer and token for MLX to
    dispatch. The slices' partial outputs live in the launch scratch (`partials`)."""
    return [(*lead, spec.n_heads * spec.head_dim), (OFFSET_SLOTS,)]


def output_dtypes(spec: AttentionStepSpec) -> list[mx.Dtype]:
    return [spec.dtype, mx.int32]


def partials_bytes(n_heads: int, head_dim: int) -> int:
    """Scratch bytes of the slices' partial outputs and (max, sum) pairs at any capacity (at
    most MAX_SLICES slices: the source does not depend on the capacity)."""
    return MAX_SLICES * n_heads * (head_dim + 2) * 4


def partials(spec: AttentionStepSpec, at: str = "scratch") -> str:
    """The kernel body's part_o and part_ml pointers, in the float32 scratch from `at`."""
    return (
        f"float* part_o = const_cast<float*>({at});\n"
        f"float* part_ml = part_o + {MAX_SLICES * spec.n_heads * spec.head_dim};\n"
    )


def blocks(spec: AttentionStepSpec) -> int:
    return spec.n_kv_heads * spec.head_split * spec.slices


@cache
def launcher(
    spec: AttentionStepSpec, lead: tuple[int, ...]
) -> Callable[..., tuple[mx.array, mx.array]]:
    """The launch for `spec`: inputs as `input_names` -> (attention output, next offset). The
    partial outputs go to the shared launch scratch (launch_scratch)."""
    kernel = cuda_kernel(
        f"omnia_attention_step_{spec.tag()}", (*spec.input_names(), "scratch"),
        ("out", "next_pos"), partials(spec) + attention_call(spec), ATTENTION_HEADER,
    )
    shapes, dtypes = output_shapes(spec, lead), output_dtypes(spec)
    grid = (blocks(spec) * THREADS, 1, 1)
    own = own_scratch(partials_bytes(spec.n_heads, spec.head_dim))

    def call(inputs: list[mx.array], scratch: mx.array | None = None) -> tuple[mx.array, mx.array]:
        outs: Any = kernel(
            inputs=[*inputs, scratch if scratch is not None else own()], output_shapes=shapes,
            output_dtypes=dtypes, grid=grid, threadgroup=(THREADS, 1, 1),
        )
        return outs[0], outs[1]

    return call


def spec_fits(spec: AttentionStepSpec) -> bool:
    """Geometry this kernel computes: head_dim 32, 64 or 128 (a row is a power of two of 16-byte
    lane chunks), at most 8 query heads per kv head (shared memory), a capacity in whole slices
    and at most MAX_SLICES of them."""
    return (
        spec.dtype in CUDA_TYPES
        and spec.head_dim in (32, 64, 128)
        and spec.n_heads % spec.n_kv_heads == 0
        and spec.n_heads // spec.n_kv_heads <= 8
        and spec.head_split in range(1, MAX_HEAD_SPLIT + 1)
        and (spec.n_heads // spec.n_kv_heads) % spec.head_split == 0
        and spec.capacity % spec.keys_per_block == 0
        and spec.slices <= MAX_SLICES
    )


# -- q/k/v then attention, one launch -------------------------------------------------------
def attention_smem(spec: AttentionStepSpec) -> int:
    """Bytes of the attention device function's static shared memory (hs, p, stat, buf, last)."""
    g, d, kpb = spec.n_heads // spec.n_kv_heads // spec.head_split, spec.head_dim, spec.keys_per_block
    buf = max(THREADS // 32 * g * d, g * MAX_SLICES)
    return 4 * ((g + 1) * d + g * kpb + 2 * g + buf + 1)


def attend_qkv_spec(qkv: QmvSpec) -> QmvSpec:
    """The q/k/v projection as the first phase of a launch of the attention's block size: its
    own launch but with THREADS / 32 warps, and for quantized weights two rows a lane group
    (half the blocks: Qwen3-30B-A3B's 640 + 96 blocks did not fit one wave of the H200 at 4
    blocks an SM, so the attention's blocks started only as projection blocks ended; ncu,
    2026-12-04). Two rows a group leave each row's sums as they are; the warp count orders
    the norm's partial sums (k = 2560 on the H200: not the q/k/v launch's own bits)."""
    cfg = qkv.config
    rows = cfg.rows
    if qkv.bits is not None and rows == 1 and all(n % 2 == 0 for n in qkv.rows):
        rows = 2
    return replace(qkv, launch=Launch(lanes=cfg.lanes, rows=rows, warps=THREADS // 32,
                                      unroll=cfg.unroll, prefetch=cfg.prefetch, loop=cfg.loop))


def project_attend_fits(qkv: QmvSpec, spec: AttentionStepSpec) -> bool:
    """q/k/v projections (three segments, no gate or residual) then the attention of them, in
    one launch: each fits alone, in one dtype, the segments are the attention's q, k and v
    widths, and the two phases' static shared memory fits one block."""
    first = attend_qkv_spec(qkv)
    h, kv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    return (
        qmv_fits(first) and spec_fits(spec)
        and qkv.rows == (h * d, kv * d, kv * d)
        and qkv.gate is None and not qkv.residual
        and qkv.dtype == spec.dtype
        and qmv_smem(first) + attention_smem(spec) + 256 <= STATIC_SMEM
    )


def project_attend_qkv_bytes(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Scratch bytes before the partials: q, k and v (at most 4 bytes a value, 16-byte
    aligned)."""
    return -(-(n_heads + 2 * n_kv_heads) * head_dim * 4 // 16) * 16


def project_attend_scratch_bytes(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Scratch bytes of project_attend at any capacity: q, k, v and the partials."""
    return (project_attend_qkv_bytes(n_heads, n_kv_heads, head_dim)
            + partials_bytes(n_heads, head_dim))


@cache
def project_attend_launcher(
    qkv: QmvSpec, spec: AttentionStepSpec, lead: tuple[int, ...]
) -> Callable[..., tuple[mx.array, mx.array]]:
    """(x [*lead, in], q/k/v weights..., norm weight [in]?, qw?, kw?, inv_freq, k_cache, v_cache,
    pos, heads (the attention's counters), counters [3] int32 zeros) -> (attention output,
    next offset), in one launch: the q/k/v blocks take the first tickets and write q, k, v to
    the launch scratch (launch_scratch, with the attention's partial outputs); the attention's
    blocks issue their cached rows' loads, then wait for them (chain_source). Both counter
    arrays are written in place and left zero: the caller owns them."""
    first = attend_qkv_spec(qkv)
    nb1, nb2 = blocks_of(first), blocks(spec)
    qkv_inputs = first.input_names()[1:]
    att_inputs = [n for n in spec.input_names() if n not in ("q", "k_new", "v_new", "counters")]
    names = ("x", *qkv_inputs, *att_inputs, "heads", "counters", "scratch")
    t = CUDA_TYPES[spec.dtype]
    h, kv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    qkv_words = project_attend_qkv_bytes(h, kv, d) // 4
    source = (
        f"{t}* q = reinterpret_cast<{t}*>(const_cast<float*>(scratch));\n"
        f"{t}* k = q + {h * d};\n{t}* v = k + {kv * d};\n"
        + partials(spec, at=f"scratch + {qkv_words}")
    ) + chain_source(
        nb1,
        first.source(block="t", names={"y0": "q", "y1": "k", "y2": "v"}),
        attention_call(spec, block=f"t - {nb1}", coherent=True, wait=chain_wait(nb1),
                       names={"k_new": "k", "v_new": "v", "counters": "heads"}),
        nb2,
    )
    kernel = cuda_kernel(f"omnia_project_attend__{first.name()}__{spec.tag()}", names,
                         ("out", "next_pos"), source, QMV_HEADER + ATTENTION_DEVICE)
    shapes, dtypes = output_shapes(spec, lead), output_dtypes(spec)
    grid = ((nb1 + nb2) * THREADS, 1, 1)
    own = own_scratch(project_attend_scratch_bytes(spec.n_heads, spec.n_kv_heads, spec.head_dim))

    def call(inputs: list[mx.array], scratch: mx.array | None = None) -> tuple[mx.array, mx.array]:
        outs: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                           output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                           threadgroup=(THREADS, 1, 1))
        return outs[0], outs[1]

    return call
