namespace omnia {

// a * b + c rounded once, subnormal operands kept whatever the compiler's flush-to-zero setting.
__device__ __forceinline__ float fma_keep_subnormal(float a, float b, float c) {
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

// 4 bits: a chunk's scale 2^S (x) and unscale 2^(149 - S) (y) for a chunk whose largest |input|
// is amax: S is the largest power (at most 127) that keeps every staged x * 2^S below 2^127.
// Inputs of 2^105 or more (S would fall under 22) overflow the staging, near where the
// reference's own products overflow.
__device__ __forceinline__ float2 chunk_scale4(float amax) {
  const int e = (int)((__float_as_uint(amax) >> 23) & 0xFFu);  // amax < 2^(e - 126)
  const int sc = min(127, max(22, 253 - e));
  return make_float2(__uint_as_float((unsigned int)(sc + 127) << 23),
                     __uint_as_float((unsigned int)(276 - sc) << 23));
}

// The staged input of value n (0-7) of a 4-bit chunk word: x * 2^S * 16^-p, p the nibble's
// place after the dot's masking (n, or n - 2 for nibbles 6 and 7, shifted a byte): exact.
__device__ __forceinline__ float prescale4(float x, int n, float scale) {
  return x * scale * (n == 0 ? 1.f : n == 1 ? 0x1p-4f : n == 2 ? 0x1p-8f : n == 3 ? 0x1p-12f
                      : n == 4 || n == 6 ? 0x1p-16f : 0x1p-20f);
}

template <typename T, int BITS, int GROUP, int K>
struct QmvRow {
  static constexpr int VPC = BITS == 0 ? 8 : 128 / BITS;  // values per 16-byte chunk
  static constexpr int CHUNKS = K / VPC;                   // chunks per row

  // One chunk's weights (and its group's scale and bias), raw: converted where they are used,
  // so a load issued early does not stall until then.
  struct Load {
    uint4 w;
    T s, b;
  };

  static __device__ __forceinline__ Load load(const void* w, const T* s, const T* b, int row,
                                              int c) {
    Load l;
    l.w = __ldg(reinterpret_cast<const uint4*>(w) + (size_t)row * CHUNKS + c);
    if constexpr (BITS != 0) {
      const size_t gi = (size_t)row * (K / GROUP) + (c * VPC) / GROUP;
      l.s = s[gi];
      l.b = b[gi];
    }
    return l;
  }

  static constexpr int PER = BITS == 0 ? 8 : 32 / BITS;  // values per 32-bit word

  // Partial dot product of one word of quantized weights with its PER inputs xf.
  static __device__ __forceinline__ float word_dot(unsigned int wd, const float* xf) {
    float part = 0.f;
    if constexpr (BITS == 4) {
      // Nibble n masked in place (nibbles 6 and 7 a byte lower) is an integer m = q * 16^p
      // below 2^24; its bits read as a float are exactly m * 2^-149 (subnormal or the least
      // normal binade), and xf holds x * 2^S * 16^-p (prescale4): each product is
      // q * x * 2^(S - 149) exactly, two instructions a value.
      const unsigned int hi = wd >> 8;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const unsigned int m = n < 6 ? (wd & (0xFu << (4 * n))) : (hi & (0xFu << (4 * (n - 2))));
        part = fma_keep_subnormal(__uint_as_float(m), xf[n], part);
      }
    } else {
      constexpr unsigned int MASK = (1u << BITS) - 1u;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        part = fmaf(small_uint_to_float((wd >> (BITS * j)) & MASK), xf[j], part);
      }
    }
    return part;
  }

  // A quantized chunk's result from its four words' partial sums: su.x is the sum of the
  // chunk's inputs, su.y (4 bits) its unscale 2^(149 - S) (exact).
  static __device__ __forceinline__ float finish(const Load& l, const float* part, float2 su) {
    float d = (part[0] + part[1]) + (part[2] + part[3]);
    if constexpr (BITS == 4) d *= su.y;
    return fmaf(to_f<T>(l.s), d, to_f<T>(l.b) * su.x);
  }

  // Partial dot product of a chunk with xf, the chunk's inputs (staged as stage_rows stages
  // them); su: see finish.
  static __device__ __forceinline__ float dot(const Load& l, const float* xf, float2 su) {
    const uint4 wv = l.w;
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
      for (int i = 0; i < 4; ++i) part[i] = word_dot(ws[i], xf + i * PER);
      return finish(l, part, su);
    }
  }

  // dot for NR chunks of quantized weights (rows) that share chunk c of the input staged in
  // xq ([VPC / 4][CHUNKS] float4): each word's inputs are read once for all NR rows and are all
  // a lane holds of them (the same sums as dot).
  template <int NR>
  static __device__ __forceinline__ void dot_staged(const Load* l, const float* xq, int c,
                                                    float2 su, float* out) {
    static_assert(BITS != 0, "dense weights take their input as T");
    const float4* src = reinterpret_cast<const float4*>(xq);
    float part[NR][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float xf[PER];
#pragma unroll
      for (int q = 0; q < PER / 4; ++q) {
        const float4 v = src[(i * (PER / 4) + q) * CHUNKS + c];
        xf[4 * q] = v.x; xf[4 * q + 1] = v.y; xf[4 * q + 2] = v.z; xf[4 * q + 3] = v.w;
      }
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const unsigned int wd = i == 0 ? l[r].w.x : i == 1 ? l[r].w.y : i == 2 ? l[r].w.z : l[r].w.w;
        part[r][i] = word_dot(wd, xf);
      }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = finish(l[r], part[r], su);
  }
};

// Byte offsets of a staged input carved from a caller's shared buffer: QN floats (the staged
// values), then SN float2 (each chunk's sum and unscale), then XN values of T (the input as it
// is), each part 16-byte aligned; BYTES in all (staging_bytes in Python computes the same).
template <typename T, int QN, int SN, int XN>
struct StagingBytes {
  static constexpr int SUM = (QN * 4 + 15) / 16 * 16;
  static constexpr int RAW = SUM + (SN * 8 + 15) / 16 * 16;
  static constexpr int BYTES = RAW + (XN * (int)sizeof(T) + 15) / 16 * 16;
  // The three parts' places in `ext`.
  static __device__ __forceinline__ void carve(char* ext, float*& xq, float2*& xsum, T*& xs) {
    xq = reinterpret_cast<float*>(ext);
    xsum = reinterpret_cast<float2*>(ext + SUM);
    xs = reinterpret_cast<T*>(ext + RAW);
  }
};

// 1 / rms of one row of K values, for every thread of the block (NWARPS warps): the sum of
// squares in float as mx.fast.rms_norm takes it, each warp's part, then the warps' in order.
template <typename T, int K, int NWARPS, bool CG = false>
__device__ __forceinline__ float row_inv_rms(const T* x, float eps) {
  __shared__ float red[NWARPS];
  const int tid = threadIdx.x;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float ss = 0.f;
  for (int i = tid; i < K / 8; i += NWARPS * 32) {
    float f[8];
    if constexpr (CG) unpack8<T>(__ldcg(x4 + i), f); else unpack8<T>(x4[i], f);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = fmaf(f[j], f[j], ss);
  }
  ss = warp_sum(ss);
  if ((tid & 31) == 0) red[tid >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < NWARPS; ++i) total += red[i];
  return rsqrtf(total / K + eps);
}

// Eight normalized inputs, rounded as mx.fast.rms_norm rounds them: rnd(g * rnd(x * inv)).
template <typename T>
__device__ __forceinline__ void rms_scale8(float* f, uint4 g, float inv) {
  float gf[8];
  unpack8<T>(g, gf);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = rnd<T>(gf[j] * rnd<T>(f[j] * inv));
}

// Rows of input x [NROWS][K] staged in shared memory for QmvRow<T, BITS, GROUP, K>::dot: for
// quantized weights as floats laid out [row][VPC / 4][CHUNKS] float4 (prescaled for 4 bits) with
// each chunk's sum and unscale (4 bits; else 1) in xsum[row][CHUNKS]; for dense weights copied as
// T into xs [row][K].
// NORM (one row only): the row is RMS-normalized first with weight g, rounded as
// mx.fast.rms_norm rounds (as the qmv kernel's prologue does); the block has NWARPS warps.
// CG: x was written earlier in this same launch by other blocks (a chained launch): read it
// through L2 (ld.global.cg), never from a possibly stale L1 line.
template <typename T, int BITS, int K, int NROWS, bool NORM = false, int NWARPS = 8,
          bool CG = false>
__device__ __forceinline__ void stage_rows(const T* x, float* xq, float2* xsum, T* xs, int tid,
                                           int nt, const T* g = nullptr, float eps = 0.f) {
  static_assert(!NORM || NROWS == 1, "the norm prologue stages one row");
  constexpr int VPC = BITS == 0 ? 8 : 128 / BITS;
  constexpr int CHUNKS = K / VPC;
  constexpr int XCH = K / 8;  // 16-byte pieces of one input row
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* g4 = reinterpret_cast<const uint4*>(g);
  auto load_x = [x4](int i) -> uint4 {
    if constexpr (CG) return __ldcg(x4 + i); else return x4[i];
  };
  float inv = 1.f;
  if constexpr (NORM) inv = row_inv_rms<T, K, NWARPS, CG>(x, eps);
  if constexpr (BITS == 0) {
    uint4* xs4 = reinterpret_cast<uint4*>(xs);
    for (int i = tid; i < NROWS * XCH; i += nt) {
      if constexpr (NORM) {
        float f[8];
        unpack8<T>(load_x(i), f);
        rms_scale8<T>(f, g4[i], inv);
        xs4[i] = pack8<T>(f);
      } else {
        xs4[i] = load_x(i);
      }
    }
  } else {
    constexpr int PARTS = VPC / 8;  // pieces of a chunk (consecutive threads)
    for (int base = 0; base < NROWS * XCH; base += nt) {
      const int i = base + tid;
      float sum = 0.f, amax = 0.f;
      float f[8];
      if (i < NROWS * XCH) {
        unpack8<T>(load_x(i), f);
        if constexpr (NORM) rms_scale8<T>(f, g4[i], inv);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sum += f[j];
          amax = fmaxf(amax, fabsf(f[j]));
        }
      }
      // PARTS divides XCH and the block size: a chunk's pieces sit in neighbouring lanes.
#pragma unroll
      for (int o = 1; o < PARTS; o <<= 1) {
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      }
      if (i < NROWS * XCH) {
        const int row = i / XCH, p = i % XCH;
        const int c = p / PARTS, q0 = (p % PARTS) * 2;
        float4* dst = reinterpret_cast<float4*>(xq + (size_t)row * K);
        float2 su = make_float2(sum, 1.f);
        if constexpr (BITS == 4) {
          const float2 sc = chunk_scale4(amax);
          su.y = sc.y;
#pragma unroll
          for (int j = 0; j < 8; ++j) f[j] = prescale4(f[j], j, sc.x);
        }
        dst[q0 * CHUNKS + c] = make_float4(f[0], f[1], f[2], f[3]);
        dst[(q0 + 1) * CHUNKS + c] = make_float4(f[4], f[5], f[6], f[7]);
        if (p % PARTS == 0) xsum[row * CHUNKS + c] = su;
      }
    }
  }
}

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
// `block`: this block's index among the launch's qmv blocks (blockIdx.x, or a chained launch's
// ticket); CG: x was written by other blocks of this launch (staged through L2), and `wait`,
// `wait_for` say when it is there (wait_published, after the first weights are requested).
template <typename T, int BITS, int GROUP, int K, int N0, int N1, int N2, int R, int LPR,
          int NWARPS, int UNROLL, int PREF, int LOOP, bool NORM, int ACT, bool RESID,
          bool CG = false, bool EXT = false>
__device__ __forceinline__ void qmv(
    const T* x, const void* w0, const T* s0, const T* b0, const void* w1, const T* s1,
    const T* b1, const void* w2, const T* s2, const T* b2, const T* g, const T* res, T* y0, T* y1, T* y2,
    float eps, int block, const int* wait = nullptr, int wait_for = 0, char* ext = nullptr) {
  using Row = QmvRow<T, BITS, GROUP, K>;
  constexpr int VPC = Row::VPC, CHUNKS = Row::CHUNKS;
  constexpr int ROWS = ACT == 0 ? N0 + N1 + N2 : N0;
  constexpr int NT = NWARPS * 32;
  // Quantized weights take the input as floats in shared memory, already prescaled, laid out
  // [VPC / 4][CHUNKS] float4 (a warp's lanes read neighbouring chunks: no bank conflicts), with
  // each chunk's sum; dense weights (and inputs too wide for that) take it in T.
  constexpr bool XF = BITS != 0 && K <= 10240;
  // EXT: the staging lives in `ext`, shared memory of the caller's (a launch whose phases never
  // run in one block shares one buffer among them: StagingBytes says its size).
  using Staging = StagingBytes<T, XF ? K : 4, XF ? CHUNKS : 1, XF ? 8 : K>;
  float* xq;
  float2* xsum;
  T* xs;
  if constexpr (EXT) {
    Staging::carve(ext, xq, xsum, xs);
  } else {
    __shared__ __align__(16) float s_xq[XF ? K : 4];
    __shared__ float2 s_xsum[XF ? CHUNKS : 1];
    __shared__ __align__(16) T s_xs[XF ? 8 : K];
    xq = s_xq;
    xsum = s_xsum;
    xs = s_xs;
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // This lane's rows. Each warp holds 32 / LPR groups of LPR lanes; a group computes R whole
  // rows, its lanes striding the rows' 16-byte chunks. Rows of one group lie in one segment
  // (every segment is a multiple of R rows). A block stages the input once and then computes
  // LOOP consecutive sets of NWARPS * GPW * R rows, one after the other.
  constexpr int GPW = 32 / LPR;
  const int grp = lane / LPR, sl = lane % LPR;
  const void* w = w0; const T* s = s0; const T* b = b0;
  T* y = y0;
  int local = 0;
  bool valid = false;
  // Points w/s/b/y/local at the rows of set `it`; `valid`: the group has rows there (otherwise
  // it computes row 0 again, as the shuffles need every lane, and writes nothing).
  auto select = [&](int it) {
    int row0 = (((block * LOOP + it) * NWARPS + warp) * GPW + grp) * R;
    valid = row0 < ROWS;
    if (!valid) row0 = 0;
    w = w0; s = s0; b = b0; y = y0; local = row0;
    if constexpr (ACT == 0) {
      if (row0 >= N0 + N1) { w = w2; s = s2; b = b2; y = y2; local = row0 - N0 - N1; }
      else if (row0 >= N0) { w = w1; s = s1; b = b1; y = y1; local = row0 - N0; }
    }
  };
  // The first chunks' weights are requested before the input is prepared: their latency
  // overlaps the preparation's.
  constexpr int PER_LANE = (CHUNKS + LPR - 1) / LPR;
  // PREF chunks per row (0: 2 for one row, else 1) are loaded before the input is staged; all of
  // a lane's chunks when PREF >= PER_LANE (a short quantized row: the whole block's weights are
  // in flight while it stages the input).
  constexpr int PF0 = PREF > 0 ? PREF : R == 1 ? 2 : 1;
  constexpr int PF = PF0 < PER_LANE ? PF0 : PER_LANE;
  typename Row::Load pre[PF][R], pre2[PF][R];
  auto prefetch = [&]() {
#pragma unroll
    for (int f = 0; f < PF; ++f) {
      const int c = min(sl + f * LPR, CHUNKS - 1);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        pre[f][r] = Row::load(w, s, b, local + r, c);
        if constexpr (ACT != 0) pre2[f][r] = Row::load(w1, s1, b1, local + r, c);
      }
    }
  };
  select(0);
  prefetch();
  wait_published(wait, wait_for);

  // Quantized weights take the input staged as floats (XF), dense ones (and inputs too wide for
  // that) as T: stage_rows<T, 0, ...> copies it as T.
  if constexpr (XF) {
    stage_rows<T, BITS, K, 1, NORM, NWARPS, CG>(x, xq, xsum, xs, tid, NT, g, eps);
  } else {
    stage_rows<T, 0, K, 1, NORM, NWARPS, CG>(x, xq, xsum, xs, tid, NT, g, eps);
  }
  __syncthreads();

  // The inputs of chunk c from xs (staged as T) (and their sum and unscale, for quantized
  // weights).
  auto inputs = [&](int c, float* xf) -> float2 {
    float2 su = make_float2(0.f, 1.f);
    const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
#pragma unroll
    for (int q = 0; q < VPC / 8; ++q) unpack8<T>(xs4[c * (VPC / 8) + q], xf + 8 * q);
    if constexpr (BITS != 0) {
#pragma unroll
      for (int j = 0; j < VPC; ++j) su.x += xf[j];
    }
    if constexpr (BITS == 4) {
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < VPC; ++j) amax = fmaxf(amax, fabsf(xf[j]));
      const float2 sc = chunk_scale4(amax);
      su.y = sc.y;
#pragma unroll
      for (int j = 0; j < VPC; ++j) xf[j] = prescale4(xf[j], j % 8, sc.x);
    }
    return su;
  };
  // The loads of one chunk: the R rows, then (gated) their R up rows.
  constexpr int NL = ACT != 0 ? 2 * R : R;

#pragma unroll 1
  for (int it = 0; it < LOOP; ++it) {
    if (it > 0) {
      select(it);
      prefetch();
    }
    // The whole warp past the end (uniform over the warp: no shuffle is left waiting).
    if ((((block * LOOP + it) * NWARPS + warp) * GPW * R) >= ROWS) break;
    float acc[R], acc2[R];
#pragma unroll
    for (int r = 0; r < R; ++r) { acc[r] = 0.f; acc2[r] = 0.f; }
    auto accumulate = [&](int c, const typename Row::Load* ls) {
      float d[NL];
      if constexpr (XF) {
        Row::template dot_staged<NL>(ls, xq, c, xsum[c], d);
      } else {
        float xf[VPC];
        const float2 su = inputs(c, xf);
#pragma unroll
        for (int r = 0; r < NL; ++r) d[r] = Row::dot(ls[r], xf, su);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[r] += d[r];
        if constexpr (ACT != 0) acc2[r] += d[R + r];
      }
    };
#pragma unroll
    for (int f = 0; f < PF; ++f) {
      const int c = sl + f * LPR;
      if (c < CHUNKS) {
        typename Row::Load ls[NL];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          ls[r] = pre[f][r];
          if constexpr (ACT != 0) ls[R + r] = pre2[f][r];
        }
        accumulate(c, ls);
      }
    }
#pragma unroll UNROLL
    for (int c = sl + PF * LPR; c < CHUNKS; c += LPR) {
      typename Row::Load ls[NL];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        ls[r] = Row::load(w, s, b, local + r, c);
        if constexpr (ACT != 0) ls[R + r] = Row::load(w1, s1, b1, local + r, c);
      }
      accumulate(c, ls);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[r], u = acc2[r];
#pragma unroll
      for (int o = LPR / 2; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
        if constexpr (ACT != 0) u += __shfl_xor_sync(0xFFFFFFFFu, u, o);
      }
      if (sl == 0 && valid) {
        v = rnd<T>(v);
        if constexpr (ACT == 1) v = rnd<T>(silu_r<T>(v) * rnd<T>(u));
        if constexpr (ACT == 2) v = rnd<T>(gelu_tanh_r<T>(v) * rnd<T>(u));
        if constexpr (RESID) v = rnd<T>(v + to_f<T>(res[local + r]));
        y[local + r] = from_f<T>(v);
      }
    }
  }
}

}  // namespace omnia
