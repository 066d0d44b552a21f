namespace omnia {

// A load of q, k_new or v_new: through L2 (ld.global.cg) when CG, they being written by other
// blocks of this launch (a chained launch's first phase).
template <bool CG, typename U> __device__ __forceinline__ U ld_new(const U* p) {
  if constexpr (CG) return __ldcg(p); else return *p;
}

// The cache's rows come in chunks of KPB, a block (slice) a chunk of each kv head. WALK (a
// capacity past MAXS chunks): a kv head's chunks are dealt to MAXS slices (chunk c to slice
// c % MAXS) and a block walks its chunks with an online softmax (running max and sum, the
// output rescaled when the max moves). The last block of a kv head merges the slices. `block`: this block's index among the attention's
// blocks (blockIdx.x, or a chained launch's ticket). CG: q, k_new and v_new come from the first phase of a chained launch: `wait`,
// `wait_for` say when they are there (wait_published), after the loads that do not need them.
// HS: the query heads of a kv head are split over HS blocks of a slice (GB = G / HS heads
// each, their own partials, counter and merge); every head's arithmetic is the same at any HS.
template <typename T, int H, int HKV, int D, int KPB, bool QN, bool KN, bool TRAD, bool WALK,
          bool CG = false, int HS = 1>
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
  constexpr int MAXS = ${MAX_SLICES};  // slices of a kv head at most
  constexpr int BUF = NW * GB * D > GB * MAXS ? NW * GB * D : GB * MAXS;
  static_assert(KPB % SLOTS == 0 && (CH & (CH - 1)) == 0 && CH <= 32 && G % HS == 0, "geometry");
  __shared__ __align__(16) float hs[GB + 1][D];  // rotated query heads, then the rotated new key
  __shared__ float p[GB][KPB];
  __shared__ float stat[GB][2];                  // running (max, sum) of each head
  __shared__ float rescale[WALK ? GB : 1];       // the last chunk's exp(old max - new max)
  __shared__ __align__(16) float buf[BUF];      // per-warp outputs, then the merge weights
  __shared__ int last;
  const int chunks = cap / KPB;
  const int slices = WALK && chunks > MAXS ? MAXS : chunks;
  const int kvh = block / (slices * HS), split = block % slices;
  const int hh = HS == 1 ? 0 : block / slices % HS;  // which GB heads of the kv head
  const int hoff = hh * GB;  // this block's first query head within its kv head's (0: HS 1)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = tid / CH, c = tid % CH;
  const int pos = pos_p[0];
  const int filled = pos / KPB + 1;  // chunks holding a row up to pos
  // every slot (core/cache.py); none for a batch's rows (their offsets move on the host's side)
  if (next_pos != nullptr && block == 0 && tid < ${OFFSET_SLOTS}) next_pos[tid] = pos + 1;
  if (split >= filled) return;  // no chunk of this slice holds a row yet
  T* kc = const_cast<T*>(k_cache) + (size_t)kvh * cap * D;
  T* vc = const_cast<T*>(v_cache) + (size_t)kvh * cap * D;
  int t0 = split * KPB;
  int n = min(KPB, pos + 1 - t0);  // keys of this chunk
  // Every load of the first chunk's cached rows first, so their latencies overlap each other
  // and the head work (the new row's value is read below, with q and k_new).
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
  // one block of the kv head stores the new row: its chunk's
  if (hh == 0 && (WALK ? (filled - 1) % slices == split : pos < t0 + KPB)) {
    for (int d = tid; d < D; d += NT) {
      kc[(size_t)pos * D + d] = from_f<T>(hs[GB][d]);
      vc[(size_t)pos * D + d] = ld_new<CG>(v_new + kvh * D + d);
    }
  }
  if (WALK && tid < GB) { stat[tid][0] = -omnia_inf(); stat[tid][1] = 0.f; }
  // The block's share of the output, GB * D values over its threads: kept across chunks.
  constexpr int AN = (GB * D + NT - 1) / NT;
  float out_acc[AN];
#pragma unroll
  for (int a = 0; a < AN; ++a) out_acc[a] = 0.f;
  for (;;) {
    const int t1 = WALK ? t0 + slices * KPB : 0;  // this slice's next chunk
    const bool more = WALK && t1 <= pos;           // the same for every thread of the block
    const int n1 = more ? min(KPB, pos + 1 - t1) : 0;
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
    // the next chunk's keys are requested while this one's softmax and values run
    if constexpr (WALK) {
#pragma unroll
      for (int u = 0; u < ITER; ++u) {
        const int r = u * SLOTS + slot, t = t1 + r;
        if (r < n1 && t != pos) kr[u] = reinterpret_cast<const uint4*>(kc + (size_t)t * D)[c];
      }
    }
    __syncthreads();
    // Softmax (WALK: against the running max m = max(old max, this chunk's); the old sum and
    // output are rescaled by exp(old - m), 0 at the first chunk, the old max being -inf).
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
    // the next chunk's values, the new row's from v_new
    if constexpr (WALK) {
#pragma unroll
      for (int u = 0; u < ITER; ++u) {
        const int r = u * SLOTS + slot, t = t1 + r;
        if (r < n1) {
          vr[u] = t == pos ? ld_new<CG>(reinterpret_cast<const uint4*>(v_new + kvh * D) + c)
                           : reinterpret_cast<const uint4*>(vc + (size_t)t * D)[c];
        }
      }
    }
    __syncthreads();
    if constexpr (!WALK) {  // one chunk: the warps' sums are the slice's output
      for (int i = tid; i < GB * D; i += NT) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) s += buf[w * GB * D + i];
        part_o[((size_t)split * H + kvh * G + hoff) * D + i] = s;
      }
      break;
    }
#pragma unroll
    for (int a = 0; a < AN; ++a) {
      const int i = tid + a * NT;
      if (i >= GB * D) continue;
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) s += buf[w * GB * D + i];
      out_acc[a] = fmaf(out_acc[a], rescale[i / D], s);
    }
    if (!more) break;
    t0 = t1;
    n = n1;
  }
  if constexpr (WALK) {
#pragma unroll
    for (int a = 0; a < AN; ++a) {
      const int i = tid + a * NT;
      if (i < GB * D) part_o[((size_t)split * H + kvh * G + hoff) * D + i] = out_acc[a];
    }
  }
  if (tid < GB) {
    part_ml[((size_t)split * H + kvh * G + hoff + tid) * 2] = stat[tid][0];
    part_ml[((size_t)split * H + kvh * G + hoff + tid) * 2 + 1] = stat[tid][1];
  }
  // The last block of this kv head to get here merges every slice.
  const int active = WALK && filled > slices ? slices : (pos + KPB) / KPB;
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
