// rms_norm over the last dim of contiguous rows: y = x * rsqrt(mean(x^2) + eps) * w, fp32 math,
// with the semantics of torch.nn.functional.rms_norm (w optional, same dtype as x).
//
// Bytes: ideal 1 read + 1 write of x (+ w once, cached). v1 reads each row twice (sum of squares,
// then scale); the second read hits L1/L2 for rows up to ~100 KB.
// Limits: any row length; one block per row.
// Versions: v1 — block per row, 16-byte loads when rows and w are 16-byte aligned.
// v2 — the row in registers (common.cuh, rows_config): 1 read + 1 write for rows of up to 32768
// elements that are a multiple of 16 bytes and aligned; several short rows per block, reduced with shuffles. v1 does the rest.
// Rows of at most 128 packs (short_rows_config) take 4 packs a thread (2 for fp32 rows of up to 16 packs) and the
// fewest threads that hold them, up to a warp (rows_config gives them one pack a thread, 1-3 loads in flight, and rows
// of 33-64 packs a 64-thread block each that waits on a block reduction).
// v3 — rows of more than 128 packs a block each, straight-line (line_rows.cuh: 2 packs a thread for 16-bit rows, 4 for
// fp32, 31 registers where v2's loop over rows held 61-64): 1 read + 1 write, rows up to 32768 elements (1024 threads).
// Backward, with r = rsqrt(mean(x^2) + eps) recomputed from x and g = dy * w: dx = r * (g - x * r^2 * mean(g * x))
// (block per row on a persistent grid: x, dy read once and held in registers where the row fits one pass of the block,
// else read a second time from L1/L2; dx written once); dw = sum over
// rows of dy * x * r, summed per block into fp32 partials and reduced by a second launch (norm_grads.cuh). v1 read x
// and dy once more in a column kernel and summed and cast the partials with torch: 4 launches, 5 passes.
// Hugging Face forms (runtime arguments of the same kernels, one launch): w_offset multiplies by (w + w_offset) in fp32
// (Gemma); cast rounds x * r to T before the weight multiplies it (Llama), y in promote(w, x). r = rsqrtf(mean + eps)
// is torch.rsqrt's. A float32 w over bf16/fp16 x (W = float, and Y = float under cast) takes v1's scalar path.
// Backward v2 (rms_grads.cuh, one kernel for both rms norms): rows of up to 5120 elements, a multiple of the pack, with
// x, dy, w of one type: a persistent grid whose threads keep (w + w_offset) and their dw sums in registers for the
// whole kernel (layer_norm's backward v2 design); v1 does the rest.
#include <type_traits>

#include "rms_grads.cuh"

namespace tiered_ops {

template <typename T, int V, typename W = T, typename Y = T>
__global__ void rms_norm_v1_kernel(const T* __restrict__ x, const W* __restrict__ w, Y* __restrict__ y,
                                   int64_t rows, int64_t n, float eps, float w_offset, bool cast) {
  static_assert(V == 1 || (std::is_same<T, W>::value && std::is_same<T, Y>::value), "packs need one element type");
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const T* xr = x + r * n;
    Y* yr = y + r * n;
    float ss = 0.f;
    for_row<V>(n, [&](int64_t i) {
      float a[V];
      load_f<T, V>(xr, i, a);
#pragma unroll
      for (int j = 0; j < V; ++j) ss += a[j] * a[j];
    });
    const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
    for_row<V>(n, [&](int64_t i) {
      float a[V], pw[V];
      load_f<T, V>(xr, i, a);
      if (w) load_f<W, V>(w, i, pw);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = rms_weighted<T>(a[j] * rstd, w, w ? pw[j] : 0.f, w_offset, cast);
      store_f<Y, V>(yr, i, a);
    });
  });
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, 1) rms_norm_v2_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                              T* __restrict__ y, int64_t rows, int n, float eps,
                                                              int tpr, float w_offset, bool cast) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  for_reg_rows(rows, n, tpr, [&](const RegRow& row) {
    const int64_t r = row.r;
    Pack<T> q[P];  // raw: 4 registers a pack
    float ss = 0.f;
    row.load<P, V>(x + r * n, q, [&](float v) { ss += v * v; });
    const float rstd = rsqrtf(group_sum(ss, tpr, smem) / (float)n + eps);
    row.each<P, V>([&](int p, int i) {
      float pw[V], a[V];
      if (w) load_f<T, V>(w, i, pw);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = rms_weighted<T>(to_f(q[p].v[j]) * rstd, w, w ? pw[j] : 0.f, w_offset, cast);
      store_f<T, V>(y, r * n + i, a);
    });
  });
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, line_min_blocks(P, Pack<T>::N)) rms_norm_v3_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                           T* __restrict__ y, int n, float eps, float w_offset,
                                                           bool cast) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  const LineRow row = LineRow::of_block(n);
  float a[P][V];
  row.load<P, V>(x, a);
  float ss = 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int j = 0; j < V; ++j) ss += a[p][j] * a[p][j];
  }
  const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
  row.each<P, V>([&](int p, int i) {
    float pw[V], o[V];
    if (w) load_f<T, V>(w, i, pw);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = rms_weighted<T>(a[p][j] * rstd, w, w ? pw[j] : 0.f, w_offset, cast);
    store_f<T, V>(y, row.base + i, o);
  });
}

// rows_config, with rows of at most 32 threads of 4 packs held by the fewest threads of 4 packs each (2 for fp32
// rows of up to 16 packs, fewer where the row is shorter), 128 threads a block.
static RowsConfig short_rows_config(int64_t rows, int64_t n, int V, bool aligned) {
  RowsConfig c = rows_config(rows, n, V, aligned);
  const int64_t packs = n / V;
  if (!c.packs || packs > 32 * 4) return c;
  int p = V == 4 && packs <= 16 ? 2 : 4;
  while (p > 1 && p >= 2 * packs) p /= 2;
  int t = 1;
  while ((int64_t)t * p < packs) t *= 2;
  const int64_t rpb = 128 / t, want = (rows + rpb - 1) / rpb;
  c.packs = p, c.tpr = t, c.threads = 128;
  c.blocks = (unsigned)(want < 65535 * 32 ? want : 65535 * 32);
  return c;
}

template <typename T>
static cudaError_t launch_rms_norm(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps, float w_offset,
                                   bool cast, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool aligned = aligned16(x) && aligned16(y) && (w == nullptr || aligned16(w));
  const LineConfig l = line_config(rows, n, V, aligned);
  if (l.packs) {
    TIERED_OPS_WITH_PACKS(l.packs, V, P, rms_norm_v3_kernel<T, P><<<(unsigned)rows, l.threads, 0, stream>>>(
                                             x, w, y, (int)n, eps, w_offset, cast));
    return cudaGetLastError();
  }
  const RowsConfig c = short_rows_config(rows, n, V, aligned);
  if (c.packs) {
    TIERED_OPS_WITH_PACKS(c.packs, V, P, rms_norm_v2_kernel<T, P><<<c.blocks, c.threads, 0, stream>>>(
                                             x, w, y, rows, (int)n, eps, c.tpr, w_offset, cast));
    return cudaGetLastError();
  }
  return launch_block_rows(n % V == 0 && aligned, V, rms_norm_v1_kernel<T, V>, rms_norm_v1_kernel<T, 1>, rows, n,
                           stream, x, w, y, rows, n, eps, w_offset, cast);
}

// A float32 weight over bf16/fp16 x: v1's scalar path, y of type Y (T, or float under cast).
template <typename T, typename Y>
static cudaError_t launch_rms_norm_w32(const T* x, const float* w, Y* y, int64_t rows, int64_t n, float eps,
                                       float w_offset, bool cast, cudaStream_t stream) {
  auto k = rms_norm_v1_kernel<T, 1, float, Y>;
  return launch_block_rows(false, 1, k, k, rows, n, stream, x, w, y, rows, n, eps, w_offset, cast);
}

// A persistent grid (gridDim.x blocks striding over the rows): dx row by row, and with a weight (pw non-null) the
// block's sum of dy * x * r over its rows into its row of the (gridDim.x, n) fp32 partials (K: norm_grads.cuh).
template <typename T, int V, typename W = T, typename DY = T, int K = 1>
__global__ void __launch_bounds__(bwd_max_threads(K), bwd_min_blocks(K)) rms_norm_bwd_v1_kernel(const DY* __restrict__ dy, const T* __restrict__ x,
                                                               const W* __restrict__ w, T* __restrict__ dx,
                                                               float* pw, int64_t rows, int64_t n, float eps,
                                                               float w_offset) {
  static_assert(V == 1 || (std::is_same<T, W>::value && std::is_same<T, DY>::value), "packs need one element type");
  __shared__ float smem[64];
  ColAcc<K, V> acc;
  extern __shared__ float bwd_sm[];  // the partial sums (ColAcc)
  acc.begin(pw ? pw + (int64_t)blockIdx.x * n : nullptr, bwd_sm, n);
  for_block_rows(rows, [&](int64_t r) {
    const int64_t base = r * n;
    auto weight = [&](int64_t i, float (&ww)[V]) {
      if (w) load_f<W, V>(w, i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) ww[j] = w ? ww[j] + w_offset : 1.f;
    };
    RowPasses<K, V, T, DY> row;
    float ss = 0.f, gx = 0.f;
    row.first(n, x + base, dy + base, [&](int64_t i, const Raw<T, V>& xv, const Raw<DY, V>& dv) {
      float ww[V];
      weight(i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = to_f(xv.v[j]);
        ss += a * a, gx += to_f(dv.v[j]) * ww[j] * a;
      }
    });
    block_sum2(ss, gx, smem);
    const float rstd = rsqrtf(ss / (float)n + eps);
    const float c = gx * rstd * rstd / (float)n;
    row.second(n, x + base, dy + base, [&](int k, int64_t i, const Raw<T, V>& xv, const Raw<DY, V>& dv) {
      float ww[V], o[V];
      weight(i, ww);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = to_f(xv.v[j]), d = to_f(dv.v[j]);
        if (pw) acc.add(k, i, j, d * a * rstd);
        o[j] = rstd * (d * ww[j] - a * c);
      }
      store_f<T, V>(dx, base + i, o);
    });
  });
  acc.finish(n);
}

// The dx kernel on `blocks` blocks writing dw's partials (with a weight), then their reduction into dw (of type W);
// dy of type DY (T, or float under cast).
template <typename T, typename W, typename DY>
static cudaError_t launch_rms_norm_bwd(const DY* dy, const T* x, const W* w, T* dx, float* dw_partial, W* dw,
                                       int64_t rows, int64_t n, float eps, int64_t blocks, float w_offset,
                                       cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  constexpr bool one_type = std::is_same<T, W>::value && std::is_same<T, DY>::value;
  const bool vec = one_type && n % V == 0 && aligned16(dy) && aligned16(x) && aligned16(dx) &&
                   (w == nullptr || aligned16(w));
  if constexpr (one_type) {
    if (vec && rms_bwd_v2_threads(n, V))
      return launch_rms_bwd_v2<T, false>(dy, x, w, nullptr, nullptr, dx, dw_partial, dw, rows, n, eps, blocks,
                                         w_offset, stream);
  }
  float* pw = w ? dw_partial : nullptr;
  cudaError_t err = launch_norm_bwd<one_type ? V : 1>(vec, n, [&](auto vx, auto kx, int threads) {
    constexpr int VX = decltype(vx)::value, KX = decltype(kx)::value;
    const auto kernel = rms_norm_bwd_v1_kernel<T, VX, W, DY, KX>;
    const size_t smem = bwd_smem(KX, VX, threads, pw ? 1 : 0);
    if (allow_smem(reinterpret_cast<const void*>(kernel), smem) != cudaSuccess) return;  // the launch error follows
    kernel<<<(unsigned)blocks, threads, smem, stream>>>(dy, x, w, dx, pw, rows, n, eps, w_offset);
  });
  if (err != cudaSuccess || w == nullptr) return err;
  return launch_reduce_partials<W>(pw, nullptr, dw, nullptr, blocks, n, stream);
}

// The backward's grid for these element types (norm_bwd_grid).
template <typename T, typename W, typename DY>
static int64_t rms_norm_bwd_grid(int64_t rows, int64_t n, int accs) {
  constexpr int V = std::is_same<T, W>::value && std::is_same<T, DY>::value ? Pack<T>::N : 1;
  return norm_bwd_grid<V>(rows, n, accs, [](auto vx, auto kx) {
    return rms_norm_bwd_v1_kernel<T, decltype(vx)::value, W, DY, decltype(kx)::value>;
  });
}

int64_t rms_norm_bwd_blocks(int64_t rows, int64_t n, DType dtype, bool has_w, bool w_fp32, bool dy_fp32) {
  if (rows == 0 || n == 0) return 1;
  const int accs = has_w ? 1 : 0;
  TIERED_OPS_DISPATCH(dtype, T, {
    if constexpr (!std::is_same<T, float>::value) {
      if (w_fp32)
        return dy_fp32 ? rms_norm_bwd_grid<T, float, float>(rows, n, accs) : rms_norm_bwd_grid<T, float, T>(rows, n, accs);
    }
    const int64_t v2 = rms_bwd_v2_grid<T, false>(rows, n);
    return v2 ? v2 : rms_norm_bwd_grid<T, T, T>(rows, n, accs);
  });
  return 1;
}

cudaError_t rms_norm_bwd(const void* dy, const void* x, const void* w, void* dx, float* dw_partial, void* dw,
                         int64_t rows, int64_t n, float eps, int64_t blocks, DType dtype, cudaStream_t stream,
                         float w_offset, bool w_fp32, bool dy_fp32) {
  if (rows == 0 || n == 0) return cudaSuccess;
  if (w_fp32 && w != nullptr && dtype != DType::F32) {
    TIERED_OPS_DISPATCH(dtype, T, if constexpr (!std::is_same<T, float>::value) {
      if (dy_fp32)
        return launch_rms_norm_bwd(static_cast<const float*>(dy), static_cast<const T*>(x),
                                   static_cast<const float*>(w), static_cast<T*>(dx), dw_partial,
                                   static_cast<float*>(dw), rows, n, eps, blocks, w_offset, stream);
      return launch_rms_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const float*>(w),
                                 static_cast<T*>(dx), dw_partial, static_cast<float*>(dw), rows, n, eps, blocks,
                                 w_offset, stream);
    });
    return cudaErrorInvalidValue;
  }
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_rms_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(x),
                                                 static_cast<const T*>(w), static_cast<T*>(dx), dw_partial,
                                                 static_cast<T*>(dw), rows, n, eps, blocks, w_offset, stream));
  return cudaSuccess;
}

cudaError_t rms_norm_fwd(const void* x, const void* w, void* y, int64_t rows, int64_t n, float eps, DType dtype,
                         cudaStream_t stream, float w_offset, bool cast, bool w_fp32) {
  if (rows == 0 || n == 0) return cudaSuccess;
  if (w_fp32 && w != nullptr && dtype != DType::F32) {
    TIERED_OPS_DISPATCH(dtype, T, if constexpr (!std::is_same<T, float>::value) {
      if (cast)  // promote(float32, T): y is float32
        return launch_rms_norm_w32(static_cast<const T*>(x), static_cast<const float*>(w), static_cast<float*>(y),
                                   rows, n, eps, w_offset, cast, stream);
      return launch_rms_norm_w32(static_cast<const T*>(x), static_cast<const float*>(w), static_cast<T*>(y), rows, n,
                                 eps, w_offset, cast, stream);
    });
    return cudaErrorInvalidValue;
  }
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_rms_norm(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y),
                                             rows, n, eps, w_offset, cast, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
