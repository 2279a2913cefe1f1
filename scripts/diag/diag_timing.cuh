// What the standalone diagnostics (softmax_plans.cu, layer_norm_plans.cu, rms_norm_fwd_plans.cu,
// rms_norm_bwd_versions.cu, softmax_l2.cu, layer_norm_l2.cu) share: a CUDA call checked (the
// file, line and error, then exit), their inputs filled, a launch's kernel time as their tables give it, how far a
// candidate's output lies from the op's, and 16-byte loads and stores with L2 hints.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                            \
  do {                                                                   \
    cudaError_t e_ = (x);                                                \
    if (e_ != cudaSuccess) {                                             \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));  \
      exit(1);                                                           \
    }                                                                    \
  } while (0)

// The median of `reps` timed calls of f (ms, CUDA events, each waited on), after `warm` untimed ones. ONCE=1 in the
// environment: f launched once, untimed (a profiler's run), 1 returned.
template <class F>
static float time_ms(F f, int reps = 15, int warm = 3) {
  if (getenv("ONCE")) {
    f();
    CK(cudaDeviceSynchronize());
    return 1.f;
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// x[i] = a hash of (i, seed) spread uniformly over [shift - scale / 2, shift + scale / 2), as T (float or bf16).
template <typename T>
__global__ void fill(T* x, long n, unsigned seed, float scale, float shift) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    x[i] = T(((h & 0xffffff) / 16777216.f - 0.5f) * scale + shift);
  }
}

// An L2 eviction policy for a load's cache hint: keep its lines (evict_last) or drop them first (evict_first).
__device__ __forceinline__ uint64_t l2_policy(bool keep) {
  uint64_t p;
  if (keep)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// 16 bytes at a: with HINT under the L2 policy `pol`, else a plain load.
template <bool HINT>
__device__ __forceinline__ uint4 load16(const void* a, uint64_t pol) {
  uint4 v;
  if (HINT)
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a), "l"(pol));
  else
    v = *static_cast<const uint4*>(a);
  return v;
}
// 16 bytes to a: with HINT a streaming store (.cs: evicted first), else a plain one.
template <bool HINT>
__device__ __forceinline__ void store16(void* a, uint4 v) {
  if (HINT)
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  else
    *static_cast<uint4*>(a) = v;
}
__device__ __forceinline__ float4 as_float4(uint4 u) {
  return make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
}
__device__ __forceinline__ uint4 as_uint4(float4 f) {
  return make_uint4(__float_as_uint(f.x), __float_as_uint(f.y), __float_as_uint(f.z), __float_as_uint(f.w));
}

// The worst |a - b| / (floor + |b|) over n elements of T, as float bits in *out (non-negative floats order as
// unsigned ints): equal elements 0, a NaN difference infinite.
template <typename T>
__global__ void worst_diff_kernel(const T* a, const T* b, int64_t n, float floor, unsigned* out) {
  float w = 0.f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float u = float(a[i]), v = float(b[i]);
    const float d = u == v ? 0.f : fabsf(u - v) / (floor + fabsf(v));
    w = fmaxf(w, d != d ? INFINITY : d);
  }
  atomicMax(out, __float_as_uint(w));
}
// worst_diff_kernel's figure for n elements of a against b (floor 1e-30: relative; 1: relative above 1, absolute
// below).
template <typename T>
static float worst_diff(const T* a, const T* b, int64_t n, float floor) {
  static unsigned* scratch = nullptr;
  if (!scratch) CK(cudaMalloc(&scratch, 4));
  CK(cudaMemset(scratch, 0, 4));
  worst_diff_kernel<T><<<1024, 256>>>(a, b, n, floor, scratch);
  unsigned bits = 0;
  CK(cudaMemcpy(&bits, scratch, 4, cudaMemcpyDeviceToHost));
  float v;
  memcpy(&v, &bits, 4);
  return v;
}
