#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace omnia {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// v rounded to T and back: the rounding an MLX op in dtype T applies to its result.
template <typename T> __device__ __forceinline__ float rnd(float v) { return to_f<T>(from_f<T>(v)); }

// Eight 2-byte values packed in 16 bytes, to floats.
template <typename T> __device__ __forceinline__ void unpack8(const uint4& u, float* f);
template <> __device__ __forceinline__ void unpack8<__nv_bfloat16>(const uint4& u, float* f) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
template <> __device__ __forceinline__ void unpack8<__half>(const uint4& u, float* f) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
    float2 v = __half22float2(h);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

template <typename T> __device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 u;
  unsigned int* w = reinterpret_cast<unsigned int*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    T lo = from_f<T>(f[2 * i]);
    T hi = from_f<T>(f[2 * i + 1]);
    unsigned short l = *reinterpret_cast<unsigned short*>(&lo);
    unsigned short h = *reinterpret_cast<unsigned short*>(&hi);
    w[i] = (unsigned int)l | ((unsigned int)h << 16);
  }
  return u;
}

__device__ __forceinline__ float omnia_inf() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// An unsigned integer q < 2^23 as a float, without an integer-to-float conversion.
__device__ __forceinline__ float small_uint_to_float(unsigned int q) {
  return __uint_as_float(0x4B000000u | q) - 8388608.0f;
}

// The second phase of a chained launch (chain_source): the block waits until `count` reaches
// n, the first phase's blocks having published, then reads what they wrote. Called after the
// block's first loads (weights, cached rows) are issued, so their latency overlaps the wait.
// Nothing when count is null (a launch of its own). The count is polled by an acquire load,
// not an atomic: hundreds of blocks may be waiting on one counter, and atomics on one address
// are serialized in L2, delaying the publishers' own.
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void wait_published(const int* count, int n) {
  if (count == nullptr) return;
  if (threadIdx.x == 0) {
    while (load_acquire(count) < n) __nanosleep(100);
    __threadfence();
  }
  __syncthreads();
}

}  // namespace omnia
