// fused_add_rms_norm over the last dim of contiguous rows: s = x + residual (rounded once to T, as torch's
// x + residual), y = s * rsqrt(mean(s^2) + eps) * w (w optional), fp32 math; s, y and rstd per row (fp32) out.
//
// Bytes: ideal 2 reads (x, residual) + 2 writes (y, s) of a row (+ w once, cached; + 4 bytes of rstd a row).
// Limits: any row length; one block per row (v1) or several short rows per block (v2).
// Versions: v1 — block per row, 16-byte loads when every pointer is 16-byte aligned and n a multiple of the pack:
// s is written in the first pass and read back (by the thread that wrote it) in the second.
// v2 — the row of s in registers (common.cuh, rows_config): 2 reads + 2 writes for rows of up to 32768 elements that
// are a multiple of 16 bytes and aligned; several short rows per block, reduced with shuffles. v1 does the rest.
// Backward, with r the saved rstd, g = dy * w, ds the gradient of s: dx = ds + r * (g - s * r^2 * mean(g * s))
// (block per row: dy and s read twice, ds once, dx written once; dx is also dresidual); dw = sum over rows of
// dy * s * r by the column kernel of common.cuh (dy and s read once more: 7 passes where 4 would do, v1).
// Hugging Face forms: rms_norm's runtime arguments (w_offset: w + w_offset in fp32; cast: y rounded to T before the
// weight, y in promote(w, x)) on y of the rounded sum s, in the same launch; a float32 w over bf16/fp16 x takes v1's
// scalar path.
#include <type_traits>

#include "common.cuh"

namespace tiered_ops {

// v = s * r in fp32, wv = w in fp32: the output value before its rounding to Y.
template <typename T>
__device__ __forceinline__ float fused_rms_weighted(float v, bool has_w, float wv, float w_offset, bool cast) {
  if (cast) v = to_f(from_f<T>(v));
  return has_w ? v * (w_offset != 0.f ? wv + w_offset : wv) : v;
}

template <typename T, int V, typename W = T, typename Y = T>
__global__ void fused_add_rms_norm_v1_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                             const W* __restrict__ w, Y* __restrict__ y, T* s,
                                             float* __restrict__ rstd_out, int64_t rows, int64_t n, float eps,
                                             float w_offset, bool cast) {
  static_assert(V == 1 || (std::is_same<T, W>::value && std::is_same<T, Y>::value), "packs need one element type");
  __shared__ float smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * n;
    float ss = 0.f;
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      float a[V], b[V];
      load_f<T, V>(x, base + i, a);
      load_f<T, V>(res, base + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        a[j] = to_f(from_f<T>(a[j] + b[j]));  // the sum as T holds it
        ss += a[j] * a[j];
      }
      store_f<T, V>(s, base + i, a);
    }
    const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      // This thread's own stores of the first pass, through a plain (coherent) load: s is written by this kernel, so
      // it is neither const nor __restrict__ here and never goes through the read-only cache.
      float a[V], ww[V];
      if constexpr (V > 1) {
        const Pack<T> q = *reinterpret_cast<const Pack<T>*>(s + base + i);
#pragma unroll
        for (int j = 0; j < V; ++j) a[j] = to_f(q.v[j]);
      } else {
        a[0] = to_f(s[base + i]);
      }
      if (w) load_f<W, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = fused_rms_weighted<T>(a[j] * rstd, w, w ? ww[j] : 0.f, w_offset, cast);
      store_f<Y, V>(y, base + i, a);
    }
    if (threadIdx.x == 0) rstd_out[r] = rstd;
  }
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, 1) fused_add_rms_norm_v2_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w, T* __restrict__ y,
    T* __restrict__ s, float* __restrict__ rstd_out, int64_t rows, int n, float eps, int tpr, float w_offset,
    bool cast) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  const int lane = threadIdx.x & (tpr - 1), rpb = blockDim.x / tpr;
  for (int64_t base = (int64_t)blockIdx.x * rpb; base < rows; base += (int64_t)gridDim.x * rpb) {
    const int64_t r = base + threadIdx.x / tpr;
    const bool live = r < rows;
    Pack<T> q[P];  // the row of s, raw: 4 registers a pack
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * tpr + lane) * V;
      if (live && i < n) {
        const Pack<T> a = *reinterpret_cast<const Pack<T>*>(x + r * n + i);
        const Pack<T> b = *reinterpret_cast<const Pack<T>*>(res + r * n + i);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          q[p].v[j] = from_f<T>(to_f(a.v[j]) + to_f(b.v[j]));
          const float v = to_f(q[p].v[j]);
          ss += v * v;
        }
        *reinterpret_cast<Pack<T>*>(s + r * n + i) = q[p];
      }
    }
    const float rstd = rsqrtf(group_sum(ss, tpr, smem) / (float)n + eps);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * tpr + lane) * V;
      if (live && i < n) {
        float pw[V], o[V];
        if (w) load_f<T, V>(w, i, pw);
#pragma unroll
        for (int j = 0; j < V; ++j)
          o[j] = fused_rms_weighted<T>(to_f(q[p].v[j]) * rstd, w, w ? pw[j] : 0.f, w_offset, cast);
        store_f<T, V>(y, r * n + i, o);
      }
    }
    if (live && lane == 0) rstd_out[r] = rstd;
  }
}

template <typename T>
static cudaError_t launch_fused_add_rms_norm(const T* x, const T* res, const T* w, T* y, T* s, float* rstd,
                                             int64_t rows, int64_t n, float eps, float w_offset, bool cast,
                                             cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool aligned = aligned16(x) && aligned16(res) && aligned16(y) && aligned16(s) && (w == nullptr || aligned16(w));
  const RowsConfig c = rows_config(rows, n, V, aligned);
  if (c.packs) {
    TIERED_OPS_WITH_PACKS(c.packs, V, P, fused_add_rms_norm_v2_kernel<T, P><<<c.blocks, c.threads, 0, stream>>>(
                                             x, res, w, y, s, rstd, rows, (int)n, eps, c.tpr, w_offset, cast));
    return cudaGetLastError();
  }
  const bool vec = n % V == 0 && aligned;
  const int threads = row_threads(n, vec ? V : 1);
  if (vec)
    fused_add_rms_norm_v1_kernel<T, V><<<grid_rows(rows), threads, 0, stream>>>(x, res, w, y, s, rstd, rows, n, eps,
                                                                                 w_offset, cast);
  else
    fused_add_rms_norm_v1_kernel<T, 1><<<grid_rows(rows), threads, 0, stream>>>(x, res, w, y, s, rstd, rows, n, eps,
                                                                                 w_offset, cast);
  return cudaGetLastError();
}

// A float32 weight over bf16/fp16 x: v1's scalar path, y of type Y (T, or float under cast).
template <typename T, typename Y>
static cudaError_t launch_fused_add_rms_norm_w32(const T* x, const T* res, const float* w, Y* y, T* s, float* rstd,
                                                 int64_t rows, int64_t n, float eps, float w_offset, bool cast,
                                                 cudaStream_t stream) {
  fused_add_rms_norm_v1_kernel<T, 1, float, Y><<<grid_rows(rows), row_threads(n, 1), 0, stream>>>(
      x, res, w, y, s, rstd, rows, n, eps, w_offset, cast);
  return cudaGetLastError();
}

template <typename T, int V, typename W = T, typename DY = T>
__global__ void fused_add_rms_norm_bwd_v1_kernel(const DY* __restrict__ dy, const T* __restrict__ ds,
                                                 const T* __restrict__ s, const W* __restrict__ w,
                                                 const float* __restrict__ rstd_in, T* __restrict__ dx, int64_t rows,
                                                 int64_t n, float w_offset) {
  static_assert(V == 1 || (std::is_same<T, W>::value && std::is_same<T, DY>::value), "packs need one element type");
  __shared__ float smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * n;
    const float rstd = rstd_in[r];
    float gs = 0.f;
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      float a[V], g[V], ww[V];
      load_f<T, V>(s, base + i, a);
      load_f<DY, V>(dy, base + i, g);
      if (w) load_f<W, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) gs += (w ? g[j] * (ww[j] + w_offset) : g[j]) * a[j];
    }
    const float c = block_sum(gs, smem) * rstd * rstd / (float)n;
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) {
      float a[V], g[V], ww[V], d[V];
      load_f<T, V>(s, base + i, a);
      load_f<DY, V>(dy, base + i, g);
      load_f<T, V>(ds, base + i, d);
      if (w) load_f<W, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = d[j] + rstd * ((w ? g[j] * (ww[j] + w_offset) : g[j]) - a[j] * c);
      store_f<T, V>(dx, base + i, a);
    }
  }
}

template <typename T>
static cudaError_t launch_fused_add_rms_norm_bwd(const T* dy, const T* ds, const T* s, const T* w, const float* rstd,
                                                 T* dx, float* dw_partial, int64_t rows, int64_t n, int64_t rows_per,
                                                 float w_offset, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = n % V == 0 && aligned16(dy) && aligned16(ds) && aligned16(s) && aligned16(dx) &&
                   (w == nullptr || aligned16(w));
  const int threads = row_threads(n, vec ? V : 1);
  if (vec)
    fused_add_rms_norm_bwd_v1_kernel<T, V><<<grid_rows(rows), threads, 0, stream>>>(dy, ds, s, w, rstd, dx, rows, n,
                                                                                     w_offset);
  else
    fused_add_rms_norm_bwd_v1_kernel<T, 1><<<grid_rows(rows), threads, 0, stream>>>(dy, ds, s, w, rstd, dx, rows, n,
                                                                                     w_offset);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || w == nullptr) return err;
  return launch_norm_param_grads<T>(dy, s, nullptr, rstd, dw_partial, nullptr, rows, n, rows_per, stream);
}

// A float32 weight over bf16/fp16 s (dy of type DY: T, or float under cast): the scalar path, then the column kernel.
template <typename T, typename DY>
static cudaError_t launch_fused_add_rms_norm_bwd_w32(const DY* dy, const T* ds, const T* s, const float* w,
                                                     const float* rstd, T* dx, float* dw_partial, int64_t rows,
                                                     int64_t n, int64_t rows_per, float w_offset,
                                                     cudaStream_t stream) {
  fused_add_rms_norm_bwd_v1_kernel<T, 1, float, DY><<<grid_rows(rows), row_threads(n, 1), 0, stream>>>(
      dy, ds, s, w, rstd, dx, rows, n, w_offset);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_norm_param_grads<DY, T>(dy, s, nullptr, rstd, dw_partial, nullptr, rows, n, rows_per, stream);
}

cudaError_t fused_add_rms_norm_fwd(const void* x, const void* residual, const void* w, void* y, void* s, float* rstd,
                                   int64_t rows, int64_t n, float eps, DType dtype, cudaStream_t stream,
                                   float w_offset, bool cast, bool w_fp32) {
  if (rows == 0 || n == 0) return cudaSuccess;
  if (w_fp32 && w != nullptr && dtype != DType::F32) {
    TIERED_OPS_DISPATCH(dtype, T, if constexpr (!std::is_same<T, float>::value) {
      if (cast)  // promote(float32, T): y is float32
        return launch_fused_add_rms_norm_w32(static_cast<const T*>(x), static_cast<const T*>(residual),
                                             static_cast<const float*>(w), static_cast<float*>(y), static_cast<T*>(s),
                                             rstd, rows, n, eps, w_offset, cast, stream);
      return launch_fused_add_rms_norm_w32(static_cast<const T*>(x), static_cast<const T*>(residual),
                                           static_cast<const float*>(w), static_cast<T*>(y), static_cast<T*>(s), rstd,
                                           rows, n, eps, w_offset, cast, stream);
    });
    return cudaErrorInvalidValue;
  }
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_fused_add_rms_norm(static_cast<const T*>(x), static_cast<const T*>(residual),
                                                       static_cast<const T*>(w), static_cast<T*>(y),
                                                       static_cast<T*>(s), rstd, rows, n, eps, w_offset, cast, stream));
  return cudaSuccess;
}

cudaError_t fused_add_rms_norm_bwd(const void* dy, const void* ds, const void* s, const void* w, const float* rstd,
                                   void* dx, float* dw_partial, int64_t rows, int64_t n, int64_t rows_per, DType dtype,
                                   cudaStream_t stream, float w_offset, bool w_fp32, bool dy_fp32) {
  if (rows == 0 || n == 0) return cudaSuccess;
  if (w_fp32 && w != nullptr && dtype != DType::F32) {
    TIERED_OPS_DISPATCH(dtype, T, if constexpr (!std::is_same<T, float>::value) {
      if (dy_fp32)
        return launch_fused_add_rms_norm_bwd_w32(static_cast<const float*>(dy), static_cast<const T*>(ds),
                                                 static_cast<const T*>(s), static_cast<const float*>(w), rstd,
                                                 static_cast<T*>(dx), dw_partial, rows, n, rows_per, w_offset, stream);
      return launch_fused_add_rms_norm_bwd_w32(static_cast<const T*>(dy), static_cast<const T*>(ds),
                                               static_cast<const T*>(s), static_cast<const float*>(w), rstd,
                                               static_cast<T*>(dx), dw_partial, rows, n, rows_per, w_offset, stream);
    });
    return cudaErrorInvalidValue;
  }
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_fused_add_rms_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(ds),
                                                           static_cast<const T*>(s), static_cast<const T*>(w), rstd,
                                                           static_cast<T*>(dx), dw_partial, rows, n, rows_per,
                                                           w_offset, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
