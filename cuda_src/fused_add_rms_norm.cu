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
// (block per row on a persistent grid: dy and s read once into registers where the row fits one pass of the block, else twice: RowPasses; ds once, dx written once;
// dx is also dresidual); dw = sum over rows of dy * s * r, summed per block into fp32 partials and reduced by a
// second launch (norm_grads.cuh). v1 read dy and s once more in a column kernel and summed and cast with torch.
// Hugging Face forms: rms_norm's runtime arguments (w_offset: w + w_offset in fp32; cast: y rounded to T before the
// weight, y in promote(w, x)) on y of the rounded sum s, in the same launch; a float32 w over bf16/fp16 x takes v1's
// scalar path.
// Backward v2 (rms_grads.cuh, one kernel for both rms norms): rows of up to 5120 elements, a multiple of the pack, with
// x, dy, w of one type: a persistent grid whose threads keep (w + w_offset) and their dw sums in registers for the
// whole kernel (layer_norm's backward v2 design); v1 does the rest.
#include <type_traits>

#include "rms_grads.cuh"

namespace tiered_ops {

template <typename T, int V, typename W = T, typename Y = T>
__global__ void fused_add_rms_norm_v1_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                             const W* __restrict__ w, Y* __restrict__ y, T* s,
                                             float* __restrict__ rstd_out, int64_t rows, int64_t n, float eps,
                                             float w_offset, bool cast) {
  static_assert(V == 1 || (std::is_same<T, W>::value && std::is_same<T, Y>::value), "packs need one element type");
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const int64_t base = r * n;
    float ss = 0.f;
    for_row<V>(n, [&](int64_t i) {
      float a[V], b[V];
      load_f<T, V>(x, base + i, a);
      load_f<T, V>(res, base + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        a[j] = to_f(from_f<T>(a[j] + b[j]));  // the sum as T holds it
        ss += a[j] * a[j];
      }
      store_f<T, V>(s, base + i, a);
    });
    const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
    for_row<V>(n, [&](int64_t i) {
      // This thread's own stores of the first pass, through a plain (coherent) load: s is written by this kernel, so
      // it is neither const nor __restrict__ here and never goes through the read-only cache.
      float a[V], ww[V];
      if constexpr (V > 1) {
        const Pack<T> q = load_pack<T>(s + base + i);
#pragma unroll
        for (int j = 0; j < V; ++j) a[j] = to_f(q.v[j]);
      } else {
        a[0] = to_f(s[base + i]);
      }
      if (w) load_f<W, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = rms_weighted<T>(a[j] * rstd, w, w ? ww[j] : 0.f, w_offset, cast);
      store_f<Y, V>(y, base + i, a);
    });
    if (threadIdx.x == 0) rstd_out[r] = rstd;
  });
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, 1) fused_add_rms_norm_v2_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w, T* __restrict__ y,
    T* __restrict__ s, float* __restrict__ rstd_out, int64_t rows, int n, float eps, int tpr, float w_offset,
    bool cast) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  for_reg_rows(rows, n, tpr, [&](const RegRow& row) {
    const int64_t r = row.r;
    Pack<T> q[P];  // the row of s, raw: 4 registers a pack
    float ss = 0.f;
    row.each<P, V>([&](int p, int i) {
      const Pack<T> a = load_pack(x + r * n + i), b = load_pack(res + r * n + i);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        q[p].v[j] = from_f<T>(to_f(a.v[j]) + to_f(b.v[j]));
        const float v = to_f(q[p].v[j]);
        ss += v * v;
      }
      *reinterpret_cast<Pack<T>*>(s + r * n + i) = q[p];
    });
    const float rstd = rsqrtf(group_sum(ss, tpr, smem) / (float)n + eps);
    row.each<P, V>([&](int p, int i) {
      float pw[V], o[V];
      if (w) load_f<T, V>(w, i, pw);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = rms_weighted<T>(to_f(q[p].v[j]) * rstd, w, w ? pw[j] : 0.f, w_offset, cast);
      store_f<T, V>(y, r * n + i, o);
    });
    if (row.live && row.lane == 0) rstd_out[r] = rstd;
  });
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
  return launch_block_rows(n % V == 0 && aligned, V, fused_add_rms_norm_v1_kernel<T, V>,
                           fused_add_rms_norm_v1_kernel<T, 1>, rows, n, stream, x, res, w, y, s, rstd, rows, n, eps,
                           w_offset, cast);
}

// A float32 weight over bf16/fp16 x: v1's scalar path, y of type Y (T, or float under cast).
template <typename T, typename Y>
static cudaError_t launch_fused_add_rms_norm_w32(const T* x, const T* res, const float* w, Y* y, T* s, float* rstd,
                                                 int64_t rows, int64_t n, float eps, float w_offset, bool cast,
                                                 cudaStream_t stream) {
  auto k = fused_add_rms_norm_v1_kernel<T, 1, float, Y>;
  return launch_block_rows(false, 1, k, k, rows, n, stream, x, res, w, y, s, rstd, rows, n, eps, w_offset, cast);
}

// A persistent grid (gridDim.x blocks striding over the rows): dx row by row, and with a weight (pw non-null) the
// block's sum of dy * s * r over its rows into its row of the (gridDim.x, n) fp32 partials (K: norm_grads.cuh).
template <typename T, int V, typename W = T, typename DY = T, int K = 1>
__global__ void __launch_bounds__(bwd_max_threads(K), bwd_min_blocks(K)) fused_add_rms_norm_bwd_v1_kernel(
    const DY* __restrict__ dy, const T* __restrict__ ds, const T* __restrict__ s, const W* __restrict__ w,
    const float* __restrict__ rstd_in, T* __restrict__ dx, float* pw, int64_t rows, int64_t n, float w_offset) {
  static_assert(V == 1 || (std::is_same<T, W>::value && std::is_same<T, DY>::value), "packs need one element type");
  __shared__ float smem[32];
  ColAcc<K, V> acc;
  extern __shared__ float bwd_sm[];  // the partial sums (ColAcc)
  acc.begin(pw ? pw + (int64_t)blockIdx.x * n : nullptr, bwd_sm, n);
  for_block_rows(rows, [&](int64_t r) {
    const int64_t base = r * n;
    const float rstd = rstd_in[r];
    // the weight's factor (w + w_offset) at the pack of element i (1 without a weight)
    auto weight = [&](int64_t i, float (&ww)[V]) {
      if (w) load_f<W, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) ww[j] = w ? ww[j] + w_offset : 1.f;
    };
    RowPasses<K, V, T, DY> row;
    float gs = 0.f;
    row.first(n, s + base, dy + base, [&](int64_t i, const Raw<T, V>& sv, const Raw<DY, V>& dv) {
      float ww[V];
      weight(i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) gs += to_f(dv.v[j]) * ww[j] * to_f(sv.v[j]);
    });
    const float c = block_sum(gs, smem) * rstd * rstd / (float)n;
    row.second(n, s + base, dy + base, [&](int k, int64_t i, const Raw<T, V>& sv, const Raw<DY, V>& dv) {
      const Raw<T, V> ev = *reinterpret_cast<const Raw<T, V>*>(ds + base + i);
      float ww[V], o[V];
      weight(i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = to_f(sv.v[j]), d = to_f(dv.v[j]);
        if (pw) acc.add(k, i, j, d * a * rstd);
        o[j] = to_f(ev.v[j]) + rstd * (d * ww[j] - a * c);
      }
      store_f<T, V>(dx, base + i, o);
    });
  });
  acc.finish(n);
}

// The dx kernel on `blocks` blocks writing dw's partials (with a weight), then their reduction into dw (of type W);
// dy of type DY (T, or float under cast).
template <typename T, typename W, typename DY>
static cudaError_t launch_fused_add_rms_norm_bwd(const DY* dy, const T* ds, const T* s, const W* w, const float* rstd,
                                                 T* dx, float* dw_partial, W* dw, int64_t rows, int64_t n,
                                                 int64_t blocks, float w_offset, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  constexpr bool one_type = std::is_same<T, W>::value && std::is_same<T, DY>::value;
  const bool vec = one_type && n % V == 0 && aligned16(dy) && aligned16(ds) && aligned16(s) && aligned16(dx) &&
                   (w == nullptr || aligned16(w));
  if constexpr (one_type) {
    if (vec && rms_bwd_v2_threads(n, V))
      return launch_rms_bwd_v2<T, true>(dy, s, w, ds, rstd, dx, dw_partial, dw, rows, n, 0.f, blocks, w_offset,
                                        stream);
  }
  float* pw = w ? dw_partial : nullptr;
  cudaError_t err = launch_norm_bwd<one_type ? V : 1>(vec, n, [&](auto vx, auto kx, int threads) {
    constexpr int VX = decltype(vx)::value, KX = decltype(kx)::value;
    const auto kernel = fused_add_rms_norm_bwd_v1_kernel<T, VX, W, DY, KX>;
    const size_t smem = bwd_smem(KX, VX, threads, pw ? 1 : 0);
    if (allow_smem(reinterpret_cast<const void*>(kernel), smem) != cudaSuccess) return;  // the launch error follows
    kernel<<<(unsigned)blocks, threads, smem, stream>>>(dy, ds, s, w, rstd, dx, pw, rows, n, w_offset);
  });
  if (err != cudaSuccess || w == nullptr) return err;
  return launch_reduce_partials<W>(pw, nullptr, dw, nullptr, blocks, n, stream);
}

// The backward's grid for these element types (norm_bwd_grid).
template <typename T, typename W, typename DY>
static int64_t fused_add_rms_norm_bwd_grid(int64_t rows, int64_t n, int accs) {
  constexpr int V = std::is_same<T, W>::value && std::is_same<T, DY>::value ? Pack<T>::N : 1;
  return norm_bwd_grid<V>(rows, n, accs, [](auto vx, auto kx) {
    return fused_add_rms_norm_bwd_v1_kernel<T, decltype(vx)::value, W, DY, decltype(kx)::value>;
  });
}

int64_t fused_add_rms_norm_bwd_blocks(int64_t rows, int64_t n, DType dtype, bool has_w, bool w_fp32, bool dy_fp32) {
  if (rows == 0 || n == 0) return 1;
  const int accs = has_w ? 1 : 0;
  TIERED_OPS_DISPATCH(dtype, T, {
    if constexpr (!std::is_same<T, float>::value) {
      if (w_fp32)
        return dy_fp32 ? fused_add_rms_norm_bwd_grid<T, float, float>(rows, n, accs)
                       : fused_add_rms_norm_bwd_grid<T, float, T>(rows, n, accs);
    }
    const int64_t v2 = rms_bwd_v2_grid<T, true>(rows, n);
    return v2 ? v2 : fused_add_rms_norm_bwd_grid<T, T, T>(rows, n, accs);
  });
  return 1;
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
                                   void* dx, float* dw_partial, void* dw, int64_t rows, int64_t n, int64_t blocks,
                                   DType dtype, cudaStream_t stream, float w_offset, bool w_fp32, bool dy_fp32) {
  if (rows == 0 || n == 0) return cudaSuccess;
  if (w_fp32 && w != nullptr && dtype != DType::F32) {
    TIERED_OPS_DISPATCH(dtype, T, if constexpr (!std::is_same<T, float>::value) {
      if (dy_fp32)
        return launch_fused_add_rms_norm_bwd(static_cast<const float*>(dy), static_cast<const T*>(ds),
                                             static_cast<const T*>(s), static_cast<const float*>(w), rstd,
                                             static_cast<T*>(dx), dw_partial, static_cast<float*>(dw), rows, n, blocks,
                                             w_offset, stream);
      return launch_fused_add_rms_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(ds),
                                           static_cast<const T*>(s), static_cast<const float*>(w), rstd,
                                           static_cast<T*>(dx), dw_partial, static_cast<float*>(dw), rows, n, blocks,
                                           w_offset, stream);
    });
    return cudaErrorInvalidValue;
  }
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_fused_add_rms_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(ds),
                                                           static_cast<const T*>(s), static_cast<const T*>(w), rstd,
                                                           static_cast<T*>(dx), dw_partial, static_cast<T*>(dw), rows,
                                                           n, blocks, w_offset, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
