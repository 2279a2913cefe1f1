// layer_norm over the last dim of contiguous rows: y = (x - mean) * rstd * w + b, fp32 math, with the
// semantics of torch.nn.functional.layer_norm (biased variance; w, b optional, same dtype as x). Writes
// per-row fp32 mean and rstd for the backward.
//
// Bytes: ideal 1 read + 1 write of x (+ w, b once). v1 reads each row three times (mean, then the
// centred variance, then normalize); the later reads hit L1/L2 for rows up to ~100 KB.
// Backward, xhat = (x - mean) * rstd, g = dy * w: dx = rstd * (g - xhat * mean(g * xhat) - mean(g)) (block per
// row on a persistent grid, x and dy read once into registers where the row fits one pass of the block, else twice: norm_grads.cuh's RowPasses); dw = sum of dy * xhat and db = sum of
// dy over rows, summed per block into fp32 partials and reduced by a second launch (norm_grads.cuh). v1 read x and
// dy once more in a column kernel and summed and cast the partials with torch.
// Limits: any row length; v1 gives a block to a row, so a few giant rows use few SMs (v3 splits them).
// Versions: v1 — block per row, 16-byte loads when rows, w and b are 16-byte aligned.
// v2 — the row in registers (common.cuh, rows_config): 1 read + 1 write for rows of up to 32768
// elements that are a multiple of 16 bytes and aligned, the centred variance from registers; several short rows per block,
// reduced with shuffles. v1 does the rest.
// v3 — rows over 32768 elements split over blocks (aligned rows of a multiple of 16 bytes; split_rows.cuh): pieces of
// 512 x 4 packs, one a block; launch 1 writes each piece's exact mean and centred sum of squares, launch 2 (a block a
// row) merges a row's (Chan's formula) into the mean and rstd outputs, launch 3 normalizes each piece: x is read twice
// (the second time from L2 for the pieces read last), y written once, w and b read once for all rows (blocks
// piece-major); in fp32 all of a thread's packs of them are loaded at once (pack by pack, the launch waits on each
// load in turn). Merging a row's pieces in every block of launch 3 instead (512 merges a row over (64, 256, 256))
// kept its blocks from loading w and b while they merged.
// Backward v2 — rows of at most 4096 elements on a persistent grid, w and the dw/db sums in registers, 16-bit rows
// through a ring of shared memory (ln_grads.cuh).
// v4 — rows of more than 128 packs a block each, straight-line (line_rows.cuh: 2 packs a thread for 16-bit rows, 4 for
// fp32, 32 registers where v2's loop over rows held 64): 1 read + 1 write, the centred variance from registers, rows up
// to 32768 elements (1024 threads).
#include "line_rows.cuh"
#include "ln_grads.cuh"
#include "norm_grads.cuh"
#include "split_rows.cuh"

namespace tiered_ops {

template <typename T, int V>
__global__ void layer_norm_v1_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                     T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                     int64_t rows, int64_t n, float eps) {
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const int64_t base = r * n;
    float s = 0.f;
    for_row<V>(n, [&](int64_t i) {
      float a[V];
      load_f<T, V>(x, base + i, a);
#pragma unroll
      for (int j = 0; j < V; ++j) s += a[j];
    });
    const float mean = block_sum(s, smem) / (float)n;
    float ss = 0.f;
    for_row<V>(n, [&](int64_t i) {
      float a[V];
      load_f<T, V>(x, base + i, a);
#pragma unroll
      for (int j = 0; j < V; ++j) ss += (a[j] - mean) * (a[j] - mean);
    });
    const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
    for_row<V>(n, [&](int64_t i) {
      float a[V], pw[V], pb[V];
      load_f<T, V>(x, base + i, a);
      if (w) load_f<T, V>(w, i, pw);
      if (b) load_f<T, V>(b, i, pb);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        a[j] = (a[j] - mean) * rstd;
        if (w) a[j] *= pw[j];
        if (b) a[j] += pb[j];
      }
      store_f<T, V>(y, base + i, a);
    });
    if (threadIdx.x == 0) mean_out[r] = mean, rstd_out[r] = rstd;
  });
}

// A persistent grid (gridDim.x blocks striding over the rows): dx row by row, and the block's sums of dy * xhat (pw
// non-null) and dy (pb non-null) over its rows into its rows of the (gridDim.x, n) fp32 partials (K: norm_grads.cuh).
// n == 1: dx is exactly 0 (y = b whatever x is).
template <typename T, int V, int K = 1>
__global__ void __launch_bounds__(bwd_max_threads(K), bwd_min_blocks(K)) layer_norm_bwd_v1_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                 const T* __restrict__ w,
                                                                 const float* __restrict__ mean,
                                                                 const float* __restrict__ rstd, T* __restrict__ dx,
                                                                 float* pw, float* pb, int64_t rows, int64_t n) {
  __shared__ float smem[64];
  ColAcc<K, V> acc_w, acc_b;
  extern __shared__ float bwd_sm[];  // the partial sums (ColAcc): dw's, then db's
  acc_w.begin(pw ? pw + (int64_t)blockIdx.x * n : nullptr, bwd_sm, n);
  acc_b.begin(pb ? pb + (int64_t)blockIdx.x * n : nullptr, bwd_sm + (pw ? K * V * (int)blockDim.x : 0), n);
  for_block_rows(rows, [&](int64_t r) {
    const int64_t base = r * n;
    const float mu = mean[r], rs = rstd[r];
    // w at the pack of element i as floats (1 without a weight)
    auto weight = [&](int64_t i, float (&wv)[V]) {
      if (w) load_f<T, V>(w, i, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) wv[j] = w ? wv[j] : 1.f;
    };
    RowPasses<K, V, T, T> row;
    float s1 = 0.f, s2 = 0.f;
    row.first(n, x + base, dy + base, [&](int64_t i, const Raw<T, V>& xv, const Raw<T, V>& dv) {
      float wv[V];
      weight(i, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float g = to_f(dv.v[j]) * wv[j];
        s1 += g * (to_f(xv.v[j]) - mu) * rs, s2 += g;
      }
    });
    block_sum2(s1, s2, smem);
    const float c1 = s1 / (float)n, c2 = s2 / (float)n;
    row.second(n, x + base, dy + base, [&](int k, int64_t i, const Raw<T, V>& xv, const Raw<T, V>& dv) {
      float wv[V], o[V];
      weight(i, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = (to_f(xv.v[j]) - mu) * rs, d = to_f(dv.v[j]);
        if (pw) acc_w.add(k, i, j, d * a);
        if (pb) acc_b.add(k, i, j, d);
        o[j] = n == 1 ? 0.f : rs * (d * wv[j] - a * c1 - c2);
      }
      store_f<T, V>(dx, base + i, o);
    });
  });
  acc_w.finish(n);
  acc_b.finish(n);
}

template <typename T>
static bool rows_vec(int64_t n, const T* p0, const T* p1, const T* p2, const T* p3) {
  return n % Pack<T>::N == 0 && aligned16(p0) && aligned16(p1) && (!p2 || aligned16(p2)) && (!p3 || aligned16(p3));
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, 1) layer_norm_v2_kernel(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int n, float eps, int tpr) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  for_reg_rows(rows, n, tpr, [&](const RegRow& row) {
    const int64_t r = row.r;
    Pack<T> q[P];  // raw: 4 registers a pack
    float s = 0.f;
    row.load<P, V>(x + r * n, q, [&](float v) { s += v; });
    const float mean = group_sum(s, tpr, smem) / (float)n;
    float ss = 0.f;
    row.each<P, V>([&](int p, int) {
#pragma unroll
      for (int j = 0; j < V; ++j) ss += (to_f(q[p].v[j]) - mean) * (to_f(q[p].v[j]) - mean);
    });
    const float rstd = rsqrtf(group_sum(ss, tpr, smem) / (float)n + eps);
    row.each<P, V>([&](int p, int i) {
      float pw[V], pb[V], a[V];
      if (w) load_f<T, V>(w, i, pw);
      if (b) load_f<T, V>(b, i, pb);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        a[j] = (to_f(q[p].v[j]) - mean) * rstd;
        if (w) a[j] *= pw[j];
        if (b) a[j] += pb[j];
      }
      store_f<T, V>(y, r * n + i, a);
    });
    if (row.live && row.lane == 0) mean_out[r] = mean, rstd_out[r] = rstd;
  });
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, line_min_blocks(P, Pack<T>::N)) layer_norm_v4_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                             const T* __restrict__ b, T* __restrict__ y,
                                                             float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                                             int n, float eps) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  const LineRow row = LineRow::of_block(n);
  Pack<T> q[P];  // raw, converted where used: half the registers of floats for 16-bit rows
  row.load<P, V>(x, q);
  float s = 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int j = 0; j < V; ++j) s += to_f(q[p].v[j]);
  }
  const float mean = block_sum(s, smem) / (float)n;
  float ss = 0.f;
  row.each<P, V>([&](int p, int) {
#pragma unroll
    for (int j = 0; j < V; ++j) ss += (to_f(q[p].v[j]) - mean) * (to_f(q[p].v[j]) - mean);
  });
  const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
  row.each<P, V>([&](int p, int i) {
    float pw[V], pb[V], o[V];
    load_or<T, V>(w, i, pw, 1.f);  // the missing weight as 1, the missing bias as 0: the same values
    load_or<T, V>(b, i, pb, 0.f);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = (to_f(q[p].v[j]) - mean) * rstd * pw[j] + pb[j];
    store_f<T, V>(y, row.base + i, o);
  });
  if (threadIdx.x == 0) mean_out[blockIdx.x] = mean, rstd_out[blockIdx.x] = rstd;
}

// v3's last launch (after split_rows.cuh's two): the piece normalized with its row's mean and rstd. The pieces go in
// the reverse order of launch 1, so the first blocks read what launch 1 read last, still in L2.
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) layer_norm_v3_norm_kernel(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    const float* __restrict__ row_mean, const float* __restrict__ row_rstd, int64_t n, int pieces) {
  constexpr int V = Pack<T>::N;
  const int64_t rows = gridDim.x / pieces, g = (int64_t)gridDim.x - 1 - blockIdx.x;  // launch 1's order, reversed
  const int64_t k = g % rows * pieces + g / rows, r = k / pieces, first = (k % pieces) * kSplitPiece;
  Pack<T> q[kSplitPacks], qw[kSplitPacks], qb[kSplitPacks];
  const int cnt = load_piece(x, n, k, pieces, q);
  const float mean = row_mean[r], rstd = row_rstd[r];
  // fp32: the piece's w and b all in flight at once, not pack by pack, each waited on before its pack is written
  // (16-bit: at once they take 116 registers, one block an SM; pack by pack, below, under 64: two blocks an SM)
  constexpr bool kAtOnce = sizeof(T) == 4;
  if constexpr (kAtOnce) {
#pragma unroll
    for (int p = 0; p < kSplitPacks; ++p) {
      const int j = p * kSplitThreads + threadIdx.x;
      if (j < cnt) {
        if (w) qw[p] = load_pack(w + (first + j) * V);
        if (b) qb[p] = load_pack(b + (first + j) * V);
      }
    }
  }
  Pack<T>* yr = reinterpret_cast<Pack<T>*>(y + r * n) + first;
#pragma unroll
  for (int p = 0; p < kSplitPacks; ++p) {
    const int j = p * kSplitThreads + threadIdx.x;
    if (j < cnt) {
      float pw[V], pb[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if constexpr (kAtOnce) pw[e] = to_f(qw[p].v[e]), pb[e] = to_f(qb[p].v[e]);
      }
      if constexpr (!kAtOnce) {
        const int64_t i = (first + j) * V;  // the pack's first element in the row
        if (w) load_f<T, V>(w, i, pw);
        if (b) load_f<T, V>(b, i, pb);
      }
      Pack<T> o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float a = (to_f(q[p].v[e]) - mean) * rstd;
        if (w) a *= pw[e];
        if (b) a += pb[e];
        o.v[e] = from_f<T>(a);
      }
      yr[j] = o;
    }
  }
}

template <typename T>
static cudaError_t launch_layer_norm(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, int64_t rows,
                                     int64_t n, float eps, void* workspace, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = rows_vec<T>(n, x, y, w, b);
  const LineConfig l = line_config(rows, n, V, vec);
  if (l.packs) {
    TIERED_OPS_WITH_PACKS(l.packs, V, P, layer_norm_v4_kernel<T, P><<<(unsigned)rows, l.threads, 0, stream>>>(
                                             x, w, b, y, mean, rstd, (int)n, eps));
    return cudaGetLastError();
  }
  const RowsConfig c = rows_config(rows, n, V, vec);
  if (c.packs) {
    TIERED_OPS_WITH_PACKS(c.packs, V, P, layer_norm_v2_kernel<T, P><<<c.blocks, c.threads, 0, stream>>>(
                                             x, w, b, y, mean, rstd, rows, (int)n, eps, c.tpr));
    return cudaGetLastError();
  }
  const int pieces = split_pieces<T>(rows, n, vec);
  if (pieces && workspace) {
    float2* stats = static_cast<float2*>(workspace);
    const unsigned blocks = (unsigned)(rows * pieces);
    split_stats_kernel<T><<<blocks, kSplitThreads, 0, stream>>>(x, stats, n, pieces);
    split_merge_kernel<T><<<(unsigned)rows, kSplitThreads, 0, stream>>>(stats, mean, rstd, n, pieces, eps);
    layer_norm_v3_norm_kernel<T><<<blocks, kSplitThreads, 0, stream>>>(x, w, b, y, mean, rstd, n, pieces);
    return cudaGetLastError();
  }
  return launch_block_rows(vec, V, layer_norm_v1_kernel<T, V>, layer_norm_v1_kernel<T, 1>, rows, n, stream, x, w, b,
                           y, mean, rstd, rows, n, eps);
}

// The dx kernel on `blocks` blocks writing the dw/db partials (each may be null), then their reduction into dw/db.
template <typename T>
static cudaError_t launch_layer_norm_bwd(const T* dy, const T* x, const T* w, const float* mean, const float* rstd,
                                         T* dx, float* dw_partial, float* db_partial, T* dw, T* db, int64_t rows,
                                         int64_t n, int64_t blocks, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = rows_vec<T>(n, dy, x, dx, w);
  if (vec && ln_bwd_v2_plan(n, V).k) {
    const cudaError_t err = launch_ln_bwd_v2<T>(dy, x, w, mean, rstd, dx, dw_partial, db_partial, rows, n, blocks,
                                                stream);
    return err != cudaSuccess ? err : launch_reduce_partials<T>(dw_partial, db_partial, dw, db, blocks, n, stream);
  }
  cudaError_t err = launch_norm_bwd<V>(vec, n, [&](auto vx, auto kx, int threads) {
    constexpr int VX = decltype(vx)::value, KX = decltype(kx)::value;
    const auto kernel = layer_norm_bwd_v1_kernel<T, VX, KX>;
    const size_t smem = bwd_smem(KX, VX, threads, (dw_partial ? 1 : 0) + (db_partial ? 1 : 0));
    if (allow_smem(reinterpret_cast<const void*>(kernel), smem) != cudaSuccess) return;  // the launch error follows
    kernel<<<(unsigned)blocks, threads, smem, stream>>>(dy, x, w, mean, rstd, dx, dw_partial, db_partial, rows, n);
  });
  if (err != cudaSuccess) return err;
  return launch_reduce_partials<T>(dw_partial, db_partial, dw, db, blocks, n, stream);
}

int64_t layer_norm_bwd_blocks(int64_t rows, int64_t n, DType dtype, int accs) {
  if (rows == 0 || n == 0) return 1;
  TIERED_OPS_DISPATCH(dtype, T, {
    if (const int64_t blocks = ln_bwd_v2_grid<T>(rows, n)) return blocks;
  });
  TIERED_OPS_DISPATCH(dtype, T, return norm_bwd_grid<Pack<T>::N>(rows, n, accs, [](auto vx, auto kx) {
    return layer_norm_bwd_v1_kernel<T, decltype(vx)::value, decltype(kx)::value>;
  }));
  return 1;
}

int64_t layer_norm_fwd_workspace(int64_t rows, int64_t n, DType dtype) {
  if (rows == 0 || n == 0) return 0;
  TIERED_OPS_DISPATCH(dtype, T, return split_workspace<T>(rows, n));
  return 0;
}

cudaError_t layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                           int64_t rows, int64_t n, float eps, void* workspace, DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_layer_norm(static_cast<const T*>(x), static_cast<const T*>(w),
                                               static_cast<const T*>(b), static_cast<T*>(y), mean, rstd, rows, n, eps,
                                               workspace, stream));
  return cudaSuccess;
}

cudaError_t layer_norm_bwd(const void* dy, const void* x, const void* w, const float* mean, const float* rstd,
                           void* dx, float* dw_partial, float* db_partial, void* dw, void* db, int64_t rows, int64_t n,
                           int64_t blocks, DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_layer_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(x),
                                                   static_cast<const T*>(w), mean, rstd, static_cast<T*>(dx),
                                                   dw_partial, db_partial, static_cast<T*>(dw), static_cast<T*>(db),
                                                   rows, n, blocks, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
