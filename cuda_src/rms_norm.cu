// rms_norm over the last dim of contiguous rows: y = x * rsqrt(mean(x^2) + eps) * w, fp32 math,
// with the semantics of torch.nn.functional.rms_norm (w optional, same dtype as x).
//
// Bytes: ideal 1 read + 1 write of x (+ w once, cached). v1 reads each row twice (sum of squares,
// then scale); the second read hits L1/L2 for rows up to ~100 KB.
// Limits: any row length; one block per row.
// Versions: v1 — block per row, 16-byte loads when rows and w are 16-byte aligned.
// v2 — the row in registers (common.cuh, rows_config): 1 read + 1 write for rows of up to 32768
// elements that are a multiple of 16 bytes and aligned; several short rows per block, reduced with shuffles. v1 does the rest.
// Backward, with r = rsqrt(mean(x^2) + eps) recomputed from x and g = dy * w: dx = r * (g - x * r^2 * mean(g * x))
// (block per row: x, dy read twice, dx written once); dw = sum over rows of dy * x * r by the column kernel of
// common.cuh (x and dy read once more: 5 passes where 3 would do, v1).
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

template <typename T, int P>
__global__ void __launch_bounds__(1024, 1) rms_norm_v2_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                              T* __restrict__ y, int64_t rows, int n, float eps,
                                                              int tpr) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  const int lane = threadIdx.x & (tpr - 1), rpb = blockDim.x / tpr;
  for (int64_t base = (int64_t)blockIdx.x * rpb; base < rows; base += (int64_t)gridDim.x * rpb) {
    const int64_t r = base + threadIdx.x / tpr;
    const bool live = r < rows;
    Pack<T> q[P];  // raw: 4 registers a pack
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * tpr + lane) * V;
      if (live && i < n) {
        q[p] = *reinterpret_cast<const Pack<T>*>(x + r * n + i);
#pragma unroll
        for (int j = 0; j < V; ++j) ss += to_f(q[p].v[j]) * to_f(q[p].v[j]);
      }
    }
    const float rstd = rsqrtf(group_sum(ss, tpr, smem) / (float)n + eps);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * tpr + lane) * V;
      if (live && i < n) {
        float pw[V], a[V];
        if (w) load_f<T, V>(w, i, pw);
#pragma unroll
        for (int j = 0; j < V; ++j) a[j] = w ? to_f(q[p].v[j]) * rstd * pw[j] : to_f(q[p].v[j]) * rstd;
        store_f<T, V>(y, r * n + i, a);
      }
    }
  }
}

template <typename T>
static cudaError_t launch_rms_norm(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps,
                                   cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const RowsConfig c = rows_config(rows, n, V, aligned16(x) && aligned16(y) && (w == nullptr || aligned16(w)));
  if (c.packs) {
    TIERED_OPS_WITH_PACKS(c.packs, V, P, rms_norm_v2_kernel<T, P><<<c.blocks, c.threads, 0, stream>>>(
                                             x, w, y, rows, (int)n, eps, c.tpr));
    return cudaGetLastError();
  }
  const bool vec = n % V == 0 && aligned16(x) && aligned16(y) && (w == nullptr || aligned16(w));
  const int threads = row_threads(n, vec ? V : 1);
  if (vec)
    rms_norm_v1_kernel<T, V><<<grid_rows(rows), threads, 0, stream>>>(x, w, y, rows, n, eps);
  else
    rms_norm_v1_kernel<T, 1><<<grid_rows(rows), threads, 0, stream>>>(x, w, y, rows, n, eps);
  return cudaGetLastError();
}

template <typename T, int V>
__global__ void rms_norm_bwd_v1_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                       T* __restrict__ dx, float* __restrict__ rstd_out, int64_t rows, int64_t n,
                                       float eps) {
  __shared__ float smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * n;
    float ss = 0.f, gx = 0.f;
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      float a[V], g[V], ww[V];
      load_f<T, V>(x, base + i, a);
      load_f<T, V>(dy, base + i, g);
      if (w) load_f<T, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) ss += a[j] * a[j], gx += (w ? g[j] * ww[j] : g[j]) * a[j];
    }
    const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
    const float c = block_sum(gx, smem) * rstd * rstd / (float)n;
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      float a[V], g[V], ww[V];
      load_f<T, V>(x, base + i, a);
      load_f<T, V>(dy, base + i, g);
      if (w) load_f<T, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = rstd * ((w ? g[j] * ww[j] : g[j]) - a[j] * c);
      store_f<T, V>(dx, base + i, a);
    }
    if (rstd_out && threadIdx.x == 0) rstd_out[r] = rstd;
  }
}

template <typename T>
static cudaError_t launch_rms_norm_bwd(const T* dy, const T* x, const T* w, T* dx, float* rstd, float* dw_partial,
                                       int64_t rows, int64_t n, float eps, int64_t rows_per, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = n % V == 0 && aligned16(dy) && aligned16(x) && aligned16(dx) && (w == nullptr || aligned16(w));
  const int threads = row_threads(n, vec ? V : 1);
  float* rstd_out = w ? rstd : nullptr;
  if (vec)
    rms_norm_bwd_v1_kernel<T, V><<<grid_rows(rows), threads, 0, stream>>>(dy, x, w, dx, rstd_out, rows, n, eps);
  else
    rms_norm_bwd_v1_kernel<T, 1><<<grid_rows(rows), threads, 0, stream>>>(dy, x, w, dx, rstd_out, rows, n, eps);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || w == nullptr) return err;
  return launch_norm_param_grads<T>(dy, x, nullptr, rstd, dw_partial, nullptr, rows, n, rows_per, stream);
}

cudaError_t rms_norm_bwd(const void* dy, const void* x, const void* w, void* dx, float* rstd, float* dw_partial,
                         int64_t rows, int64_t n, float eps, int64_t rows_per, DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_rms_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(x),
                                                 static_cast<const T*>(w), static_cast<T*>(dx), rstd, dw_partial, rows,
                                                 n, eps, rows_per, stream));
  return cudaSuccess;
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
