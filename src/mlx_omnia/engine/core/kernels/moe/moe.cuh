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
