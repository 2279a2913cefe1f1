// The weight/bias gradients of the normalizations' backward (rms_norm, layer_norm, fused_add_rms_norm) in two launches
// with dx: the block-per-row dx kernel runs on a persistent grid (norm_bwd_grid: the blocks that stay resident), each block summing
// its rows' dy * xhat (and dy) for the columns its threads own into one row of (blocks, n) fp32 partials; then
// reduce_partials_kernel sums the partials over the blocks in fp32 and writes dw (db) in the parameter's type.
// Bytes: the partials, blocks * n * 4 written once and read once (x and dy are not read again).
#pragma once
#include <mutex>
#include <type_traits>

#include "common.cuh"

namespace tiered_ops {

// f(k, i) for this thread's packs of V elements in a row of n, k counting them: with K > 0 the row has at most K
// packs a thread (k a compile-time index, so that a register accumulator is indexed statically), with K == 0 any n.
template <int K, int V, typename F>
__device__ __forceinline__ void for_row_k(int64_t n, F&& f) {
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t i = ((int64_t)k * blockDim.x + threadIdx.x) * V;
      if (i < n) f(k, i);
    }
  } else {
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) f(0, i);
  }
}

// One block's partial sums over its rows of a per-column value, for the columns its threads own (for_row_k's): in
// registers (K > 0 packs a thread), or with K == 0 in the block's partials row itself, read and written by the one
// thread that owns each column (so in program order, no barrier). A null row: nothing wanted, nothing done.
template <int K, int V>
struct ColAcc {
  float a[K > 0 ? K : 1][V];
  float* row;

  __device__ __forceinline__ void begin(float* partial_row, int64_t n) {
    row = partial_row;
    if (!row) return;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) a[k][j] = 0.f;
    } else {
      for_row_k<0, V>(n, [&](int, int64_t i) {
#pragma unroll
        for (int j = 0; j < V; ++j) row[i + j] = 0.f;
      });
    }
  }

  __device__ __forceinline__ void add(int k, int64_t i, int j, float v) {
    if constexpr (K > 0) a[k][j] += v;
    else row[i + j] += v;
  }

  __device__ __forceinline__ void finish(int64_t n) {
    if constexpr (K > 0) {
      if (!row) return;
      for_row_k<K, V>(n, [&](int k, int64_t i) {
#pragma unroll
        for (int j = 0; j < V; ++j) row[i + j] = a[k][j];
      });
    }
  }
};

// V elements of T as loaded (one 16-byte load when V is the pack width): 4 registers a pack whatever T is.
template <typename T, int V>
struct alignas(V > 1 ? 16 : alignof(T)) Raw {
  T v[V];
};

// The two passes of a backward over its row, reading x and dy (of types T and DY) at x_row and dy_row: first(n, ...,
// expand, f) loads this thread's packs, turns each into floats with `expand(i, xr, dr, a, d, g)` (the input, dy, and
// dy times the weight) and calls f(a, d, g) for the row's sums; then, after the caller's reductions, second(n, ...,
// expand, f) calls f(k, i, a, d, g) on the same packs for dx. With K > 0 (the row in one pass of the block) the packs
// stay in registers as loaded between the passes: the row comes from memory once, and no load waits behind the
// reductions. With K == 0 the second pass loads them again (from L1/L2).
template <int K, int V, typename T, typename DY>
struct RowPasses {
  static constexpr int R = K > 0 ? K : 1;
  Raw<T, V> xr[R];
  Raw<DY, V> dr[R];

  template <typename E, typename F>
  __device__ __forceinline__ void first(int64_t n, const T* x_row, const DY* dy_row, E&& expand, F&& f) {
    for_row_k<K, V>(n, [&](int k, int64_t i) {
      xr[k] = *reinterpret_cast<const Raw<T, V>*>(x_row + i);
      dr[k] = *reinterpret_cast<const Raw<DY, V>*>(dy_row + i);
      float a[V], d[V], g[V];
      expand(i, xr[k], dr[k], a, d, g);
      f(a, d, g);
    });
  }

  template <typename E, typename F>
  __device__ __forceinline__ void second(int64_t n, const T* x_row, const DY* dy_row, E&& expand, F&& f) {
    for_row_k<K, V>(n, [&](int k, int64_t i) {
      if constexpr (K == 0) {
        xr[0] = *reinterpret_cast<const Raw<T, V>*>(x_row + i);
        dr[0] = *reinterpret_cast<const Raw<DY, V>*>(dy_row + i);
      }
      float a[V], d[V], g[V];
      expand(i, xr[k], dr[k], a, d, g);
      f(k, i, a, d, g);
    });
  }
};

// Two sums over the block at once (one pair of barriers); every thread gets both. `smem` holds at least 64 floats.
__device__ __forceinline__ void block_sum2(float& u, float& v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  u = warp_sum(u);
  v = warp_sum(v);
  __syncthreads();  // smem may still be read from a previous reduction
  if (lane == 0) smem[warp] = u, smem[32 + warp] = v;
  __syncthreads();
  u = warp_sum(lane < nwarps ? smem[lane] : 0.f);
  v = warp_sum(lane < nwarps ? smem[32 + lane] : 0.f);
}

// dw[j] = sum over g of pw[g, j] (db from pb alike; a null pair is skipped) in fp32, stored as TW. Block (32, 8): 32
// consecutive columns, 8 threads striding over the groups, combined in shared memory.
template <typename TW>
__global__ void __launch_bounds__(256) reduce_partials_kernel(const float* __restrict__ pw,
                                                              const float* __restrict__ pb, TW* __restrict__ dw,
                                                              TW* __restrict__ db, int64_t groups, int64_t n) {
  __shared__ float sw[8][33], sb[8][33];
  const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float aw = 0.f, ab = 0.f;
  if (j < n) {
    for (int64_t g = threadIdx.y; g < groups; g += 8) {
      if (pw) aw += pw[g * n + j];
      if (pb) ab += pb[g * n + j];
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && j < n) {
    float tw = 0.f, tb = 0.f;
#pragma unroll
    for (int y = 0; y < 8; ++y) tw += sw[y][threadIdx.x], tb += sb[y][threadIdx.x];
    if (dw) dw[j] = from_f<TW>(tw);
    if (db) db[j] = from_f<TW>(tb);
  }
}

template <typename TW>
inline cudaError_t launch_reduce_partials(const float* pw, const float* pb, TW* dw, TW* db, int64_t groups, int64_t n,
                                          cudaStream_t stream) {
  if (!dw && !db) return cudaSuccess;
  reduce_partials_kernel<TW><<<(unsigned)((n + 31) / 32), dim3(32, 8), 0, stream>>>(pw, pb, dw, db, groups, n);
  return cudaGetLastError();
}

// Launches go(std::integral_constant<int, VX>, std::integral_constant<int, K>) for the backward's block-per-row
// kernel: VX = V (16-byte packs) when vec else 1, K = 1 when a row fits one pass of the block (the partial sums in
// registers), else 0 (in the partials row); the launch's error.
template <int V, typename F>
inline cudaError_t launch_norm_bwd(bool vec, int64_t n, F&& go) {
  const int vx = vec ? V : 1;
  const bool one_pass = n <= (int64_t)row_threads(n, vx) * vx;
  if (vec) {
    if (one_pass) go(std::integral_constant<int, V>{}, std::integral_constant<int, 1>{});
    else go(std::integral_constant<int, V>{}, std::integral_constant<int, 0>{});
  } else {
    if (one_pass) go(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{});
    else go(std::integral_constant<int, 1>{}, std::integral_constant<int, 0>{});
  }
  return cudaGetLastError();
}

// Blocks of a backward's persistent grid for the dx kernel `kernel` at `threads` threads a block: as many as stay
// resident on every SM at once (what its registers allow; a grid past that runs a second wave, and every block adds a
// partials row to reduce), never more than the rows. The occupancy is read once per kernel, block size and device.
inline int64_t resident_blocks(const void* kernel, int threads, int64_t rows) {
  struct Seen {
    const void* kernel;
    int threads, dev, per_sm;
  };
  static std::mutex mu;
  static Seen seen[256];
  static int count = 0;
  int dev = 0, per_sm = 0, sms = 0;
  cudaGetDevice(&dev);
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < count && !per_sm; ++i)
      if (seen[i].kernel == kernel && seen[i].threads == threads && seen[i].dev == dev) per_sm = seen[i].per_sm;
  }
  if (!per_sm) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess || per_sm < 1) {
      cudaGetLastError();  // the launch reports a kernel that cannot run; one block an SM here
      per_sm = 1;
    }
    const std::lock_guard<std::mutex> lock(mu);
    if (count < 256) seen[count++] = {kernel, threads, dev, per_sm};
  }
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t want = (int64_t)sms * per_sm;
  return rows < want ? rows : want;
}

// The grid (resident_blocks) of the dx kernel that launch_norm_bwd launches for rows of n (16-byte packs where n is a
// multiple of V; a call whose pointers turn out misaligned runs the one-element kernel on this grid): kernel_of(vx, kx)
// gives the kernel at those template arguments.
template <int V, typename F>
inline int64_t norm_bwd_grid(int64_t rows, int64_t n, F&& kernel_of) {
  int64_t blocks = 1;
  launch_norm_bwd<V>(n % V == 0, n, [&](auto vx, auto kx) {
    blocks = resident_blocks(reinterpret_cast<const void*>(kernel_of(vx, kx)), row_threads(n, decltype(vx)::value),
                             rows);
  });
  return blocks;
}

}  // namespace tiered_ops
