// rms_norm over the last dim of contiguous rows: y = x * rsqrt(mean(x^2) + eps) * w, fp32 math,
// with the semantics of torch.nn.functional.rms_norm (w optional, same dtype as x).
//
// Bytes: ideal 1 read + 1 write of x (+ w once, cached). v1 reads each row twice (sum of squares,
// then scale); the second read hits L1/L2 for rows up to ~100 KB.
// Limits: any row length; one block per row.
// Versions: v1 — block per row, 16-byte loads when rows and w are 16-byte aligned.
#include "common.cuh"

namespace tiered_ops {

template <typename T, int V>
__global__ void rms_norm_v1_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                   int64_t rows, int64_t n, float eps) {
  __shared__ float smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    float ss = 0.f;
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      if constexpr (V > 1) {
        Pack<T> p = *reinterpret_cast<const Pack<T>*>(xr + i);
#pragma unroll
        for (int j = 0; j < V; ++j) ss += to_f(p.v[j]) * to_f(p.v[j]);
      } else {
        const float v = to_f(xr[i]);
        ss += v * v;
      }
    }
    const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      if constexpr (V > 1) {
        Pack<T> p = *reinterpret_cast<const Pack<T>*>(xr + i), q;
        Pack<T> pw;
        if (w) pw = *reinterpret_cast<const Pack<T>*>(w + i);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float v = to_f(p.v[j]) * rstd;
          q.v[j] = from_f<T>(w ? v * to_f(pw.v[j]) : v);
        }
        *reinterpret_cast<Pack<T>*>(yr + i) = q;
      } else {
        const float v = to_f(xr[i]) * rstd;
        yr[i] = from_f<T>(w ? v * to_f(w[i]) : v);
      }
    }
  }
}

template <typename T>
static cudaError_t launch_rms_norm(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps,
                                   cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = n % V == 0 && aligned16(x) && aligned16(y) && (w == nullptr || aligned16(w));
  const int threads = row_threads(n, vec ? V : 1);
  if (vec)
    rms_norm_v1_kernel<T, V><<<grid_rows(rows), threads, 0, stream>>>(x, w, y, rows, n, eps);
  else
    rms_norm_v1_kernel<T, 1><<<grid_rows(rows), threads, 0, stream>>>(x, w, y, rows, n, eps);
  return cudaGetLastError();
}

cudaError_t rms_norm_fwd(const void* x, const void* w, void* y, int64_t rows, int64_t n, float eps, DType dtype,
                         cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_rms_norm(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y),
                                             rows, n, eps, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
