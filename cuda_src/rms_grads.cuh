// The backward v2 of the rms norms (rms_norm, fused_add_rms_norm), layer_norm's backward v2 design: rows of at most
// 320 threads of 16 elements (2 packs of 16-bit, 4 of fp32) on a persistent grid of the blocks that stay resident. A
// thread's columns are the same in every row, so (w + w_offset) and its dw sums stay in fp32 registers for the whole
// kernel; a row's x (s) and dy are read once into registers, dx written once. v1 (norm_grads.cuh's RowPasses and
// ColAcc) loads w twice a row and sums dw in shared memory: at 8192x4096 bf16 layer_norm's v1 of that design ran at
// 0.43 of the DRAM peak where this one reached 0.59 (benchmarks/PERF_LOG.md).
// With r = rsqrt(mean(x^2) + eps) and g = dy * (w + w_offset): dx = r * (g - x * r^2 * mean(g * x)) (+ ds for
// fused_add_rms_norm, whose r is the forward's saved rstd and whose x is the saved sum s); dw partials: dy * x * r.
// With a ring (a block with more than one row, where two blocks an SM still fit): each thread copies its packs of the
// block's next two rows into shared memory (async_copy.cuh) while it works on this one, so the row's loads are in
// flight through the reductions and stores; without it a block's loads stop from a row's reduction to its next row.
#pragma once
#include "async_copy.cuh"
#include "line_rows.cuh"
#include "norm_grads.cuh"

namespace tiered_ops {

constexpr int kRmsBwdThreads = 320;  // a row of 5120 16-bit elements; 2 blocks an SM at <= 102 registers
constexpr int kRmsBwdRingStages = 2;  // rows a block has in flight ahead of the one it works on
constexpr size_t kRmsBwdRingMax = 100u << 10;  // ring bytes a block, at most: two blocks an SM

// Threads of the backward v2 for rows of n elements in packs of V (16 elements a thread, a multiple of 32); 0 where v2
// does not apply (rows of more than kRmsBwdThreads x 16 elements, or not a multiple of V).
inline int rms_bwd_v2_threads(int64_t n, int V) {
  const int k = 16 / V;
  const int64_t t = ((n / V + k - 1) / k + 31) / 32 * 32;
  return n % V != 0 || t > kRmsBwdThreads ? 0 : (int)t;
}

// The ring's bytes for rows of n elements on `threads` threads (kRmsBwdRingStages rows of x, dy and, with ADD, ds); 0
// where it would not leave two blocks an SM, and for fp32 with ADD (its three rows of 4 packs a thread spill at the
// 102 registers two blocks of 320 threads allow).
template <typename T, bool ADD>
constexpr bool kRmsBwdRing = !(ADD && sizeof(T) == 4);

template <typename T, bool ADD>
inline size_t rms_bwd_ring_bytes(int threads) {
  if constexpr (!kRmsBwdRing<T, ADD>) return 0;
  const size_t b = (size_t)kRmsBwdRingStages * (ADD ? 3 : 2) * (16 / Pack<T>::N) * threads * sizeof(Pack<T>);
  return b > kRmsBwdRingMax ? 0 : b;
}

// K = 16 / V packs a thread. ADD: fused_add_rms_norm (x is s, r is rstd_in[row], ds added to dx); else rms_norm (r
// from the row's sum of squares; ds and rstd_in unused). pw: the block's row of dw partials (null without a weight).
// RING: the rows come through the ring in dynamic shared memory (rms_bwd_ring_bytes).
template <typename T, int K, bool ADD, bool RING>
__global__ void __launch_bounds__(kRmsBwdThreads, 2) rms_bwd_v2_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ ds,
    const float* __restrict__ rstd_in, T* __restrict__ dx, float* __restrict__ pw, int64_t rows, int n, float eps,
    float w_offset) {
  constexpr int V = Pack<T>::N, NT = ADD ? 3 : 2;
  __shared__ float smem[64];
  extern __shared__ __align__(16) unsigned char ring_raw[];
  Pack<T>* const ring = reinterpret_cast<Pack<T>*>(ring_raw);
  const int nt = (int)blockDim.x, tid = (int)threadIdx.x;
  // Slot of tensor t (x, dy, ds), pack k of this thread, in stage st: only this thread writes and reads it.
  auto slot = [&](int st, int t, int k) { return ring + ((st * NT + t) * K + k) * nt + tid; };
  auto fetch = [&](int64_t r, int st) {  // row r's packs into stage st, one group (empty past the last row)
    if (r < rows) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = (k * nt + tid) * V;
        if (i < n) {
          async_copy16(slot(st, 0, k), x + r * n + i);
          async_copy16(slot(st, 1, k), dy + r * n + i);
          if constexpr (ADD) async_copy16(slot(st, 2, k), ds + r * n + i);
        }
      }
    }
    async_copy_commit();
  };
  if constexpr (RING) {
#pragma unroll
    for (int st = 0; st < kRmsBwdRingStages; ++st) fetch(blockIdx.x + (int64_t)st * gridDim.x, st);
  }
  float wv[K][V], aw[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = (k * (int)blockDim.x + (int)threadIdx.x) * V;
    load_or<T, V>(i < n ? w : nullptr, i, wv[k], 1.f);
#pragma unroll
    for (int j = 0; j < V; ++j) wv[k][j] = w ? wv[k][j] + w_offset : 1.f, aw[k][j] = 0.f;
  }
  int st = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const LineRow row{r * n, n};
    Pack<T> qx[K], qd[K], qe[K];  // raw; zero past the row's end, so they add nothing to the sums
    if constexpr (RING) {
      async_copy_wait<kRmsBwdRingStages - 1>();  // this row's group landed; the later rows' may be in flight
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const bool in = (k * nt + tid) * V < n;
        qx[k] = in ? *slot(st, 0, k) : Pack<T>{};
        qd[k] = in ? *slot(st, 1, k) : Pack<T>{};
        if constexpr (ADD) qe[k] = in ? *slot(st, 2, k) : Pack<T>{};
      }
      fetch(r + (int64_t)kRmsBwdRingStages * gridDim.x, st);  // the slots just read, for the row a ring ahead
      st = st + 1 == kRmsBwdRingStages ? 0 : st + 1;
    } else {
      row.load<K, V>(x, qx);
      row.load<K, V>(dy, qd);
      if constexpr (ADD) row.load<K, V>(ds, qe);
    }
    float rs = ADD ? rstd_in[r] : 0.f, ss = 0.f, gx = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = to_f(qx[k].v[j]);
        if constexpr (!ADD) ss += a * a;
        gx += to_f(qd[k].v[j]) * wv[k][j] * a;
      }
    }
    if constexpr (ADD) {
      gx = block_sum(gx, smem);
    } else {
      block_sum2(ss, gx, smem);
      rs = rsqrtf(ss / (float)n + eps);
    }
    const float c = gx * rs * rs / (float)n;
    row.each<K, V>([&](int k, int i) {
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = to_f(qx[k].v[j]), d = to_f(qd[k].v[j]);
        aw[k][j] += d * a * rs;
        o[j] = rs * (d * wv[k][j] - a * c);
        if constexpr (ADD) o[j] += to_f(qe[k].v[j]);
      }
      store_f<T, V>(dx, row.base + i, o);
    });
  }
  if (!pw) return;
  const LineRow mine{(int64_t)blockIdx.x * n, n};  // the block's row of the partials, in 16-byte stores
  mine.each<K, V>([&](int k, int i) {
#pragma unroll
    for (int j = 0; j < V; j += 4)
      *reinterpret_cast<float4*>(pw + mine.base + i + j) = make_float4(aw[k][j], aw[k][j + 1], aw[k][j + 2], aw[k][j + 3]);
  });
}

// rms_bwd_v2_kernel<T, K, ADD, true> allowed kRmsBwdRingMax bytes of dynamic shared memory where a ring of `ring` bytes
// and its static 256 go past the 48 KB a launch has without asking (norm_grads.cuh's allow_smem counts the dynamic
// bytes alone); always the most, so that a launch of a shorter row never lowers it under a longer one's.
template <typename T, bool ADD>
inline cudaError_t allow_ring(size_t ring) {
  if constexpr (!kRmsBwdRing<T, ADD>) return cudaSuccess;
  if (ring + 64 * sizeof(float) <= (48u << 10)) return cudaSuccess;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(rms_bwd_v2_kernel<T, 16 / Pack<T>::N, ADD, true>),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kRmsBwdRingMax);
}

// The grid of rms_bwd_v2_kernel<T, ADD> for rows of n (0 where v2 does not apply): the blocks that stay resident with
// the ring where it fits (without it where not), at most the rows (norm_grads.cuh's resident_blocks).
template <typename T, bool ADD>
inline int64_t rms_bwd_v2_grid(int64_t rows, int64_t n) {
  const int threads = rms_bwd_v2_threads(n, Pack<T>::N);
  if (!threads) return 0;
  constexpr int K = 16 / Pack<T>::N;
  if constexpr (kRmsBwdRing<T, ADD>) {
    const size_t ring = rms_bwd_ring_bytes<T, ADD>(threads);
    if (ring && allow_ring<T, ADD>(ring) == cudaSuccess)
      return resident_blocks(reinterpret_cast<const void*>(rms_bwd_v2_kernel<T, K, ADD, true>), threads, ring, rows);
    cudaGetLastError();  // the ring refused: the grid without it
  }
  return resident_blocks(reinterpret_cast<const void*>(rms_bwd_v2_kernel<T, K, ADD, false>), threads, 0, rows);
}

// rms_bwd_v2_kernel on `blocks` blocks (rms_bwd_v2_grid's; through the ring where a block has more than one row and it
// fits), then the partials' reduction into dw (with a weight).
template <typename T, bool ADD>
inline cudaError_t launch_rms_bwd_v2(const T* dy, const T* x, const T* w, const T* ds, const float* rstd_in, T* dx,
                                     float* dw_partial, T* dw, int64_t rows, int64_t n, float eps, int64_t blocks,
                                     float w_offset, cudaStream_t stream) {
  constexpr int K = 16 / Pack<T>::N;
  float* pw = w ? dw_partial : nullptr;
  const int threads = rms_bwd_v2_threads(n, Pack<T>::N);
  const size_t ring = rows > blocks ? rms_bwd_ring_bytes<T, ADD>(threads) : 0;
  if constexpr (kRmsBwdRing<T, ADD>) {
    if (ring) {
      const cudaError_t err = allow_ring<T, ADD>(ring);
      if (err != cudaSuccess) return err;
      rms_bwd_v2_kernel<T, K, ADD, true><<<(unsigned)blocks, threads, ring, stream>>>(dy, x, w, ds, rstd_in, dx, pw,
                                                                                     rows, (int)n, eps, w_offset);
    }
  }
  if (!ring) {
    rms_bwd_v2_kernel<T, K, ADD, false><<<(unsigned)blocks, threads, 0, stream>>>(dy, x, w, ds, rstd_in, dx, pw, rows,
                                                                                 (int)n, eps, w_offset);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || w == nullptr) return err;
  return launch_reduce_partials<T>(pw, nullptr, dw, nullptr, blocks, n, stream);
}

}  // namespace tiered_ops
