// layer_norm's backward v2: rows of at most 256 threads of 16 elements (2 packs of 16-bit, 4 of fp32) on a persistent
// grid of the blocks that stay resident. A thread's columns are the same in every row, so w and its dw/db sums stay in
// fp32 registers for the whole kernel (no weight load and no shared-memory accumulator a row), x and dy read once a
// row. With xhat = (x - mean) * rstd and g = dy * w: dx = rstd * (g - xhat * mean(g * xhat) - mean(g)).
// With a ring (16-bit rows, a block with more than one row): each thread copies its packs of x and dy of the block's
// next two rows into shared memory (async_copy.cuh) while it works on this one, so its loads stay in flight through
// the row's reductions and stores (the rms norms' backward design, rms_grads.cuh). At 8192x4096 bf16 on the H200 the
// ring took the dx kernel and the reduction from 0.675 to 0.770 of a device copy's rate, the same bits of dx, dw and
// db; for fp32 rows it was no faster (benchmarks/PERF_LOG.md).
#pragma once
#include "async_copy.cuh"
#include "line_rows.cuh"
#include "norm_grads.cuh"

namespace tiered_ops {

constexpr int kLnBwdRingStages = 2;  // rows a block has in flight ahead of the one it works on

// Packs a thread of the backward's v2 for rows of n elements in packs of V (16 elements a thread), and its threads (a
// multiple of 32, at most 256: its 116-125 registers keep 2 such blocks an SM, where 320 threads keep 1 and 96 registers
// spill); 0 where v2 does not apply (rows of more than 4096 elements, or not a multiple of V).
struct LnBwdPlan {
  int k, threads;
};
inline LnBwdPlan ln_bwd_v2_plan(int64_t n, int V) {
  const int k = 16 / V;
  const int64_t t = ((n / V + k - 1) / k + 31) / 32 * 32;
  if (n % V != 0 || t > 256) return {0, 0};
  return {k, (int)t};
}

// The ring's bytes for rows on `threads` threads (kLnBwdRingStages rows of x and dy); 0 for fp32 rows (no ring). At
// most 2 x 2 x 2 packs x 256 threads x 16 bytes = 32 KB: two blocks an SM, no attribute to ask for.
template <typename T>
constexpr size_t ln_bwd_ring_bytes(int threads) {
  return sizeof(T) == 2 ? (size_t)kLnBwdRingStages * 2 * (16 / Pack<T>::N) * threads * sizeof(Pack<T>) : 0;
}

// RING: the rows come through the ring in dynamic shared memory (ln_bwd_ring_bytes).
template <typename T, int K, bool RING>
__global__ void __launch_bounds__(256, 2) layer_norm_bwd_v2_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                   const T* __restrict__ w,
                                                                   const float* __restrict__ mean,
                                                                   const float* __restrict__ rstd,
                                                                   T* __restrict__ dx, float* pw, float* pb,
                                                                   int64_t rows, int n) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[64];
  extern __shared__ __align__(16) unsigned char ring_raw[];
  Pack<T>* const ring = reinterpret_cast<Pack<T>*>(ring_raw);
  const int nt = (int)blockDim.x, tid = (int)threadIdx.x;
  // Slot of tensor t (x, dy), pack k of this thread, in stage st: only this thread writes and reads it.
  auto slot = [&](int st, int t, int k) { return ring + ((st * 2 + t) * K + k) * nt + tid; };
  auto fetch = [&](int64_t r, int st) {  // row r's packs into stage st, one group (empty past the last row)
    if (r < rows) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = (k * nt + tid) * V;
        if (i < n) {
          async_copy16(slot(st, 0, k), x + r * n + i);
          async_copy16(slot(st, 1, k), dy + r * n + i);
        }
      }
    }
    async_copy_commit();
  };
  if constexpr (RING) {
#pragma unroll
    for (int st = 0; st < kLnBwdRingStages; ++st) fetch(blockIdx.x + (int64_t)st * gridDim.x, st);
  }
  float wv[K][V], aw[K][V], ab[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = (k * nt + tid) * V;
    load_or<T, V>(i < n ? w : nullptr, i, wv[k], 1.f);
#pragma unroll
    for (int j = 0; j < V; ++j) aw[k][j] = 0.f, ab[k][j] = 0.f;
  }
  int st = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const LineRow row{r * n, n};
    const float mu = mean[r], rs = rstd[r];
    Pack<T> qx[K], qd[K];  // raw; zero past the row's end, so they add nothing to the sums
    if constexpr (RING) {
      async_copy_wait<kLnBwdRingStages - 1>();  // this row's group landed; the later rows' may be in flight
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const bool in = (k * nt + tid) * V < n;
        qx[k] = in ? *slot(st, 0, k) : Pack<T>{};
        qd[k] = in ? *slot(st, 1, k) : Pack<T>{};
      }
      fetch(r + (int64_t)kLnBwdRingStages * gridDim.x, st);  // the slots just read, for the row a ring ahead
      st = st + 1 == kLnBwdRingStages ? 0 : st + 1;
    } else {
      row.load<K, V>(x, qx);
      row.load<K, V>(dy, qd);
    }
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float g = to_f(qd[k].v[j]) * wv[k][j];
        s1 += g * (to_f(qx[k].v[j]) - mu) * rs, s2 += g;
      }
    }
    block_sum2(s1, s2, smem);
    const float c1 = s1 / (float)n, c2 = s2 / (float)n;
    row.each<K, V>([&](int k, int i) {
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = (to_f(qx[k].v[j]) - mu) * rs, d = to_f(qd[k].v[j]);
        aw[k][j] += d * a, ab[k][j] += d;
        o[j] = rs * (d * wv[k][j] - a * c1 - c2);  // n >= V here: never the n == 1 row
      }
      store_f<T, V>(dx, row.base + i, o);
    });
  }
  const LineRow mine{(int64_t)blockIdx.x * n, n};  // the block's row of the partials, V floats a pack in 16-byte stores
  auto put = [](float* p, const float (&v)[V]) {
#pragma unroll
    for (int j = 0; j < V; j += 4) *reinterpret_cast<float4*>(p + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
  };
  mine.each<K, V>([&](int k, int i) {
    if (pw) put(pw + mine.base + i, aw[k]);
    if (pb) put(pb + mine.base + i, ab[k]);
  });
}

// The grid of the backward v2 for rows of n (0 where v2 does not apply): the blocks that stay resident with the ring
// where the rows have one (without it where not), at most the rows (norm_grads.cuh's resident_blocks).
template <typename T>
inline int64_t ln_bwd_v2_grid(int64_t rows, int64_t n) {
  constexpr int K = 16 / Pack<T>::N;
  const LnBwdPlan p = ln_bwd_v2_plan(n, Pack<T>::N);
  if (!p.k) return 0;
  const size_t ring = ln_bwd_ring_bytes<T>(p.threads);
  const void* kernel = ring ? reinterpret_cast<const void*>(layer_norm_bwd_v2_kernel<T, K, true>)
                            : reinterpret_cast<const void*>(layer_norm_bwd_v2_kernel<T, K, false>);
  return resident_blocks(kernel, p.threads, ring, rows);
}

// The backward v2 on `blocks` blocks (ln_bwd_v2_grid's; through the ring where a block has more than one row and the
// rows have one), writing the dw/db partials (each may be null); their reduction follows.
template <typename T>
inline cudaError_t launch_ln_bwd_v2(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, T* dx,
                                    float* pw, float* pb, int64_t rows, int64_t n, int64_t blocks,
                                    cudaStream_t stream) {
  constexpr int K = 16 / Pack<T>::N;
  const int threads = ln_bwd_v2_plan(n, Pack<T>::N).threads;
  const size_t ring = rows > blocks ? ln_bwd_ring_bytes<T>(threads) : 0;
  if (ring) {
    layer_norm_bwd_v2_kernel<T, K, true><<<(unsigned)blocks, threads, ring, stream>>>(dy, x, w, mean, rstd, dx, pw, pb,
                                                                                      rows, (int)n);
  } else {
    layer_norm_bwd_v2_kernel<T, K, false><<<(unsigned)blocks, threads, 0, stream>>>(dy, x, w, mean, rstd, dx, pw, pb,
                                                                                    rows, (int)n);
  }
  return cudaGetLastError();
}

}  // namespace tiered_ops
