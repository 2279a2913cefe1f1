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

// One block's partial sums over its rows of a per-column value, for the columns its threads own (for_row_k's): with
// K > 0 packs a thread in shared memory (`sm`: K * V * blockDim floats, laid out so that a warp's threads touch
// consecutive words), with K == 0 in the block's partials row itself; each column read and written by the one thread
// that owns it (so in program order, no barrier). Registers would hold K * V floats a thread through the whole kernel:
// those would keep fewer blocks resident. A null row: nothing wanted, nothing done.
template <int K, int V>
struct ColAcc {
  float* row;
  float* sm;

  __device__ __forceinline__ float& at(int k, int j) const {
    return sm[((int64_t)j * K + k) * blockDim.x + threadIdx.x];
  }

  __device__ __forceinline__ void begin(float* partial_row, float* smem, int64_t n) {
    row = partial_row, sm = smem;
    if (!row) return;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) at(k, j) = 0.f;
    } else {
      for_row_k<0, V>(n, [&](int, int64_t i) {
#pragma unroll
        for (int j = 0; j < V; ++j) row[i + j] = 0.f;
      });
    }
  }

  __device__ __forceinline__ void add(int k, int64_t i, int j, float v) {
    if constexpr (K > 0) at(k, j) += v;
    else row[i + j] += v;
  }

  __device__ __forceinline__ void finish(int64_t n) {
    if constexpr (K > 0) {
      if (!row) return;
      for_row_k<K, V>(n, [&](int k, int64_t i) {
#pragma unroll
        for (int j = 0; j < V; ++j) row[i + j] = at(k, j);
      });
    }
  }
};

// Bytes of dynamic shared memory a dx kernel at K takes for `accs` column accumulators (ColAcc) of `threads` threads.
inline size_t bwd_smem(int k, int v, int threads, int accs) {
  return (size_t)accs * k * v * threads * sizeof(float);
}

// A kernel allowed `bytes` of dynamic shared memory (past the 48 KB a launch gets without asking).
inline cudaError_t allow_smem(const void* kernel, size_t bytes) {
  return bytes > (48u << 10) ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes)
                             : cudaSuccess;
}

// V elements of T as loaded (one 16-byte load when V is the pack width): 4 registers a pack whatever T is.
template <typename T, int V>
struct alignas(V > 1 ? 16 : alignof(T)) Raw {
  T v[V];
};

// The two passes of a backward over its row, reading x and dy (of types T and DY) at x_row and dy_row: first(n, ..., f)
// loads this thread's packs and calls f(i, xr, dr) on each (i: its first element) for the row's sums; then, after the
// caller's reductions, second(n, ..., f) calls f(k, i, xr, dr) on the same packs for dx (k counting them). With K > 0
// (the row in one pass of the block) the packs stay in registers as loaded between the passes: the row comes from
// memory once, and no load waits behind the reductions. With K == 0 the second pass loads them again (from L1/L2).
// The callers turn a pack into floats element by element, so that no pack is held as floats.
template <int K, int V, typename T, typename DY>
struct RowPasses {
  static constexpr int R = K > 0 ? K : 1;
  Raw<T, V> xr[R];
  Raw<DY, V> dr[R];

  template <typename F>
  __device__ __forceinline__ void first(int64_t n, const T* x_row, const DY* dy_row, F&& f) {
    for_row_k<K, V>(n, [&](int k, int64_t i) {
      xr[k] = *reinterpret_cast<const Raw<T, V>*>(x_row + i);
      dr[k] = *reinterpret_cast<const Raw<DY, V>*>(dy_row + i);
      f(i, xr[k], dr[k]);
    });
  }

  template <typename F>
  __device__ __forceinline__ void second(int64_t n, const T* x_row, const DY* dy_row, F&& f) {
    for_row_k<K, V>(n, [&](int k, int64_t i) {
      if constexpr (K == 0) {
        xr[0] = *reinterpret_cast<const Raw<T, V>*>(x_row + i);
        dr[0] = *reinterpret_cast<const Raw<DY, V>*>(dy_row + i);
      }
      f(k, i, xr[k], dr[k]);
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

// dw[j] = sum over g of pw[g, j] (db from pb alike; a null pair is skipped) in fp32, stored as TW. Block (32, 32): 32
// consecutive columns, 32 threads striding over the groups with four loads in flight each (a (32, 8) block waiting on
// one load at a time took 11-13 us for 264 x 4096 partials on the H200: 0.5-1 TB/s), combined in shared memory.
template <typename TW>
__global__ void __launch_bounds__(1024) reduce_partials_kernel(const float* __restrict__ pw,
                                                               const float* __restrict__ pb, TW* __restrict__ dw,
                                                               TW* __restrict__ db, int64_t groups, int64_t n) {
  __shared__ float sw[32][33], sb[32][33];
  const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float aw = 0.f, ab = 0.f;
  if (j < n) {
#pragma unroll 4
    for (int64_t g = threadIdx.y; g < groups; g += 32) {
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
    for (int y = 0; y < 32; ++y) tw += sw[y][threadIdx.x], tb += sb[y][threadIdx.x];
    if (dw) dw[j] = from_f<TW>(tw);
    if (db) db[j] = from_f<TW>(tb);
  }
}

template <typename TW>
inline cudaError_t launch_reduce_partials(const float* pw, const float* pb, TW* dw, TW* db, int64_t groups, int64_t n,
                                          cudaStream_t stream) {
  if (!dw && !db) return cudaSuccess;
  reduce_partials_kernel<TW><<<(unsigned)((n + 31) / 32), dim3(32, 32), 0, stream>>>(pw, pb, dw, db, groups, n);
  return cudaGetLastError();
}

// The backward's plan for rows of n elements in packs of vx: K packs a thread kept in registers (1 or 2: the row in
// one pass of at most 512 threads; 0: longer rows, looped over 1024 threads), and the threads, a multiple of 32 (a row
// of 640 packs, 5120 bf16 elements, takes 320 threads of 2 packs rather than 1024 threads, 384 of them idle).
struct NormBwdPlan {
  int k, threads;
};

inline NormBwdPlan norm_bwd_plan(int64_t n, int vx) {
  const int64_t packs = (n + vx - 1) / vx;
  auto warps = [](int64_t t) { return (int)((t + 31) / 32 * 32); };
  if (packs <= 512) return {1, warps(packs)};
  if (packs <= 1024) return {2, warps((packs + 1) / 2)};
  return {0, 1024};
}

// The dx kernels' launch bounds at K (norm_bwd_plan): one pack a thread leaves the registers for 3 blocks of 512 an SM
// (3 rows in flight; 2 at the 64 registers of a 1024-thread bound), two packs 2 blocks.
constexpr int bwd_max_threads(int K) { return K == 0 ? 1024 : 512; }
constexpr int bwd_min_blocks(int K) { return K == 1 ? 3 : K == 2 ? 2 : 1; }

// Launches go(std::integral_constant<int, VX>, std::integral_constant<int, K>, threads) for the backward's
// block-per-row kernel: VX = V (16-byte packs) when vec else 1, K and threads norm_bwd_plan's; the launch's error.
template <int V, typename F>
inline cudaError_t launch_norm_bwd(bool vec, int64_t n, F&& go) {
  auto at = [&](auto vx) {
    const NormBwdPlan p = norm_bwd_plan(n, decltype(vx)::value);
    if (p.k == 1) go(vx, std::integral_constant<int, 1>{}, p.threads);
    else if (p.k == 2) go(vx, std::integral_constant<int, 2>{}, p.threads);
    else go(vx, std::integral_constant<int, 0>{}, p.threads);
  };
  if (vec) at(std::integral_constant<int, V>{});
  else at(std::integral_constant<int, 1>{});
  return cudaGetLastError();
}

// Blocks of a backward's persistent grid for the dx kernel `kernel` at `threads` threads a block and `smem` bytes of
// dynamic shared memory: as many as stay resident on every SM at once (what its registers allow; a grid past that
// runs a second wave), at most one per 8 rows beyond a block an SM, never more than the rows. The occupancy and the
// SM count are read once per kernel, block size, shared memory and device (the host pays for every call of a
// training step).
inline int64_t resident_blocks(const void* kernel, int threads, size_t smem, int64_t rows) {
  struct Seen {
    const void* kernel;
    int threads, dev, per_sm, sms;
    size_t smem;
  };
  static std::mutex mu;
  static Seen seen[256];
  static int count = 0;
  int dev = 0, per_sm = 0, sms = 0;
  cudaGetDevice(&dev);
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < count && !per_sm; ++i)
      if (seen[i].kernel == kernel && seen[i].threads == threads && seen[i].smem == smem && seen[i].dev == dev)
        per_sm = seen[i].per_sm, sms = seen[i].sms;
  }
  if (!per_sm) {
    if (allow_smem(kernel, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess || per_sm < 1) {
      cudaGetLastError();  // the launch reports a kernel that cannot run; one block an SM here
      per_sm = 1;
    }
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const std::lock_guard<std::mutex> lock(mu);
    if (count < 256) seen[count++] = {kernel, threads, dev, per_sm, sms, smem};
  }
  // Every block writes a row of partial sums that the reduction reads back: at least 8 rows a block, where that still
  // leaves a block an SM (8192 rows of 768 at 17 blocks an SM: 2244 partials rows, 37 % more bytes than the rows).
  const int64_t resident = (int64_t)sms * per_sm, by_rows = (rows + 7) / 8 > sms ? (rows + 7) / 8 : sms;
  const int64_t want = resident < by_rows ? resident : by_rows;
  return rows < want ? rows : want;
}

// The grid (resident_blocks) of the dx kernel that launch_norm_bwd launches for rows of n (16-byte packs where n is a
// multiple of V; a call whose pointers turn out misaligned runs the one-element kernel on this grid): kernel_of(vx, kx)
// gives the kernel at those template arguments; `accs`: its column accumulators (bwd_smem).
template <int V, typename F>
inline int64_t norm_bwd_grid(int64_t rows, int64_t n, int accs, F&& kernel_of) {
  int64_t blocks = 1;
  launch_norm_bwd<V>(n % V == 0, n, [&](auto vx, auto kx, int threads) {
    constexpr int VX = decltype(vx)::value, KX = decltype(kx)::value;
    blocks = resident_blocks(reinterpret_cast<const void*>(kernel_of(vx, kx)), threads,
                             bwd_smem(KX, VX, threads, accs), rows);
  });
  return blocks;
}

}  // namespace tiered_ops
