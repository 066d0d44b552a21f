namespace omnia {

// d (16 x 8, float) += a (16 x 16) * b (16 x 8): one m16n8k16 tensor-core step on T pairs
// (a: four registers, b: two; the PTX ISA's fragment layouts).
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const unsigned int* a, const unsigned int* b);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const unsigned int* a,
                                                         const unsigned int* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float* d, const unsigned int* a,
                                                  const unsigned int* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A pair of T whose bits are MAGIC | q is 2^E + q exactly (bfloat16: 128 + q, half: 1024 + q,
// q < 16); MAGIC itself is the pair (2^E, 2^E); ONE the pair (1, 1).
template <typename T> struct PairBits;
template <> struct PairBits<__nv_bfloat16> {
  static constexpr unsigned int MAGIC = 0x43004300u, ONE = 0x3F803F80u;
  static __device__ __forceinline__ unsigned int sub(unsigned int a, unsigned int b) {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const unsigned int*>(&r);
  }
};
template <> struct PairBits<__half> {
  static constexpr unsigned int MAGIC = 0x64006400u, ONE = 0x3C003C00u;
  static __device__ __forceinline__ unsigned int sub(unsigned int a, unsigned int b) {
    const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a),
                              *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const unsigned int*>(&r);
  }
};

// Nibbles 2p and 2p + 1 of a word of 4-bit weights as a pair of T (the lower nibble in the lower
// half), exactly: the integers 0-15 are T values, and (2^E + q) - 2^E is exact.
template <typename T>
__device__ __forceinline__ unsigned int nibble_pair(unsigned int word, int p) {
  const unsigned int v = word >> (8 * p);
  const unsigned int bits = (v & 0xFu) | ((v << 12) & 0xF0000u) | PairBits<T>::MAGIC;
  return PairBits<T>::sub(bits, PairBits<T>::MAGIC);
}

// y = W x for up to 16 rows of x ([nx][K], nx <= 16) on tensor cores, 4-bit affine weights in
// groups of GROUP (64 or 128): per group, y += s * (q . x) + b * sum(x), the two dot products
// (q . x and 1 . x) taken by m16n8k16 steps on the exact integer q and x as they are, in float.
//
// A warp covers NT tiles of 8 weight rows (the steps' 8 columns) for every row of x (the 16
// rows of the step; rows past nx read zeros and are not written). Its lanes hold, at each step
// of 64 input values, the words 2t and 2t + 1 (values 16t..16t+15) of weight row g of each tile
// (g = lane / 4, t = lane % 4), and those values of x rows g and g + 8: each lane's sixteen
// values feed the four k-steps four at a time (the k order within a step is permuted the same
// way for x and W, so the dot product is the one declared). The block's NWARPS warps split the
// steps (warp w takes steps w, w + NWARPS, ...) and their sums meet in shared memory, in warp
// order.
//
// ACT 0: rows of up to three segments (each a multiple of 8 * NT rows); 1 silu-gated, 2
// gelu_tanh-gated (N0 == N1: tiles 0..NT/2-1 the gate's rows, the rest the same rows of the up
// projection); RESID: y = rnd(rnd(W x) + res), res [nx][N0]. Rounded as the qmv kernel rounds.
template <typename T, int GROUP, int K, int N0, int N1, int N2, int NT, int NWARPS, int ACT,
          bool RESID>
__device__ __forceinline__ void qmv_rows(
    const T* x, int nx, const unsigned int* w0, const T* s0, const T* b0, const unsigned int* w1,
    const T* s1, const T* b1, const unsigned int* w2, const T* s2, const T* b2, const T* res,
    T* y0, T* y1, T* y2, int block) {
  static_assert(K % 64 == 0 && (GROUP == 64 || GROUP == 128), "steps of 64 values");
  static_assert(ACT == 0 || NT % 2 == 0, "gated tiles come in pairs");
  constexpr int STEPS = K / 64;
  constexpr int WPR = K / 8;          // 32-bit words of a weight row
  constexpr int GPR = K / GROUP;      // groups of a weight row
  constexpr int TILES_OUT = ACT == 0 ? NT : NT / 2;  // tiles of output rows
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // The block's first output row and its segment.
  const int row0 = block * TILES_OUT * 8;
  const unsigned int* w = w0;
  const T* s = s0;
  const T* b = b0;
  T* y = y0;
  int local = row0, width = N0;
  if constexpr (ACT == 0) {
    if (row0 >= N0 + N1) { w = w2; s = s2; b = b2; y = y2; local = row0 - N0 - N1; width = N2; }
    else if (row0 >= N0) { w = w1; s = s1; b = b1; y = y1; local = row0 - N0; width = N1; }
  }
  // Tile j's matrix and first row: gated, the second half reads the up projection.
  const unsigned int* tw[NT];
  const T* ts[NT];
  const T* tb[NT];
  int tr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const bool up = ACT != 0 && j >= NT / 2;
    tw[j] = up ? w1 : w;
    ts[j] = up ? s1 : s;
    tb[j] = up ? b1 : b;
    tr[j] = local + 8 * (up ? j - NT / 2 : j);
  }
  const bool xa_ok = g < nx, xb_ok = g + 8 < nx;
  const T* xa_p = x + (size_t)g * K + 16 * t;
  const T* xb_p = x + (size_t)(g + 8) * K + 16 * t;

  // One step's loads: the weights of this lane's row of each tile, the scales and biases of
  // the two columns it accumulates (rows 2t, 2t + 1 of each tile), its x values.
  struct Loads {
    uint2 w[NT];
    T s[NT][2], b[NT][2];
    uint4 xa[2], xb[2];
  };
  auto load = [&](int st, Loads& l) {
    const int grp = (st * 64) / GROUP;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      l.w[j] = __ldg(reinterpret_cast<const uint2*>(tw[j] + (size_t)(tr[j] + g) * WPR + st * 8) + t);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const size_t gi = (size_t)(tr[j] + 2 * t + c) * GPR + grp;
        l.s[j][c] = ts[j][gi];
        l.b[j][c] = tb[j][gi];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l.xa[h] = xa_ok ? __ldg(reinterpret_cast<const uint4*>(xa_p + st * 64) + h) : make_uint4(0u, 0u, 0u, 0u);
      l.xb[h] = xb_ok ? __ldg(reinterpret_cast<const uint4*>(xb_p + st * 64) + h) : make_uint4(0u, 0u, 0u, 0u);
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
  }
  const unsigned int ones[2] = {PairBits<T>::ONE, PairBits<T>::ONE};
  Loads cur, nxt;
  if (warp < STEPS) load(warp, cur);
#pragma unroll 1
  for (int st = warp; st < STEPS; st += NWARPS) {
    if (st + NWARPS < STEPS) load(st + NWARPS, nxt);
    float d[NT][4], sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) d[j][i] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint4& xa = cur.xa[ks >> 1];
      const uint4& xb = cur.xb[ks >> 1];
      const bool hi = ks & 1;
      const unsigned int a[4] = {hi ? xa.z : xa.x, hi ? xb.z : xb.x, hi ? xa.w : xa.y,
                                 hi ? xb.w : xb.y};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const unsigned int word = ks < 2 ? cur.w[j].x : cur.w[j].y;
        const unsigned int q[2] = {nibble_pair<T>(word, 2 * (ks & 1)),
                                   nibble_pair<T>(word, 2 * (ks & 1) + 1)};
        mma_16816<T>(d[j], a, q);
      }
      mma_16816<T>(sx, a, ones);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float sc = to_f<T>(cur.s[j][i & 1]), bi = to_f<T>(cur.b[j][i & 1]);
        acc[j][i] += fmaf(sc, d[j][i], bi * sx[i]);
      }
    }
    cur = nxt;
  }

  // The warps' sums, in warp order; warp 0 writes the outputs.
  __shared__ float red[NWARPS][NT * 4][32];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][j * 4 + i][lane] = acc[j][i];
  }
  __syncthreads();
  if (warp != 0) return;
  float v[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float sum = 0.f;
#pragma unroll
      for (int ww = 0; ww < NWARPS; ++ww) sum += red[ww][j * 4 + i][lane];
      v[j][i] = sum;
    }
  }
  // Element i of tile j: x row g (i < 2) or g + 8, output row (tile's first) + 2t + (i & 1).
#pragma unroll
  for (int j = 0; j < TILES_OUT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = g + 8 * (i >> 1);
      if (m >= nx) continue;
      const int r = local + 8 * j + 2 * t + (i & 1);
      float o = rnd<T>(v[j][i]);
      if constexpr (ACT == 1) o = rnd<T>(silu_r<T>(o) * rnd<T>(v[j + NT / 2][i]));
      if constexpr (ACT == 2) o = rnd<T>(gelu_tanh_r<T>(o) * rnd<T>(v[j + NT / 2][i]));
      if constexpr (RESID) o = rnd<T>(o + to_f<T>(res[(size_t)m * N0 + r]));
      y[(size_t)m * width + r] = from_f<T>(o);
    }
  }
}

}  // namespace omnia
