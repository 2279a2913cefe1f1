// Shared device helpers for the tiered_ops CUDA kernels. Plain CUDA: no torch headers, so every
// kernel file compiles with a bare `nvcc -c` (CI does that on a machine without a GPU).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "launchers.h"

namespace tiered_ops {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 16 bytes of T: the widest load one thread issues.
template <typename T> struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// V elements of T at p + i as floats: one 16-byte load when V is the pack width, else one element.
template <typename T, int V>
__device__ __forceinline__ void load_f(const T* __restrict__ p, int64_t i, float (&v)[V]) {
  if constexpr (V > 1) {
    static_assert(V == Pack<T>::N, "V is 1 or the pack width");
    const Pack<T> q = *reinterpret_cast<const Pack<T>*>(p + i);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = to_f(q.v[j]);
  } else {
    v[0] = to_f(p[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_f(T* __restrict__ p, int64_t i, const float (&v)[V]) {
  if constexpr (V > 1) {
    Pack<T> q;
#pragma unroll
    for (int j = 0; j < V; ++j) q.v[j] = from_f<T>(v[j]);
    *reinterpret_cast<Pack<T>*>(p + i) = q;
  } else {
    p[i] = from_f<T>(v[0]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `smem` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // smem may still be read from a previous reduction
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : -INFINITY;
  return warp_max(v);
}

// ---- register-resident rows (the v2 kernels of softmax, rms_norm, layer_norm) ----
// A row of n elements (n a multiple of the pack width V, every row 16-byte aligned) is held by `tpr` threads
// (a power of two), P raw 16-byte packs each, in registers (4 registers a pack whatever the dtype, converted to
// fp32 where used): the row is read once and written once. Rows of at most 32 lanes are reduced with shuffles
// inside their group (several rows per block); longer ones get a block each. At most 8 packs per thread: rows
// up to 1024 * 8 * 4 = 32768 fp32 elements; 16-bit rows stop at 4 packs (also 32768 elements): their 8-pack
// kernels spill at the 64 registers of a 1024-thread block.
constexpr int kMaxRowPacks = 8;
constexpr int max_packs(int V) { return V == 4 ? kMaxRowPacks : kMaxRowPacks / 2; }

// Sum / max over the `tpr` threads of a row: shuffles when tpr <= 32 (every lane of the warp takes part), else a
// block reduction (the block is one row).
__device__ __forceinline__ float group_sum(float v, int tpr, float* smem) {
  if (tpr > 32) return block_sum(v, smem);
  for (int o = tpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float group_max(float v, int tpr, float* smem) {
  if (tpr > 32) return block_max(v, smem);
  for (int o = tpr >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One row of a register-resident kernel as one of its `tpr` threads sees it: row r (live: r < rows; a dead row's
// threads still take part in the reductions), the thread's lane in the row, and the row's length n.
struct RegRow {
  int64_t r;
  bool live;
  int lane, tpr, n;

  // f(p, i) for each of the thread's P packs of V elements that lies in the row (i: the pack's first element).
  template <int P, int V, typename F>
  __device__ __forceinline__ void each(F&& f) const {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * tpr + lane) * V;
      if (live && i < n) f(p, i);
    }
  }

  // Reads the thread's packs of the row at xr into q (raw), calling f(v) on each element v as a float.
  template <int P, int V, typename T, typename F>
  __device__ __forceinline__ void load(const T* __restrict__ xr, Pack<T> (&q)[P], F&& f) const {
    each<P, V>([&](int p, int i) {
      q[p] = *reinterpret_cast<const Pack<T>*>(xr + i);
#pragma unroll
      for (int j = 0; j < V; ++j) f(to_f(q[p].v[j]));
    });
  }
};

// f(row) for the rows of this block, `tpr` threads a row, the grid striding over the rows. Every thread of the block
// runs the same iterations (the reductions need all of them); rows past the end are not live.
template <typename F>
__device__ __forceinline__ void for_reg_rows(int64_t rows, int n, int tpr, F&& f) {
  const int lane = threadIdx.x & (tpr - 1), rpb = blockDim.x / tpr;
  for (int64_t base = (int64_t)blockIdx.x * rpb; base < rows; base += (int64_t)gridDim.x * rpb) {
    const int64_t r = base + threadIdx.x / tpr;
    f(RegRow{r, r < rows, lane, tpr, n});
  }
}

// The raw pack of T at p (16-byte aligned).
template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) { return *reinterpret_cast<const Pack<T>*>(p); }

// ---- block-per-row kernels (the v1 kernels) ----
// f(r) for the rows of this block: one block per row, the grid striding over the rows.
template <typename F>
__device__ __forceinline__ void for_block_rows(int64_t rows, F&& f) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) f(r);
}

// f(i) for this thread's packs of V elements in a row of n: the block strides over the row, V elements a thread.
template <int V, typename F>
__device__ __forceinline__ void for_row(int64_t n, F&& f) {
  for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += (int64_t)blockDim.x * V) f(i);
}

// rms_norm's output value before its rounding to the output type, v = x * r in fp32 and wv = w in fp32 (rms_norm and
// fused_add_rms_norm): cast rounds v to T first (Llama), w_offset adds to the weight (Gemma).
template <typename T>
__device__ __forceinline__ float rms_weighted(float v, bool has_w, float wv, float w_offset, bool cast) {
  if (cast) v = to_f(from_f<T>(v));
  return has_w ? v * (w_offset != 0.f ? wv + w_offset : wv) : v;
}

struct RowsConfig {
  int packs = 0;    // P: packs per thread (0: the row does not fit, use v1)
  int tpr = 0;      // threads per row
  int threads = 0;  // threads per block (rows per block = threads / tpr)
  unsigned blocks = 0;
};

// P and tpr for rows of n elements of a V-wide pack: the fewest packs per thread that keep a row within 128
// threads, then the threads that cover the row (up to 1024).
inline RowsConfig rows_config(int64_t rows, int64_t n, int V, bool aligned) {
  RowsConfig c;
  if (!aligned || n % V != 0 || n > (int64_t)1024 * max_packs(V) * V) return c;
  const int64_t packs = n / V;
  int p = 1;
  while (p < max_packs(V) && (packs + p - 1) / p > 128) p *= 2;
  int t = 1;
  while (t < (packs + p - 1) / p) t *= 2;
  if (t > 1024) return c;
  // Rows of more than a warp are reduced over the whole block: one row per block. Shorter rows share a block.
  c.packs = p, c.tpr = t, c.threads = t > 32 ? t : 128;
  const int64_t rpb = c.threads / t, want = (rows + rpb - 1) / rpb;
  c.blocks = (unsigned)(want < 65535 * 32 ? want : 65535 * 32);
  return c;
}

// Threads per block for a row of n elements moved in packs of `vec`: enough warps to cover the row
// once, at most 1024.
inline int row_threads(int64_t n, int vec) {
  int64_t want = (n + vec - 1) / vec;
  int t = 32;
  while (t < want && t < 1024) t *= 2;
  return t;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Rows per launch grid: enough blocks to fill the GPU, each block strides over rows.
inline unsigned grid_rows(int64_t rows) { return (unsigned)(rows < 65535 * 32 ? rows : 65535 * 32); }

// Launches the block-per-row kernel `vec_k` (16-byte packs) when vec, else `one_k` (one element at a time), over
// `rows` rows with threads enough for `n` elements a row; the launch's error.
template <typename... K, typename... A>
inline cudaError_t launch_block_rows(bool vec, int V, void (*vec_k)(K...), void (*one_k)(K...), int64_t rows,
                                     int64_t n, cudaStream_t stream, A... args) {
  (vec ? vec_k : one_k)<<<grid_rows(rows), row_threads(n, vec ? V : 1), 0, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace tiered_ops

// Runs the statement with `constexpr int P` set to the config's packs per thread (1, 2, 4, or 8 where the pack
// width V allows it); use inside a function templated on the element type, so that a discarded case is never
// instantiated.
#define TIERED_OPS_WITH_PACKS(packs, V, P, ...)                                                   \
  switch (packs) {                                                                              \
    case 1: { constexpr int P = 1; __VA_ARGS__; } break;                                        \
    case 2: { constexpr int P = 2; __VA_ARGS__; } break;                                        \
    case 4: { constexpr int P = 4; __VA_ARGS__; } break;                                        \
    case 8: if constexpr (::tiered_ops::max_packs(V) >= 8) { constexpr int P = 8; __VA_ARGS__; } break; \
    default: return cudaErrorInvalidValue;                                                      \
  }

#define TIERED_OPS_DISPATCH(dtype, T, ...)                                 \
  switch (dtype) {                                                         \
    case ::tiered_ops::DType::F32: { using T = float; __VA_ARGS__; break; } \
    case ::tiered_ops::DType::F16: { using T = __half; __VA_ARGS__; break; } \
    case ::tiered_ops::DType::BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;                                 \
  }
