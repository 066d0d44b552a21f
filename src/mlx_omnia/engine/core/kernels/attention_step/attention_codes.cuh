namespace omnia {

// Codes of a 16-byte word (E = 128 / BITS of them, element j at bits BITS * j of its uint32,
// MLX's affine packing) as floats.
template <int BITS> __device__ __forceinline__ void unpack_codes(const uint4& u, float* f) {
  constexpr int PER = 32 / BITS;  // codes in a uint32
  constexpr unsigned int MASK = (1u << BITS) - 1u;
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < PER; ++j) f[i * PER + j] = small_uint_to_float((w[i] >> (BITS * j)) & MASK);
  }
}

// Decode attention of one token's query heads over a quantized cache's codes (affine BITS-bit,
// groups of GS along a row: row = scale * code + bias), the new row already appended (`len`
// filled rows). One block a (kv head, slice); a slice a chunk of KPB rows, or (WALK) every
// MAXS-th chunk walked with an online softmax, as attention_step. A lane holds one 16-byte word
// of a row's codes (E dimensions in one group): its score is scale * (q . codes) + bias * sum(q)
// over its dimensions, the CH lanes of a row meeting through shuffles; values add
// (p * scale) * codes and p * bias. HS: a kv head's query heads split over HS blocks.
template <typename T, int H, int HKV, int D, int BITS, int GS, int KPB, bool WALK, int HS>
__device__ __forceinline__ void attention_codes(
    const T* q, const unsigned int* k_codes, const T* k_scales, const T* k_biases,
    const unsigned int* v_codes, const T* v_scales, const T* v_biases, const int* len_p,
    const int* counters, float* part_o, float* part_ml, T* out, float scale, int cap, int block) {
  constexpr int G = H / HKV;          // query heads of a kv head
  constexpr int GB = G / HS;          // of them, this block's
  constexpr int NT = 128, NW = NT / 32;
  constexpr int E = 128 / BITS;       // dimensions of a lane: one 16-byte word of codes
  constexpr int CH = D / E;           // lanes of a row
  constexpr int SLOTS = NT / CH;      // rows the block holds at once
  constexpr int ITER = KPB / SLOTS;   // rows per thread
  constexpr int NG = D / GS;          // groups of a row
  constexpr int MAXS = ${MAX_SLICES};  // slices of a kv head at most
  constexpr int BUF = NW * GB * D > GB * MAXS ? NW * GB * D : GB * MAXS;
  static_assert(ITER >= 1 && KPB % SLOTS == 0 && CH >= 1 && CH <= 32 && (CH & (CH - 1)) == 0 &&
                E <= GS && GS % E == 0 && G % HS == 0, "geometry");
  __shared__ __align__(16) float qs[GB][D];  // this block's query heads
  __shared__ float qsum[GB][CH];             // their sums over each lane's dimensions
  __shared__ float p[GB][KPB];
  __shared__ float stat[GB][2];               // (max, sum) of each head, running when WALK
  __shared__ float rescale[WALK ? GB : 1];    // the last chunk's exp(old max - new max)
  __shared__ __align__(16) float buf[BUF];   // per-warp outputs, then the merge weights
  __shared__ int last;
  const int chunks = cap / KPB;
  const int slices = WALK && chunks > MAXS ? MAXS : chunks;
  const int kvh = block / (slices * HS), split = block % slices;
  const int hh = HS == 1 ? 0 : block / slices % HS;
  const int hoff = hh * GB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = tid / CH, c = tid % CH;
  const int len = len_p[0];
  const int filled = (len - 1) / KPB + 1;  // chunks holding a row
  if (split >= filled) return;
  const uint4* kw = reinterpret_cast<const uint4*>(k_codes) + (size_t)kvh * cap * CH;
  const uint4* vw = reinterpret_cast<const uint4*>(v_codes) + (size_t)kvh * cap * CH;
  const int grp = c * E / GS;  // the group of this lane's dimensions
  const T* ksr = k_scales + (size_t)kvh * cap * NG + grp;
  const T* kbr = k_biases + (size_t)kvh * cap * NG + grp;
  const T* vsr = v_scales + (size_t)kvh * cap * NG + grp;
  const T* vbr = v_biases + (size_t)kvh * cap * NG + grp;
  int t0 = split * KPB;
  int n = min(KPB, len - t0);
  // The first chunk's rows requested before anything else.
  uint4 kr[ITER], vr[ITER];
  float ksc[ITER], kbi[ITER], vsc[ITER], vbi[ITER];
#pragma unroll
  for (int u = 0; u < ITER; ++u) {
    const int r = u * SLOTS + slot, t = t0 + r;
    kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
    ksc[u] = kbi[u] = vsc[u] = vbi[u] = 0.f;
    if (r < n) {
      kr[u] = kw[(size_t)t * CH + c];
      vr[u] = vw[(size_t)t * CH + c];
      ksc[u] = to_f<T>(ksr[(size_t)t * NG]);
      kbi[u] = to_f<T>(kbr[(size_t)t * NG]);
      vsc[u] = to_f<T>(vsr[(size_t)t * NG]);
      vbi[u] = to_f<T>(vbr[(size_t)t * NG]);
    }
  }
  const T* qh = q + (size_t)(kvh * G + hoff) * D;
  for (int i = tid; i < GB * D; i += NT) qs[i / D][i % D] = to_f<T>(qh[i]);
  __syncthreads();
  for (int i = tid; i < GB * CH; i += NT) {
    const int g = i / CH, l = i % CH;
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) s += qs[g][l * E + e];
    qsum[g][l] = s;
  }
  if (WALK && tid < GB) { stat[tid][0] = -omnia_inf(); stat[tid][1] = 0.f; }
  __syncthreads();
  constexpr int AN = (GB * D + NT - 1) / NT;
  float out_acc[AN];
#pragma unroll
  for (int a = 0; a < AN; ++a) out_acc[a] = 0.f;
  for (;;) {
    const int t1 = WALK ? t0 + slices * KPB : 0;  // this slice's next chunk
    const bool more = WALK && t1 < len;            // the same for every thread of the block
    const int n1 = more ? min(KPB, len - t1) : 0;
    // Scores.
#pragma unroll
    for (int u = 0; u < ITER; ++u) {
      const int r = u * SLOTS + slot;
      float cf[E];
      unpack_codes<BITS>(kr[u], cf);
      float sc[GB];
#pragma unroll
      for (int g = 0; g < GB; ++g) {
        float a = 0.f;
#pragma unroll
        for (int e4 = 0; e4 < E; e4 += 4) {
          const float4 qv = *reinterpret_cast<const float4*>(&qs[g][c * E + e4]);
          a = fmaf(qv.x, cf[e4], a); a = fmaf(qv.y, cf[e4 + 1], a);
          a = fmaf(qv.z, cf[e4 + 2], a); a = fmaf(qv.w, cf[e4 + 3], a);
        }
        sc[g] = fmaf(ksc[u], a, kbi[u] * qsum[g][c]);
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
    if constexpr (WALK) {  // the next chunk's keys, requested while this one's softmax runs
#pragma unroll
      for (int u = 0; u < ITER; ++u) {
        const int r = u * SLOTS + slot, t = t1 + r;
        if (r < n1) {
          kr[u] = kw[(size_t)t * CH + c];
          ksc[u] = to_f<T>(ksr[(size_t)t * NG]);
          kbi[u] = to_f<T>(kbr[(size_t)t * NG]);
        }
      }
    }
    __syncthreads();
    for (int g = warp; g < GB; g += NW) {
      float m = WALK ? stat[g][0] : -omnia_inf();
      for (int i = lane; i < n; i += 32) m = fmaxf(m, p[g][i]);
      m = warp_max(m);
      float l = 0.f;
      for (int i = lane; i < n; i += 32) {
        const float e = __expf(p[g][i] - m);
        p[g][i] = e;
        l += e;
      }
      l = warp_sum(l);
      if (lane == 0) {
        if constexpr (WALK) {
          const float w = __expf(stat[g][0] - m);
          rescale[g] = w;
          l = fmaf(stat[g][1], w, l);
        }
        stat[g][0] = m;
        stat[g][1] = l;
      }
    }
    __syncthreads();
    // Values, GH heads at a time (E accumulators a head); the rows of a warp meet through
    // shuffles, the warps in `buf`.
    constexpr int GH = GB < 32 / E ? GB : (32 / E < 1 ? 1 : 32 / E);
    for (int g0 = 0; g0 < GB; g0 += GH) {
      float o[GH][E], ob[GH];
#pragma unroll
      for (int g = 0; g < GH; ++g) {
        ob[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) o[g][e] = 0.f;
      }
#pragma unroll
      for (int u = 0; u < ITER; ++u) {
        const int r = u * SLOTS + slot;
        if (r < n) {
          float cf[E];
          unpack_codes<BITS>(vr[u], cf);
#pragma unroll
          for (int g = 0; g < GH; ++g) {
            const float pg = g0 + g < GB ? p[g0 + g][r] : 0.f;
            const float ps = pg * vsc[u];
            ob[g] = fmaf(pg, vbi[u], ob[g]);
#pragma unroll
            for (int e = 0; e < E; ++e) o[g][e] = fmaf(ps, cf[e], o[g][e]);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GH; ++g) {
#pragma unroll
        for (int off = CH; off < 32; off <<= 1) {
          ob[g] += __shfl_xor_sync(0xFFFFFFFFu, ob[g], off);
#pragma unroll
          for (int e = 0; e < E; ++e) o[g][e] += __shfl_xor_sync(0xFFFFFFFFu, o[g][e], off);
        }
      }
      if (lane < CH) {
#pragma unroll
        for (int g = 0; g < GH; ++g) {
          if (g0 + g >= GB) continue;
          float* dst = &buf[(warp * GB + g0 + g) * D + c * E];
#pragma unroll
          for (int e = 0; e < E; ++e) dst[e] = o[g][e] + ob[g];
        }
      }
    }
    if constexpr (WALK) {  // the next chunk's values
#pragma unroll
      for (int u = 0; u < ITER; ++u) {
        const int r = u * SLOTS + slot, t = t1 + r;
        if (r < n1) {
          vr[u] = vw[(size_t)t * CH + c];
          vsc[u] = to_f<T>(vsr[(size_t)t * NG]);
          vbi[u] = to_f<T>(vbr[(size_t)t * NG]);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < AN; ++a) {
      const int i = tid + a * NT;
      if (i >= GB * D) continue;
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) s += buf[w * GB * D + i];
      out_acc[a] = WALK ? fmaf(out_acc[a], rescale[i / D], s) : s;
    }
    if (!more) break;
    t0 = t1;
    n = n1;
  }
#pragma unroll
  for (int a = 0; a < AN; ++a) {
    const int i = tid + a * NT;
    if (i < GB * D) part_o[((size_t)split * H + kvh * G + hoff) * D + i] = out_acc[a];
  }
  if (tid < GB) {
    part_ml[((size_t)split * H + kvh * G + hoff + tid) * 2] = stat[tid][0];
    part_ml[((size_t)split * H + kvh * G + hoff + tid) * 2 + 1] = stat[tid][1];
  }
  // The last block of this kv head to get here merges every slice.
  const int active = filled < slices ? filled : slices;
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
  // Merge weights exp(m - max) of each head's slices in buf[g * active + slice], the head's
  // sum of l * weight in stat; then each output is its slices' partials, weighed.
  for (int g = warp; g < GB; g += NW) {
    const float* ml = part_ml + (size_t)(kvh * G + hoff + g) * 2;
    float* wg = buf + g * active;
    float m = -omnia_inf();
    for (int sp = lane; sp < active; sp += 32) {
      const float v = __ldcg(ml + (size_t)sp * H * 2);
      wg[sp] = v;
      m = fmaxf(m, v);
    }
    m = warp_max(m);
    float l = 0.f;
    for (int sp = lane; sp < active; sp += 32) {
      const float w = __expf(wg[sp] - m);
      l = fmaf(__ldcg(ml + (size_t)sp * H * 2 + 1), w, l);
      wg[sp] = w;
    }
    l = warp_sum(l);
    if (lane == 0) stat[g][1] = l;
  }
  __syncthreads();
  const float* po = part_o + (size_t)(kvh * G + hoff) * D;
  for (int i = tid; i < GB * D; i += NT) {
    const float* wg = buf + (i / D) * active;
    float acc = 0.f;
    for (int sp = 0; sp < active; ++sp) acc = fmaf(__ldcg(po + (size_t)sp * H * D + i), wg[sp], acc);
    out[(size_t)(kvh * G + hoff) * D + i] = from_f<T>(acc / stat[i / D][1]);
  }
}

}  // namespace omnia
