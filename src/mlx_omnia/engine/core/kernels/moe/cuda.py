"""Mixture-of-experts decode for one token on MLX's CUDA backend: routing, the selected experts'
gate/up projections, their down projections combined.

- `route`: one warp. Softmax (float32) of the router logits, the top-k experts (ties to the lower
  id), their weights (renormalized when asked, or the softmax of the k chosen logits).
- `expert_gate_up`: act(x G[e].T) * (x U[e].T) for the k selected experts e. Groups of LPR lanes
  each compute one (expert, row) pair: the gate row and the up row of expert e, lanes striding
  the rows' 16-byte chunks. The input sits in shared memory (as floats, prescaled for 4 bits,
  with each chunk's sum, as the qmv kernel stages it).
- `expert_down`: sum_j w_j (h_j D[e_j].T) (+ residual). One warp per output row: the warp's
  lanes split into k groups (one per selected expert) that stride the row's chunks; each group's
  dot product is rounded as the core's matmul output, weighted, rounded again, and the warp sums
  the k products.

Weights are the stacked expert matrices [n_experts, rows, in], dense in the activation dtype or
affine-quantized along the input (scales and biases in the activation dtype): row r of expert e
is row e * rows + r of the flattened stack, which is how `QmvRow` (the qmv kernel's chunk
arithmetic, reused here) addresses it. Rounding follows the core modules (gather_qmm outputs
rounded to the activation dtype, then the activation, the weighting and the sum as MLX ops
round them)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.kernels import cuda_kernel, own_scratch
from mlx_omnia.engine.core.kernels.cuda_common import CUDA_TYPES, STATIC_SMEM, flag
from mlx_omnia.engine.core.kernels.qmv.cuda import (
    MAX_ROWS_STAGED,
    QMV_HEADER,
    Launch,
    QmvSpec,
    blocks_of,
    chain_source,
    chain_wait,
    spec_fits,
    staging,
    staging_bytes,
)

MAX_EXPERTS = 512  # router width one warp holds in registers (16 logits per lane)
MAX_TOP_K = 32     # selected experts: one lane group each in the combine

MOE_HEADER = QMV_HEADER + r"""
namespace omnia {

// Dense weights: the 8 inputs of chunk c of input row `row`, staged as T in xs [row][K]
// (quantized weights read theirs through QmvRow::dot_staged).
template <typename T, int K>
__device__ __forceinline__ void dense_chunk(const T* xs, int row, int c, float* xf) {
  unpack8<T>(reinterpret_cast<const uint4*>(xs + (size_t)row * K)[c], xf);
}

// ORDER 0: softmax over every expert, top k of the probabilities (NORMALIZE: divided by their
// sum); ORDER 1: top k of the logits, softmax over those k.
template <typename T, int E, int TOPK, int ORDER, bool NORMALIZE, bool CG = false>
__device__ __forceinline__ void route(const T* logits, T* weights, unsigned int* ids) {
  constexpr int PER = (E + 31) / 32;
  const int lane = threadIdx.x & 31;
  float v[PER];
  float m = -omnia_inf();
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    if constexpr (CG) {
      v[i] = e < E ? to_f<T>(__ldcg(logits + e)) : -omnia_inf();
    } else {
      v[i] = e < E ? to_f<T>(logits[e]) : -omnia_inf();
    }
    m = fmaxf(m, v[i]);
  }
  m = warp_max(m);
  if constexpr (ORDER == 0) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      v[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
      s += v[i];
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] = lane + 32 * i < E ? v[i] / s : -1.f;
  }
  // k rounds of a warp-wide argmax; the winner's value is struck out.
  float mine = 0.f;  // lane j keeps the j-th chosen value
  int my_id = 0;
  for (int j = 0; j < TOPK; ++j) {
    float best = -omnia_inf();
    int bi = 0x7FFFFFFF;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (v[i] > best) { best = v[i]; bi = lane + 32 * i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, o);
      const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
      if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
    }
    if (lane == j) { mine = best; my_id = bi; }
    if ((bi & 31) == lane) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        if (lane + 32 * i == bi) v[i] = -omnia_inf();
      }
    }
  }
  float w = mine;
  if constexpr (ORDER == 1) {
    const float top = __shfl_sync(0xFFFFFFFFu, mine, 0);  // the largest chosen logit
    w = lane < TOPK ? expf(mine - top) : 0.f;
    w /= warp_sum(w);
  } else if constexpr (NORMALIZE) {
    w /= warp_sum(lane < TOPK ? mine : 0.f);
  }
  if (lane < TOPK) {
    weights[lane] = from_f<T>(w);
    ids[lane] = (unsigned int)my_id;
  }
}

// The selected experts' down weights, requested into L2 by the gate/up blocks once the ids are
// known (prefetch.global.L2: no register, no value changed), so that down blocks which start
// only when gate/up blocks end read them from L2. Each expert's ROWS rows of the stacked
// matrices are contiguous: its weights, then (quantized) its scales and biases, 128-byte lines
// numbered expert by expert; thread g of the gate/up blocks requests lines g, g + step, ...
template <typename T, int BITS, int GROUP, int K, int ROWS, int TOPK>
struct DownL2 {
  static constexpr long long WB = (long long)ROWS * K * (BITS == 0 ? 8 * (int)sizeof(T) : BITS) / 8;
  static constexpr long long SB = BITS == 0 ? 0 : (long long)ROWS * (K / GROUP) * (int)sizeof(T);
  static constexpr int LW = (int)((WB + 127) / 128), LS = (int)((SB + 127) / 128);
  static constexpr int LINES = LW + 2 * LS;  // an expert's
  static constexpr int TOTAL = TOPK * LINES;

  static __device__ __forceinline__ void line(const void* w, const T* s, const T* b,
                                              unsigned int id, int i) {
    const int l = i % LINES;
    const char* p;
    if (l < LW) {
      p = reinterpret_cast<const char*>(w) + id * WB + min((long long)l * 128, WB - 1);
    } else {
      const int m = (l - LW) % LS;
      const char* base = reinterpret_cast<const char*>(l - LW < LS ? s : b);
      p = base + id * SB + min((long long)m * 128, SB - 1);
    }
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
  }
};

// out[j][r] = rnd(act(rnd(x . G[ids[j]][r])) * rnd(x . U[ids[j]][r])), G and U the first and
// last HID rows of each expert's stacked [2 * HID] rows, act silu; NORM: x RMS-normalized
// first (weight g, eps). `block`: this block's index among the launch's gate/up blocks.
// CG: x and ids were written by other blocks of this launch (read through L2), and `wait`,
// `wait_for` say when (wait_published, first: the rows depend on ids); EXT: the staging lives
// in the caller's shared buffer `ext` (StagingBytes). DOWN_ROWS > 0 (a chained launch whose
// down phase follows): the down weights dw, ds, db of the selected experts are requested into
// L2 (DownL2; `blocks`: the launch's gate/up blocks). IDS_SHARED: `ids` is in this block's
// shared memory (the block routed itself), read as is.
template <typename T, int BITS, int GROUP, int K, int HID, int TOPK, int LPR, int NWARPS,
          bool NORM, bool CG = false, bool EXT = false, int DOWN_ROWS = 0, bool IDS_SHARED = false>
__device__ __forceinline__ void expert_gate_up(const T* x, const unsigned int* ids,
                                               const void* w, const T* s, const T* b, T* out,
                                               const T* g, float eps, int block,
                                               const int* wait = nullptr, int wait_for = 0,
                                               char* ext = nullptr, const void* dw = nullptr,
                                               const T* ds = nullptr, const T* db = nullptr,
                                               int blocks = 0) {
  using Row = QmvRow<T, BITS, GROUP, K>;
  constexpr int VPC = Row::VPC, CHUNKS = Row::CHUNKS;
  constexpr int NT = NWARPS * 32;
  using Staging = StagingBytes<T, BITS == 0 ? 4 : K, BITS == 0 ? 1 : CHUNKS, BITS == 0 ? K : 8>;
  float* xq;
  float2* xsum;
  T* xs;
  if constexpr (EXT) {
    Staging::carve(ext, xq, xsum, xs);
  } else {
    __shared__ __align__(16) float s_xq[BITS == 0 ? 4 : K];
    __shared__ float2 s_xsum[BITS == 0 ? 1 : CHUNKS];
    __shared__ __align__(16) T s_xs[BITS == 0 ? K : 8];
    xq = s_xq;
    xsum = s_xsum;
    xs = s_xs;
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int GPW = 32 / LPR;
  const int grp = lane / LPR, sl = lane % LPR;
  int pair = (block * NWARPS + warp) * GPW + grp;  // j * HID + r
  const bool valid = pair < TOPK * HID;
  if (!valid) pair = 0;  // recomputes pair 0 (the shuffles need every lane), writes nothing
  const int j = pair / HID, r = pair % HID;
  wait_published(wait, wait_for);
  auto read_id = [&](int i) -> unsigned int {
    if constexpr (CG && !IDS_SHARED) return __ldcg(ids + i); else return ids[i];
  };
  using Down = DownL2<T, BITS, GROUP, HID, DOWN_ROWS, TOPK>;
  const int line0 = block * NT + tid;  // this thread's first down line (DOWN_ROWS > 0)
  unsigned int down_id = 0;
  if constexpr (DOWN_ROWS > 0) {
    if (line0 < Down::TOTAL) down_id = read_id(line0 / Down::LINES);
  }
  const unsigned int id = read_id(j);
  const int gate_row = (int)id * 2 * HID + r, up_row = gate_row + HID;
  // The first chunk's weights are requested before the input is staged.
  const int c0 = min(sl, CHUNKS - 1);
  const typename Row::Load g0 = Row::load(w, s, b, gate_row, c0);
  const typename Row::Load u0 = Row::load(w, s, b, up_row, c0);
  if constexpr (DOWN_ROWS > 0) {
    if (line0 < Down::TOTAL) Down::line(dw, ds, db, down_id, line0);
    for (int i = line0 + blocks * NT; i < Down::TOTAL; i += blocks * NT) {
      Down::line(dw, ds, db, read_id(i / Down::LINES), i);
    }
  }
  stage_rows<T, BITS, K, 1, NORM, NWARPS, CG>(x, xq, xsum, xs, tid, NT, g, eps);
  __syncthreads();
  // The gate and up rows' partial sums over chunk c.
  auto pair_dot = [&](int c, const typename Row::Load& gl, const typename Row::Load& ul,
                      float* d) {
    if constexpr (BITS == 0) {
      float xf[VPC];
      dense_chunk<T, K>(xs, 0, c, xf);
      d[0] = Row::dot(gl, xf, make_float2(0.f, 1.f));
      d[1] = Row::dot(ul, xf, make_float2(0.f, 1.f));
    } else {
      const typename Row::Load ls[2] = {gl, ul};
      Row::template dot_staged<2>(ls, xq, c, xsum[c], d);
    }
  };
  float ag = 0.f, au = 0.f;
  if (sl < CHUNKS) {
    float d[2];
    pair_dot(sl, g0, u0, d);
    ag = d[0];
    au = d[1];
  }
#pragma unroll 2
  for (int c = sl + LPR; c < CHUNKS; c += LPR) {
    const typename Row::Load gl = Row::load(w, s, b, gate_row, c);
    const typename Row::Load ul = Row::load(w, s, b, up_row, c);
    float d[2];
    pair_dot(c, gl, ul, d);
    ag += d[0];
    au += d[1];
  }
#pragma unroll
  for (int o = LPR / 2; o > 0; o >>= 1) {
    ag += __shfl_xor_sync(0xFFFFFFFFu, ag, o);
    au += __shfl_xor_sync(0xFFFFFFFFu, au, o);
  }
  if (sl == 0 && valid) out[pair] = from_f<T>(rnd<T>(silu_r<T>(rnd<T>(ag)) * rnd<T>(au)));
}

// y[r] = rnd(sum_j rnd(rnd(h_j . D[ids[j]][r]) * w_j)) (+ residual, rounded): one warp a row,
// LPE lanes per selected expert. `block`: this block's index among the launch's down blocks;
// CG: h was written by other blocks of this launch (stage_rows reads it through L2), and
// `wait`, `wait_for` say when it is there (wait_published, after the first weights are
// requested).
// HERE: ids, wts and res were written in this launch too (read through L2); `wait_ids`,
// `ids_for` say when ids are there (before the first weights, whose rows depend on them).
// EXT: the staging lives in the caller's shared buffer `ext` (StagingBytes). IDS_SHARED (with
// HERE): ids and wts are in this block's shared memory (the block routed itself), read as is.
template <typename T, int BITS, int GROUP, int K, int OUT, int TOPK, int LPE, int NWARPS,
          bool RESID, bool CG = false, bool HERE = false, bool EXT = false,
          bool IDS_SHARED = false>
__device__ __forceinline__ void expert_down(const T* h, const unsigned int* ids, const T* wts,
                                            const void* w, const T* s, const T* b, const T* res,
                                            T* y, int block, const int* wait = nullptr,
                                            int wait_for = 0, const int* wait_ids = nullptr,
                                            int ids_for = 0, char* ext = nullptr) {
  using Row = QmvRow<T, BITS, GROUP, K>;
  constexpr int VPC = Row::VPC, CHUNKS = Row::CHUNKS;
  constexpr int NT = NWARPS * 32;
  using Staging = StagingBytes<T, BITS == 0 ? 4 : TOPK * K, BITS == 0 ? 1 : TOPK * CHUNKS,
                               BITS == 0 ? TOPK * K : 8>;
  float* xq;
  float2* xsum;
  T* xs;
  if constexpr (EXT) {
    Staging::carve(ext, xq, xsum, xs);
  } else {
    __shared__ __align__(16) float s_xq[BITS == 0 ? 4 : TOPK * K];
    __shared__ float2 s_xsum[BITS == 0 ? 1 : TOPK * CHUNKS];
    __shared__ __align__(16) T s_xs[BITS == 0 ? TOPK * K : 8];
    xq = s_xq;
    xsum = s_xsum;
    xs = s_xs;
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = block * NWARPS + warp;
  const int j = lane / LPE, sl = lane % LPE;
  const bool mine = j < TOPK && r < OUT;
  wait_published(wait_ids, ids_for);
  int row;
  if constexpr (HERE && !IDS_SHARED) {
    row = mine ? (int)__ldcg(ids + j) * OUT + r : 0;
  } else {
    row = mine ? (int)ids[j] * OUT + r : 0;
  }
  // The lane's first PF chunks (up to 4) are requested before the block waits (in a chained
  // launch, for the gate/up blocks) and stages its k inputs.
  constexpr int PER_LANE = (CHUNKS + LPE - 1) / LPE;
  constexpr int PF = PER_LANE < 4 ? PER_LANE : 4;
  typename Row::Load pre[PF];
#pragma unroll
  for (int f = 0; f < PF; ++f) pre[f] = Row::load(w, s, b, row, min(sl + f * LPE, CHUNKS - 1));
  wait_published(wait, wait_for);
  stage_rows<T, BITS, K, TOPK, false, NWARPS, CG>(h, xq, xsum, xs, tid, NT);
  __syncthreads();
  float acc = 0.f;
  if (mine) {
    // Expert j's row over chunk c of its input row.
    auto one_dot = [&](int c, const typename Row::Load& l) -> float {
      if constexpr (BITS == 0) {
        float xf[VPC];
        dense_chunk<T, K>(xs, j, c, xf);
        return Row::dot(l, xf, make_float2(0.f, 1.f));
      } else {
        float d[1];
        Row::template dot_staged<1>(&l, xq + (size_t)j * K, c, xsum[j * CHUNKS + c], d);
        return d[0];
      }
    };
#pragma unroll
    for (int f = 0; f < PF; ++f) {
      if (sl + f * LPE < CHUNKS) acc += one_dot(sl + f * LPE, pre[f]);
    }
#pragma unroll 2
    for (int c = sl + PF * LPE; c < CHUNKS; c += LPE) {
      const typename Row::Load l = Row::load(w, s, b, row, c);
      acc += one_dot(c, l);
    }
  }
#pragma unroll
  for (int o = LPE / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
  float p;
  if constexpr (HERE && !IDS_SHARED) {
    p = mine && sl == 0 ? rnd<T>(rnd<T>(acc) * to_f<T>(__ldcg(wts + j))) : 0.f;
  } else {
    p = mine && sl == 0 ? rnd<T>(rnd<T>(acc) * to_f<T>(wts[j])) : 0.f;
  }
  p = warp_sum(p);
  if (lane == 0 && r < OUT) {
    float v = rnd<T>(p);
    if constexpr (RESID) {
      if constexpr (HERE) v = rnd<T>(to_f<T>(__ldcg(res + r)) + v);
      else v = rnd<T>(to_f<T>(res[r]) + v);
    }
    y[r] = from_f<T>(v);
  }
}

// expert_down at ROWS adjacent output rows a warp (RouteExperts' down phase, EXT and HERE):
// each row's sums are expert_down's, in its order; the first 2 chunks of every row are
// requested before the wait. ROWS 2 halves the down blocks, so they are resident beside the
// gate/up blocks (ROUTE_EXPERTS_DOWN_ROWS; scripts/h200_ab.py `down_two_rows` measures it).
template <typename T, int BITS, int GROUP, int K, int OUT, int TOPK, int LPE, int NWARPS,
          bool RESID, bool CG, bool HERE, bool EXT, bool IDS_SHARED, int ROWS>
__device__ __forceinline__ void expert_down_rows(const T* h, const unsigned int* ids,
                                                 const T* wts, const void* w, const T* s,
                                                 const T* b, const T* res, T* y, int block,
                                                 const int* wait, int wait_for,
                                                 const int* wait_ids, int ids_for, char* ext) {
  using Row = QmvRow<T, BITS, GROUP, K>;
  constexpr int VPC = Row::VPC, CHUNKS = Row::CHUNKS;
  constexpr int NT = NWARPS * 32;
  using Staging = StagingBytes<T, BITS == 0 ? 4 : TOPK * K, BITS == 0 ? 1 : TOPK * CHUNKS,
                               BITS == 0 ? TOPK * K : 8>;
  static_assert(EXT && HERE, "RouteExperts' down phase stages in the launch's buffer");
  float* xq;
  float2* xsum;
  T* xs;
  Staging::carve(ext, xq, xsum, xs);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r0 = (block * NWARPS + warp) * ROWS;  // the warp's rows: r0 .. r0 + ROWS - 1
  const int j = lane / LPE, sl = lane % LPE;
  bool mine[ROWS];
  wait_published(wait_ids, ids_for);
  int row[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    mine[i] = j < TOPK && r0 + i < OUT;
    if constexpr (HERE && !IDS_SHARED) {
      row[i] = mine[i] ? (int)__ldcg(ids + j) * OUT + r0 + i : 0;
    } else {
      row[i] = mine[i] ? (int)ids[j] * OUT + r0 + i : 0;
    }
  }
  // The lane's first PF chunks of each row are requested before the block waits for the
  // gate/up blocks and stages its k inputs.
  constexpr int PER_LANE = (CHUNKS + LPE - 1) / LPE;
  constexpr int PF = PER_LANE < 2 ? PER_LANE : 2;
  typename Row::Load pre[PF][ROWS];
#pragma unroll
  for (int f = 0; f < PF; ++f) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      pre[f][i] = Row::load(w, s, b, row[i], min(sl + f * LPE, CHUNKS - 1));
    }
  }
  wait_published(wait, wait_for);
  stage_rows<T, BITS, K, TOPK, false, NWARPS, CG>(h, xq, xsum, xs, tid, NT);
  __syncthreads();
  float acc[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) acc[i] = 0.f;
  // ROWS rows share each staged input chunk; every row's sums keep the order of one row alone
  // (rows past OUT read row 0 and write nothing).
  if (j < TOPK) {
    // Expert j's ROWS rows over chunk c of its input row.
    auto dots = [&](int c, const typename Row::Load* l, float* d) {
      if constexpr (BITS == 0) {
        float xf[VPC];
        dense_chunk<T, K>(xs, j, c, xf);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) d[i] = Row::dot(l[i], xf, make_float2(0.f, 1.f));
      } else {
        Row::template dot_staged<ROWS>(l, xq + (size_t)j * K, c, xsum[j * CHUNKS + c], d);
      }
    };
#pragma unroll
    for (int f = 0; f < PF; ++f) {
      if (sl + f * LPE < CHUNKS) {
        float d[ROWS];
        dots(sl + f * LPE, pre[f], d);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) acc[i] += d[i];
      }
    }
#pragma unroll 2
    for (int c = sl + PF * LPE; c < CHUNKS; c += LPE) {
      typename Row::Load l[ROWS];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) l[i] = Row::load(w, s, b, row[i], c);
      float d[ROWS];
      dots(c, l, d);
#pragma unroll
      for (int i = 0; i < ROWS; ++i) acc[i] += d[i];
    }
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    float a = acc[i];
#pragma unroll
    for (int o = LPE / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xFFFFFFFFu, a, o);
    float p;
    if constexpr (HERE && !IDS_SHARED) {
      p = mine[i] && sl == 0 ? rnd<T>(rnd<T>(a) * to_f<T>(__ldcg(wts + j))) : 0.f;
    } else {
      p = mine[i] && sl == 0 ? rnd<T>(rnd<T>(a) * to_f<T>(wts[j])) : 0.f;
    }
    p = warp_sum(p);
    const int r = r0 + i;
    if (lane == 0 && r < OUT) {
      float v = rnd<T>(p);
      if constexpr (RESID) {
        if constexpr (HERE) v = rnd<T>(to_f<T>(__ldcg(res + r)) + v);
        else v = rnd<T>(to_f<T>(res[r]) + v);
      }
      y[r] = from_f<T>(v);
    }
  }
}

}  // namespace omnia
"""


@dataclass(frozen=True)
class RouteSpec:
    dtype: mx.Dtype
    n_experts: int
    top_k: int
    topk_first: bool   # order "topk_softmax"
    normalize: bool

    def name(self) -> str:
        return (f"omnia_route_{str(self.dtype).split('.')[-1]}_e{self.n_experts}_k{self.top_k}"
                f"_{'ts' if self.topk_first else 'st'}{'_norm' if self.normalize else ''}")


def route_fits(spec: RouteSpec) -> bool:
    return (
        spec.dtype in CUDA_TYPES
        and 0 < spec.top_k <= min(spec.n_experts, MAX_TOP_K)
        and spec.n_experts <= MAX_EXPERTS
    )


@cache
def route_launcher(
    spec: RouteSpec, lead: tuple[int, ...] = ()
) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """logits [*lead, E] (one row) -> (weights [*lead, k] in the logits' dtype, ids [*lead, k]
    uint32): the outputs come in the caller's shape, so no reshape follows the launch."""
    t = CUDA_TYPES[spec.dtype]
    kernel = cuda_kernel(
        spec.name(), ("logits",), ("weights", "ids"),
        f"omnia::route<{t}, {spec.n_experts}, {spec.top_k}, {int(spec.topk_first)}, "
        f"{flag(spec.normalize)}>(logits, weights, ids);\n",
        MOE_HEADER,
    )
    shapes = [(*lead, spec.top_k), (*lead, spec.top_k)]
    dtypes = [spec.dtype, mx.uint32]

    def call(logits: mx.array) -> tuple[mx.array, mx.array]:
        out: Any = kernel(inputs=[logits], output_shapes=shapes, output_dtypes=dtypes,
                          grid=(32, 1, 1), threadgroup=(32, 1, 1))
        return out[0], out[1]

    return call


ROUTED_WARPS = 16  # 512 threads: up to 128 registers a thread still launch
ROUTED_MAX_EXPERTS = 128  # router rows one block computes (16 warps of 8 groups of 4 lanes)


def routed_qmv(router: QmvSpec, n_experts: int) -> QmvSpec:
    """The router GEMV as one block: the most lanes per row (of 32, 16, 8, 4) that still cover
    n_experts rows with at most ROUTED_WARPS warps, every warp holding at least one row, and
    8 chunks per row requested before the input is staged (a 4-bit row of 2048 inputs on 4
    lanes is 16 chunks a lane: two memory round trips; 83 registers a thread here, well under
    the 128 that 512 threads allow)."""
    lanes = next((n for n in (32, 16, 8, 4) if -(-n_experts // (32 // n)) <= ROUTED_WARPS), 4)
    warps = -(-n_experts // (32 // lanes))
    return replace(router, launch=Launch(lanes=lanes, rows=1, warps=warps, unroll=2, prefetch=8))


def routed_fits(route: RouteSpec, router: QmvSpec) -> bool:
    """The router (one bias-free projection, optionally after an RMS norm) and the routing in
    one block: the qmv kernel computes the logits, then one warp routes them."""
    one = routed_qmv(router, route.n_experts)
    return (
        route_fits(route)
        and route.n_experts <= ROUTED_MAX_EXPERTS
        and router.rows == (route.n_experts,)
        and router.gate is None
        and not router.residual
        and router.dtype == route.dtype
        and spec_fits(one)
    )


@cache
def routed_launcher(
    route: RouteSpec, router: QmvSpec, lead: tuple[int, ...] = ()
) -> Callable[[Sequence[mx.array]], tuple[mx.array, mx.array]]:
    """(h [*lead, in] (one row), the router's weights..., norm weight?) -> (weights [*lead, k],
    ids [*lead, k] uint32): one block computes the router logits (qmv, y0, also an output of
    the launch) and, after a barrier, its first warp routes them."""
    one = routed_qmv(router, route.n_experts)
    t = CUDA_TYPES[route.dtype]
    source = (
        one.source()
        + "__threadfence_block();\n__syncthreads();\n"
        + f"if (threadIdx.x < 32) omnia::route<{t}, {route.n_experts}, {route.top_k}, "
        + f"{int(route.topk_first)}, {flag(route.normalize)}>(y0, weights, ids);\n"
    )
    kernel = cuda_kernel(f"{route.name()}__{one.name()}", one.input_names(),
                         ("y0", "weights", "ids"), source, MOE_HEADER)
    shapes = [(*lead, route.n_experts), (*lead, route.top_k), (*lead, route.top_k)]
    dtypes = [route.dtype, route.dtype, mx.uint32]
    threads = one.config.warps * 32

    def call(inputs: Sequence[mx.array]) -> tuple[mx.array, mx.array]:
        out: Any = kernel(inputs=list(inputs), output_shapes=shapes, output_dtypes=dtypes,
                          grid=(threads, 1, 1), threadgroup=(threads, 1, 1))
        return out[1], out[2]

    return call


@dataclass(frozen=True)
class ExpertsSpec:
    """One expert matmul kernel: `gate_up` (rows = hidden, 2 * hidden stacked per expert) or the
    down projections combined (rows = output features)."""

    dtype: mx.Dtype
    k: int                    # input features
    rows: int                 # hidden (gate_up) or output rows (down)
    top_k: int
    bits: int | None = None   # None: dense weights in `dtype`
    group_size: int | None = None
    gate_up: bool = True
    residual: bool = False    # down only
    norm_eps: float | None = None  # gate_up only: RMS-normalize the input first (weight input `g`)

    @property
    def values_per_chunk(self) -> int:
        return 8 if self.bits is None else 128 // self.bits

    @property
    def lanes(self) -> int:
        """gate_up: lanes per (expert, row) pair, leaving each lane about 4 chunks; down: lanes
        per selected expert (32 over k rounded up to a power of two)."""
        if self.gate_up:
            chunks = self.k // self.values_per_chunk
            return next((n for n in (32, 16, 8) if chunks >= 4 * n), 4)
        p = 1
        while p < self.top_k:
            p *= 2
        return 32 // p

    def name(self) -> str:
        fmt = "dense" if self.bits is None else f"q{self.bits}g{self.group_size}"
        kind = "gate_up" if self.gate_up else "down" + ("_res" if self.residual else "")
        norm = ("_norm" + hashlib.sha1(repr(self.norm_eps).encode()).hexdigest()[:8]
                if self.norm_eps is not None else "")
        return (f"omnia_experts_{kind}_{str(self.dtype).split('.')[-1]}_{fmt}_k{self.k}"
                f"_n{self.rows}_top{self.top_k}{norm}")


WARPS = 8
NO_WAIT = "nullptr, 0"  # a call's wait arguments when it does not wait


def experts_fits(spec: ExpertsSpec) -> bool:
    """Formats and geometry the kernels compute: dense bf16/fp16 or affine 4/8-bit in groups of
    32/64/128, whole 16-byte chunks, at most MAX_TOP_K experts, the staged input in shared
    memory."""
    if spec.dtype not in CUDA_TYPES or not 0 < spec.top_k <= MAX_TOP_K or spec.rows <= 0:
        return False
    if (spec.residual and spec.gate_up) or (spec.norm_eps is not None and not spec.gate_up):
        return False
    if spec.bits is None:
        fmt_ok = spec.group_size is None
    else:
        fmt_ok = (
            spec.bits in (4, 8) and spec.group_size in (32, 64, 128)
            and spec.k % spec.group_size == 0
        )
    staged = spec.k * (1 if spec.gate_up else spec.top_k)
    return (
        fmt_ok
        and spec.k % spec.values_per_chunk == 0
        and spec.k % 8 == 0
        and staged <= MAX_ROWS_STAGED
    )


def experts_input_names(spec: ExpertsSpec) -> tuple[str, ...]:
    """The launch's inputs: gate_up (x, ids, weights..., g?); down (h, ids, wts, weights...,
    res?)."""
    mats = ("w", "s", "b") if spec.bits is not None else ("w",)
    if spec.gate_up:
        return ("x", "ids", *mats, *(("g",) if spec.norm_eps is not None else ()))
    return ("h", "ids", "wts", *mats, *(("res",) if spec.residual else ()))


def experts_blocks(spec: ExpertsSpec, rows: int = 1) -> int:
    """Blocks of spec's own launch (WARPS warps each; down: `rows` output rows a warp)."""
    if spec.gate_up:
        return -(-(spec.top_k * spec.rows) // (WARPS * 32 // spec.lanes))
    return -(-spec.rows // (WARPS * rows))


# Output rows a warp of RouteExperts' down phase. 1: its 256 down blocks (Qwen3-30B-A3B) do not
# fit beside the gate/up blocks (4 blocks an SM), and the last start only as gate/up blocks
# end; 2 halves them (the same sums; scripts/h200_ab.py `down_two_rows` measures it).
ROUTE_EXPERTS_DOWN_ROWS = 1


def experts_call(spec: ExpertsSpec, *, block: str = "blockIdx.x", coherent: bool = False,
                 names: Mapping[str, str] | None = None, wait: str | None = None,
                 here: bool = False, wait_ids: str | None = None, ext: str | None = None,
                 down: ExpertsSpec | None = None, ids_shared: bool = False,
                 rows: int = 1) -> str:
    """The expert_gate_up / expert_down call. `block`: this block's index among the kernel's
    blocks; `coherent`: the input (x or h; gate/up: the ids too) is written by other blocks of
    the same launch, and `wait` ("count, n": chain_wait) says when it is there; `here` (down):
    the ids, the routing weights and the residual are written in this launch too, `wait_ids`
    says when the ids are; `ext`: the launch's shared buffer the input is staged in
    (experts_staging_bytes); `down` (gate/up in a chained launch): the down call that follows,
    whose weights (the launch's w2, s2, b2) the gate/up blocks request into L2 (DownL2);
    `ids_shared`: the ids (down: and the routing weights) are in the block's shared memory,
    routed by the block itself (a gate/up call then names its `down`); `rows` (down, with
    `here`): output rows a warp (down_blocks); `names`: the launch's variable for an input or
    output (experts_input_names, out) where it differs."""
    t = CUDA_TYPES[spec.dtype]
    bits, group = spec.bits or 0, spec.group_size or 1
    rename = dict(names or {})

    def n(name: str) -> str:
        return rename.get(name, name)

    margs = f"{n('w')}, {n('s')}, {n('b')}" if spec.bits is not None else f"{n('w')}, nullptr, nullptr"
    if spec.gate_up:
        assert not here and wait_ids is None, "gate/up reads its ids after `wait`"
        norm = spec.norm_eps is not None
        eps = repr(float(spec.norm_eps)) + "f" if spec.norm_eps is not None else "0.f"
        more = coherent or wait is not None or ext is not None or down is not None
        flags = f", {flag(coherent)}, {flag(ext is not None)}" if more else ""
        tail = f", {wait or NO_WAIT}, {ext or 'nullptr'}" if more else ""
        if down is not None:
            flags += f", {down.rows}"
            dargs = "w2, s2, b2" if down.bits is not None else "w2, nullptr, nullptr"
            tail += f", {dargs}, {experts_blocks(spec)}"
            if ids_shared:
                flags += ", true"
        else:
            assert not ids_shared, "a gate/up call with shared ids names its down"
        return (f"omnia::expert_gate_up<{t}, {bits}, {group}, {spec.k}, {spec.rows}, "
                f"{spec.top_k}, {spec.lanes}, {WARPS}, {flag(norm)}{flags}>({n('x')}, "
                f"{n('ids')}, {margs}, {n('out')}, {n('g') if norm else 'nullptr'}, {eps}, "
                f"{block}{tail});\n")
    more = here or wait_ids is not None or ext is not None
    flags = f", {flag(here)}, {flag(ext is not None)}" if more else ""
    if ids_shared:
        assert here, "shared ids come with `here`"
        flags += ", true"
    if rows != 1:
        assert here and ext is not None, "rows a warp come with `here` and `ext`"
        flags += ("" if ids_shared else ", false") + f", {rows}"
    if more:
        tail = f", {wait or NO_WAIT}, {wait_ids or NO_WAIT}, {ext or 'nullptr'}"
    else:
        tail = f", {wait}" if wait else ""
    call = "expert_down" if rows == 1 else "expert_down_rows"
    return (f"omnia::{call}<{t}, {bits}, {group}, {spec.k}, {spec.rows}, {spec.top_k}, "
            f"{spec.lanes}, {WARPS}, {flag(spec.residual)}, {flag(coherent)}{flags}>({n('h')}, "
            f"{n('ids')}, {n('wts')}, {margs}, {n('res') if spec.residual else 'nullptr'}, "
            f"{n('out')}, {block}{tail});\n")


def experts_staging_bytes(spec: ExpertsSpec) -> int:
    """Shared bytes the expert call stages its input in (`ext`): one row (gate/up) or top_k."""
    values = spec.k * (1 if spec.gate_up else spec.top_k)
    if spec.bits is None:
        return staging(spec.dtype.size, 4, 1, values)
    return staging(spec.dtype.size, values, values // spec.values_per_chunk, 8)


@cache
def experts_launcher(
    spec: ExpertsSpec, lead: tuple[int, ...] = ()
) -> Callable[[Sequence[mx.array]], mx.array]:
    """gate_up: (x [in], ids [k], weights..., norm weight [in]?) -> [*lead, k, hidden]; down: (h [k, in], ids [k],
    routing weights [k], weights..., residual [out]?) -> [*lead, out] (one token: `lead` only
    shapes the output as the caller wants it, so no reshape follows the launch)."""
    kernel = cuda_kernel(spec.name(), experts_input_names(spec), ("out",), experts_call(spec),
                         MOE_HEADER)
    shape = (*lead, spec.top_k, spec.rows) if spec.gate_up else (*lead, spec.rows)
    grid, threads = (experts_blocks(spec) * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)

    def call(inputs: Sequence[mx.array]) -> mx.array:
        out: Any = kernel(inputs=list(inputs), output_shapes=[shape], output_dtypes=[spec.dtype],
                          grid=grid, threadgroup=threads)
        return out[0]

    return call


def chain_fits(up: ExpertsSpec, down: ExpertsSpec) -> bool:
    """Gate/up then down in one launch (chain_launcher): each fits alone, they take the same
    format and selected experts, the down reads the gate/up's hidden rows, and both staged
    inputs fit one block's static shared memory together."""
    return (
        up.gate_up and not down.gate_up
        and experts_fits(up) and experts_fits(down)
        and (up.dtype, up.bits, up.group_size, up.top_k)
        == (down.dtype, down.bits, down.group_size, down.top_k)
        and down.k == up.rows
        and up.k + up.top_k * up.rows <= MAX_ROWS_STAGED
    )


@cache
def chain_launcher(
    up: ExpertsSpec, down: ExpertsSpec, lead: tuple[int, ...] = ()
) -> Callable[..., mx.array]:
    """(x [in], ids [k], routing weights [k], gate/up weights..., down weights..., norm weight
    [in]?, residual [out]?, counters [3] int32 zeros) -> [*lead, out]: the gate/up kernel's
    blocks, then the down kernel's reading the intermediate `mid` (in the launch scratch,
    launch_scratch) through L2, in one launch (chain_source). The counters are written in
    place and left zero: the caller owns one array per declaration."""
    quant = up.bits is not None
    m1 = ("w1", "s1", "b1") if quant else ("w1",)
    m2 = ("w2", "s2", "b2") if quant else ("w2",)
    names = ("x", "ids", "wts", *m1, *m2, *(("g",) if up.norm_eps is not None else ()),
             *(("res",) if down.residual else ()), "counters", "scratch")
    nb1, nb2 = experts_blocks(up), experts_blocks(down)
    t = CUDA_TYPES[up.dtype]
    source = f"{t}* mid = reinterpret_cast<{t}*>(const_cast<float*>(scratch));\n" + chain_source(
        nb1,
        experts_call(up, block="t", names={"w": "w1", "s": "s1", "b": "b1", "out": "mid"},
                     down=down),
        experts_call(down, block=f"t - {nb1}", coherent=True,
                     names={"h": "mid", "w": "w2", "s": "s2", "b": "b2"}, wait=chain_wait(nb1)),
        nb2,
    )
    prefix = len("omnia_experts_")
    kernel = cuda_kernel(f"omnia_experts_chain_{up.name()[prefix:]}__{down.name()[prefix:]}",
                         names, ("out",), source, MOE_HEADER)
    shapes = [(*lead, down.rows)]
    grid, threads = ((nb1 + nb2) * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)
    own = own_scratch(up.top_k * up.rows * up.dtype.size)

    def call(inputs: Sequence[mx.array], scratch: mx.array | None = None) -> mx.array:
        out: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                          output_shapes=shapes, output_dtypes=[up.dtype], grid=grid,
                          threadgroup=threads)
        return out[0]

    return call


def chained_router(router: QmvSpec, n_experts: int, warps: int) -> QmvSpec:
    """The router GEMV as the second phase of a chained launch whose blocks have `warps` warps:
    the most lanes a row (of 32, 16, 8, 4) that leave no lane without a chunk, one row a lane
    group, and every chunk of a lane requested before the wait (at most 16), so the rows spread
    over several blocks (qwen3-30b-a3b: 16 blocks of 8 rows, 2 chunks a lane). Until 2026-12-04
    one block computed all the rows with routed_qmv's 4 lanes a row, 64 chunks a lane one after
    another: 10.4 us of the launch's 15.7 (globaltimer trace, H200)."""
    chunks = router.k // (8 if router.bits is None else 128 // router.bits)
    lanes = next((n for n in (32, 16, 8) if chunks >= n), 4)
    return replace(router, launch=Launch(lanes=lanes, rows=1, warps=warps, unroll=2,
                                         prefetch=min(16, -(-chunks // lanes)), loop=1))


def project_route_fits(project: QmvSpec, route: RouteSpec, router: QmvSpec) -> bool:
    """A projection with its residual (qmv, its own launch configuration), then the router and
    routing of its output in the same launch: each fits alone, in one dtype, the router reads
    the projection's rows, the router fits one block of the projection's warps, and both staged
    inputs fit one block's static shared memory together."""
    chained = chained_router(router, route.n_experts, project.config.warps)
    return (
        spec_fits(project) and project.residual and project.norm_eps is None
        and project.gate is None and len(project.rows) == 1
        and routed_fits(route, router)
        and spec_fits(chained)
        and project.dtype == router.dtype == route.dtype
        and project.rows[0] == router.k
        and project.k + router.k <= MAX_ROWS_STAGED
    )


@cache
def project_route_launcher(
    project: QmvSpec, route: RouteSpec, router: QmvSpec, lead: tuple[int, ...] = ()
) -> Callable[..., tuple[mx.array, mx.array, mx.array]]:
    """(a [*lead, in], the projection's weights..., residual [*lead, out], the router's
    weights..., norm weight [out]?, counters [4] int32 zeros) -> (h = residual + a @ P.T
    [*lead, out], routing weights [*lead, k], ids [*lead, k] uint32), in one launch: the
    projection's qmv blocks (tickets below NB1), then the router's blocks, which wait for
    them and compute the router logits of h (RMS-normalized when the router declares its norm)
    into the launch scratch (launch_scratch); the last of those to finish (counters[3]) routes
    them. The counters are written in place and left zero."""
    cfg = project.config
    chained = chained_router(router, route.n_experts, cfg.warps)
    nb1, nb2 = blocks_of(project), blocks_of(chained)
    quant_p, quant_r = project.bits is not None, router.bits is not None
    norm = router.norm_eps is not None
    names = ("a", "pw", *(("ps", "pb") if quant_p else ()), "res", "rw",
             *(("rs", "rb") if quant_r else ()), *(("g",) if norm else ()), "counters", "scratch")
    t = CUDA_TYPES[route.dtype]
    source = f"{t}* logits = reinterpret_cast<{t}*>(const_cast<float*>(scratch));\n" + chain_source(
        nb1,
        project.source(block="t", names={"x": "a", "w0": "pw", "s0": "ps", "b0": "pb",
                                         "y0": "h"}),
        chained.source(block=f"t - {nb1}", coherent=True,
                       names={"x": "h", "w0": "rw", "s0": "rs", "b0": "rb", "y0": "logits"},
                       wait=chain_wait(nb1))
        # the last router block to finish (counters[3], which it zeroes) routes every logit
        + "__threadfence();\n__syncthreads();\n__shared__ int routes;\n"
        f"if (threadIdx.x == 0) {{ routes = atomicAdd(count + 3, 1) == {nb2 - 1}; "
        "if (routes) count[3] = 0; }\n"
        "__syncthreads();\n"
        "if (routes && threadIdx.x < 32) {\n  __threadfence();\n"
        f"  omnia::route<{t}, {route.n_experts}, {route.top_k}, "
        f"{int(route.topk_first)}, {flag(route.normalize)}, true>(logits, weights, ids);\n}}\n",
        nb2,
    )
    kernel = cuda_kernel(f"omnia_project_route__{project.name()}__{route.name()}__{chained.name()}",
                         names, ("h", "weights", "ids"), source, MOE_HEADER)
    shapes = [(*lead, project.rows[0]), (*lead, route.top_k), (*lead, route.top_k)]
    dtypes = [route.dtype, route.dtype, mx.uint32]
    grid, threads = ((nb1 + nb2) * cfg.warps * 32, 1, 1), (cfg.warps * 32, 1, 1)
    own = own_scratch(route.n_experts * route.dtype.size)

    def call(
        inputs: Sequence[mx.array], scratch: mx.array | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        out: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                          output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                          threadgroup=threads)
        return out[0], out[1], out[2]

    return call


# -- o_proj + residual -> router -> routing -> expert gate/up -> expert down, one launch --------
def route_experts_ext(project: QmvSpec, router: QmvSpec, up: ExpertsSpec,
                      down: ExpertsSpec) -> int:
    """Bytes of the launch's one staging buffer: the largest of its four phases' (a block runs
    one phase, so they share it)."""
    return max(staging_bytes(project), staging_bytes(router), experts_staging_bytes(up),
               experts_staging_bytes(down))


def route_experts_project(project: QmvSpec) -> QmvSpec:
    """The projection as RouteExperts runs it: the four phases share one block size, the
    experts' WARPS (a launch's warps do not change its sums, only how many rows a block
    computes)."""
    if project.config.warps == WARPS:
        return project
    return replace(project, launch=replace(project.config, warps=WARPS))


def route_experts_fits(project: QmvSpec, route: RouteSpec, router: QmvSpec, up: ExpertsSpec,
                       down: ExpertsSpec) -> bool:
    """project_route then the experts chain in one launch: each pair fits alone, the blocks
    are one size, the experts read the projection's rows and add them back, the router and
    the gate/up normalize with one eps (the caller checks it is one norm), and the shared
    staging fits the block's static shared memory."""
    chained = chained_router(router, route.n_experts, project.config.warps)
    return (
        project_route_fits(project, route, router) and chain_fits(up, down)
        and project.config.warps == WARPS
        and up.dtype == project.dtype and up.k == down.rows == project.rows[0]
        and down.residual and up.top_k == down.top_k == route.top_k
        and router.norm_eps is not None and up.norm_eps == router.norm_eps
        and route_experts_ext(project, chained, up, down) + 1024 <= STATIC_SMEM
    )


def route_experts_scratch(route: RouteSpec, up: ExpertsSpec, down: ExpertsSpec
                          ) -> tuple[int, int, int, int, int]:
    """Byte offsets in the launch scratch of h, the logits, the routing weights, the ids and the
    experts' intermediate rows, then its size."""
    size = up.dtype.size

    def r16(n: int) -> int:
        return -(-n // 16) * 16

    logits = r16(down.rows * size)
    weights = logits + r16(route.n_experts * size)
    ids = weights + r16(route.top_k * size)
    mid = ids + r16(route.top_k * 4)
    return logits, weights, ids, mid, mid + r16(up.top_k * up.rows * size)


@cache
def route_experts_launcher(
    project: QmvSpec, route: RouteSpec, router: QmvSpec, up: ExpertsSpec, down: ExpertsSpec,
    lead: tuple[int, ...] = (), local_route: bool = True,
) -> Callable[..., mx.array]:
    """(a [*lead, in], the projection's weights..., residual [*lead, out], the router's
    weights..., the norm weight [out], gate/up weights..., down weights..., counters [6] int32
    zeros) -> residual + o + the experts' MLP of norm(residual + o), o = a @ P.T, in one launch
    of four phases, tickets in order: the projection's qmv blocks write h (launch scratch) and
    count (counters[1]); the router's blocks wait for them, write the logits, and the last of
    them (counters[3]) routes and raises counters[4]; the gate/up blocks wait for that, read
    the ids and h through L2 and count (counters[5]); the down blocks wait for the ids
    (their first weights) and then the gate/up blocks, and add h back. Each phase is the same
    device call as in project_route_launcher / chain_launcher, so the result is theirs, bit
    for bit. A block waits only on lower tickets. The last down block zeroes the counters.
    `local_route` (the default since 2026-12-05: Qwen3-30B-A3B's decode step 6 % shorter on
    the H200, scripts/h200_ab.py): no router block routes; each gate/up and down block waits
    for all the router blocks (counters[3]) and routes the logits itself into its shared memory
    (the same device call, so the same ids and weights), one grid-wide publish and wait fewer
    on the way to the experts. False: the last router block routes (the tests' reference)."""
    chained = chained_router(router, route.n_experts, WARPS)
    na, nb = blocks_of(project), blocks_of(chained)
    nc, nd = experts_blocks(up), experts_blocks(down, ROUTE_EXPERTS_DOWN_ROWS)
    quant = project.bits is not None
    r_quant, e_quant = router.bits is not None, up.bits is not None
    names = ("a", "pw", *(("ps", "pb") if quant else ()), "res", "rw",
             *(("rs", "rb") if r_quant else ()), "g", "w1", *(("s1", "b1") if e_quant else ()),
             "w2", *(("s2", "b2") if e_quant else ()), "counters", "scratch")
    ty = CUDA_TYPES[route.dtype]
    logits, weights, ids, mid, _ = route_experts_scratch(route, up, down)
    ext = route_experts_ext(project, chained, up, down)
    published = (
        "  __threadfence();\n  __syncthreads();\n"
        "  if (threadIdx.x == 0) atomicAdd(count + {}, 1);\n"
    )
    route_call = (f"omnia::route<{ty}, {route.n_experts}, {route.top_k}, "
                  f"{int(route.topk_first)}, {flag(route.normalize)}, true>")
    router_end = (
        "  __threadfence();\n  __syncthreads();\n"
        f"  if (threadIdx.x == 0) routes = atomicAdd(count + 3, 1) == {nb - 1};\n"
        "  __syncthreads();\n"
        "  if (routes) {\n    __threadfence();\n"
        f"    if (threadIdx.x < 32) {route_call}(logits, wts, ids);\n"
        + published.format(4) + "  }\n  return;\n}\n"
    )
    # local_route: every expert block routes the logits itself into its shared memory, once all
    # the router blocks have written them; the expert calls then read the ids from there
    if local_route:
        router_end = published.format(3) + "  return;\n}\n"
        experts_head = (
            f"__shared__ unsigned int l_ids[{route.top_k}];\n"
            f"__shared__ {ty} l_wts[{route.top_k}];\n"
            f"omnia::wait_published(count + 3, {nb});\n"
            f"if (threadIdx.x < 32) {route_call}(logits, l_wts, l_ids);\n"
            "__syncthreads();\n"
        )
        routed, ids_wait = {"ids": "l_ids", "wts": "l_wts"}, None
    else:
        experts_head, routed, ids_wait = "", {}, "count + 4, 1"
    experts = (
        experts_head
        + f"if (t < {na + nb + nc}) {{\n"
        + experts_call(up, block=f"t - {na + nb}", coherent=True, wait=ids_wait,
                       names={"x": "h", "w": "w1", "s": "s1", "b": "b1", "out": "mid", **routed},
                       ext="ext", down=down, ids_shared=local_route)
        + published.format(5) + "  return;\n}\n"
        + experts_call(down, block=f"t - {na + nb + nc}", coherent=True, here=True,
                       wait=f"count + 5, {nc}", wait_ids=ids_wait,
                       names={"h": "mid", "w": "w2", "s": "s2", "b": "b2", "res": "h", **routed},
                       ext="ext", ids_shared=local_route, rows=ROUTE_EXPERTS_DOWN_ROWS)
    )
    source = (
        f"__shared__ __align__(16) char ext[{ext}];\n"
        "__shared__ int ticket;\n__shared__ int routes;\n"
        "int* count = const_cast<int*>(counters);\n"
        "char* sc = reinterpret_cast<char*>(const_cast<float*>(scratch));\n"
        f"{ty}* h = reinterpret_cast<{ty}*>(sc);\n"
        f"{ty}* logits = reinterpret_cast<{ty}*>(sc + {logits});\n"
        f"{ty}* wts = reinterpret_cast<{ty}*>(sc + {weights});\n"
        f"unsigned int* ids = reinterpret_cast<unsigned int*>(sc + {ids});\n"
        f"{ty}* mid = reinterpret_cast<{ty}*>(sc + {mid});\n"
        "if (threadIdx.x == 0) ticket = atomicAdd(count, 1);\n"
        "__syncthreads();\n"
        "const int t = ticket;\n"
        f"if (t < {na}) {{\n"
        + project.source(block="t", names={"x": "a", "w0": "pw", "s0": "ps", "b0": "pb",
                                           "y0": "h"}, ext="ext")
        + published.format(1) + "  return;\n}\n"
        f"if (t < {na + nb}) {{\n"
        + chained.source(block=f"t - {na}", coherent=True,
                         names={"x": "h", "w0": "rw", "s0": "rs", "b0": "rb", "y0": "logits"},
                         wait=chain_wait(na), ext="ext")
        + router_end
        + experts
        + f"if (threadIdx.x == 0 && atomicAdd(count + 2, 1) == {nd - 1}) {{\n"
        "  count[0] = 0; count[1] = 0; count[2] = 0; count[3] = 0; count[4] = 0; count[5] = 0;\n"
        "}\n"
    )
    # the four calls' names would pass 255 characters (MLX names its cached module files by
    # the kernel's name): the route's and down's names, and a digest of all four
    full = f"{project.name()}|{route.name()}|{chained.name()}|{up.name()}|{down.name()}"
    digest = hashlib.sha1(full.encode()).hexdigest()[:16]
    kernel = cuda_kernel(
        f"omnia_route_experts__{route.name()}__{down.name()[len('omnia_experts_'):]}_{digest}"
        + ("_lr" if local_route else "")
        + (f"_r{ROUTE_EXPERTS_DOWN_ROWS}" if ROUTE_EXPERTS_DOWN_ROWS != 1 else ""),
        names, ("out",), source, MOE_HEADER)
    shapes = [(*lead, down.rows)]
    grid, threads = ((na + nb + nc + nd) * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)
    own = own_scratch(route_experts_scratch(route, up, down)[-1])

    def call(inputs: Sequence[mx.array], scratch: mx.array | None = None) -> mx.array:
        out: Any = kernel(inputs=[*inputs, scratch if scratch is not None else own()],
                          output_shapes=shapes, output_dtypes=[up.dtype], grid=grid,
                          threadgroup=threads)
        return out[0]

    return call
