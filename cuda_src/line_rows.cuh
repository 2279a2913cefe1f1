// Straight-line rows (the newest forward kernels of rms_norm and layer_norm): a row a block, each thread P 16-byte packs
// of it converted to fp32 as loaded, no loop over rows. Why straight: a loop over rows (common.cuh's for_reg_rows) keeps
// 64-bit row state and raw packs live across the row, 61-64 registers for 4 packs of bf16 and so 8 blocks of 128
// threads an SM; written straight, 2 packs a thread take 31 registers, 8 blocks of 256 threads an SM
// (scripts/diag/norm_fwd_lines.py times both, beside the Triton tier and a device copy).
// Rows of a multiple of the pack width, 16-byte aligned, of more than 128 packs (shorter rows share blocks: common.cuh).
#pragma once
#include <climits>

#include "common.cuh"

namespace tiered_ops {

// The row of this block as one of its threads sees it: its first element and its length.
struct LineRow {
  int64_t base;
  int n;

  __device__ __forceinline__ static LineRow of_block(int n) { return {(int64_t)blockIdx.x * n, n}; }

  // f(p, i) for each of the thread's P packs of V elements that lies in the row (i: the pack's first element).
  template <int P, int V, typename F>
  __device__ __forceinline__ void each(F&& f) const {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * (int)blockDim.x + (int)threadIdx.x) * V;
      if (i < n) f(p, i);
    }
  }

  // The thread's packs of the row at x as loaded (raw) into q, zero past the row's end.
  template <int P, int V, typename T>
  __device__ __forceinline__ void load(const T* __restrict__ x, Pack<T> (&q)[P]) const {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * (int)blockDim.x + (int)threadIdx.x) * V;
      q[p] = i < n ? load_pack(x + base + i) : Pack<T>{};
    }
  }

  // The thread's packs of the row at x as floats into a, 0 past the row's end.
  template <int P, int V, typename T>
  __device__ __forceinline__ void load(const T* __restrict__ x, float (&a)[P][V]) const {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = (p * (int)blockDim.x + (int)threadIdx.x) * V;
      if (i < n) {
        load_f<T, V>(x + base, i, a[p]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) a[p][j] = 0.f;
      }
    }
  }
};

// V elements of T at p + i as floats (load_f), or `none` in each where p is null.
template <typename T, int V>
__device__ __forceinline__ void load_or(const T* __restrict__ p, int i, float (&v)[V], float none) {
  if (p) {
    load_f<T, V>(p, i, v);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = none;
  }
}

// The launch bound's blocks of 1024 threads an SM: 2 (32 registers, the whole SM's threads) for 16-bit rows of 2 packs
// a thread (their raw packs take 8 registers); 1 (up to 64) otherwise, where 32 would spill.
constexpr int line_min_blocks(int P, int V) { return V == 8 && P <= 2 ? 2 : 1; }

struct LineConfig {
  int packs = 0;    // P: packs a thread (0: not a straight-line row)
  int threads = 0;  // a multiple of 32, at most 1024
};

// P and the threads for rows of n elements in packs of V: 16 elements a thread (2 packs of 16-bit, 4 of fp32), doubled
// while a row would take more than 512 threads, at most common.cuh's max_packs; none for rows of at most 128 packs,
// unaligned rows, more rows than a grid holds, or rows that would need more than 1024 threads.
inline LineConfig line_config(int64_t rows, int64_t n, int V, bool aligned) {
  LineConfig c;
  if (!aligned || n % V != 0 || rows > INT_MAX) return c;
  const int64_t packs = n / V;
  if (packs <= 128) return c;
  int p = 16 / V;
  while (p < max_packs(V) && (packs + p - 1) / p > 512) p *= 2;
  const int64_t t = ((packs + p - 1) / p + 31) / 32 * 32;
  if (t > 1024) return c;
  c.packs = p, c.threads = (int)t;
  return c;
}

}  // namespace tiered_ops
