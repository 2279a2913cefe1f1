// Shared device helpers for the tiered_ops CUDA kernels. Plain CUDA: no torch headers, so every
// kernel file compiles with a bare `nvcc -c` (CI does that on a machine without a GPU).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "launchers.h"

namespace tiered_ops {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 16 bytes of T: the widest load one thread issues.
template <typename T> struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// V elements of T at p + i as floats: one 16-byte load when V is the pack width, else one element.
template <typename T, int V>
__device__ __forceinline__ void load_f(const T* __restrict__ p, int64_t i, float (&v)[V]) {
  if constexpr (V > 1) {
    static_assert(V == Pack<T>::N, "V is 1 or the pack width");
    const Pack<T> q = *reinterpret_cast<const Pack<T>*>(p + i);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = to_f(q.v[j]);
  } else {
    v[0] = to_f(p[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_f(T* __restrict__ p, int64_t i, const float (&v)[V]) {
  if constexpr (V > 1) {
    Pack<T> q;
#pragma unroll
    for (int j = 0; j < V; ++j) q.v[j] = from_f<T>(v[j]);
    *reinterpret_cast<Pack<T>*>(p + i) = q;
  } else {
    p[i] = from_f<T>(v[0]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `smem` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // smem may still be read from a previous reduction
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : -INFINITY;
  return warp_max(v);
}

// Threads per block for a row of n elements moved in packs of `vec`: enough warps to cover the row
// once, at most 1024.
inline int row_threads(int64_t n, int vec) {
  int64_t want = (n + vec - 1) / vec;
  int t = 32;
  while (t < want && t < 1024) t *= 2;
  return t;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Rows per launch grid: enough blocks to fill the GPU, each block strides over rows.
inline unsigned grid_rows(int64_t rows) { return (unsigned)(rows < 65535 * 32 ? rows : 65535 * 32); }

// Weight/bias gradients of both normalizations, as partial sums over groups of rows (blockIdx.y): for column
// j, dw[g, j] = sum over the group's rows of dy * xhat and db[g, j] = sum of dy, xhat = (x - mean) * rstd
// (mean null: rms_norm; dw or db null: not wanted). Threads own consecutive columns, so every row's loads are coalesced; the caller sums
// the groups. Bytes: dy and x read once more, (groups, n) fp32 partials written.
template <typename T>
__global__ void norm_param_grads_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                        const float* __restrict__ mean, const float* __restrict__ rstd,
                                        float* __restrict__ dw, float* __restrict__ db, int64_t rows, int64_t n,
                                        int64_t rows_per) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t g = blockIdx.y, r0 = g * rows_per, r1 = r0 + rows_per < rows ? r0 + rows_per : rows;
  float aw = 0.f, ab = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = to_f(dy[r * n + j]);
    aw += d * (to_f(x[r * n + j]) - (mean ? mean[r] : 0.f)) * rstd[r];
    ab += d;
  }
  if (dw) dw[g * n + j] = aw;
  if (db) db[g * n + j] = ab;
}

template <typename T>
inline cudaError_t launch_norm_param_grads(const T* dy, const T* x, const float* mean, const float* rstd, float* dw,
                                           float* db, int64_t rows, int64_t n, int64_t rows_per, cudaStream_t stream) {
  const int64_t groups = (rows + rows_per - 1) / rows_per;
  const dim3 grid((unsigned)((n + 255) / 256), (unsigned)groups);
  norm_param_grads_kernel<T><<<grid, 256, 0, stream>>>(dy, x, mean, rstd, dw, db, rows, n, rows_per);
  return cudaGetLastError();
}

}  // namespace tiered_ops

#define TIERED_OPS_DISPATCH(dtype, T, ...)                                 \
  switch (dtype) {                                                         \
    case ::tiered_ops::DType::F32: { using T = float; __VA_ARGS__; break; } \
    case ::tiered_ops::DType::F16: { using T = __half; __VA_ARGS__; break; } \
    case ::tiered_ops::DType::BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;                                 \
  }
