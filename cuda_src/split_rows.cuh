// Rows too long for one block, split over blocks (aligned rows of a multiple of 16 bytes): pieces of kSplitThreads x
// kSplitPacks packs, one a block. Launch 1 (split_stats_kernel) writes each piece's exact mean and centred sum of
// squares; launch 2 (split_merge_kernel, a block a row) merges a row's pieces (Chan's formula) into its mean and rstd,
// so that the caller's last launch, which normalizes each piece, reads two floats a row instead of merging the row's
// pieces in every one of its blocks (layer_norm over (64, 256, 256) fp32: 512 pieces a row, each merged 512 times).
// Bytes: x read by launch 1 and again by the caller's last launch (from L2 for the pieces read last).
#pragma once
#include "common.cuh"

namespace tiered_ops {

constexpr int kSplitThreads = 512, kSplitPacks = 4;  // a piece: kSplitThreads * kSplitPacks packs
constexpr int kSplitPiece = kSplitThreads * kSplitPacks;

// (count, mean, centred sum of squares) of two disjoint parts, merged (Chan et al.).
__device__ __forceinline__ float3 chan_merge(float3 a, float3 b) {
  const float n = a.x + b.x;
  if (n == 0.f) return a;
  const float d = b.y - a.y, fb = b.x / n;
  return make_float3(n, a.y + d * fb, a.z + b.z + d * d * a.x * fb);
}

__device__ __forceinline__ float3 shfl_merge(float3 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = chan_merge(v, make_float3(__shfl_xor_sync(0xffffffffu, v.x, o), __shfl_xor_sync(0xffffffffu, v.y, o),
                                  __shfl_xor_sync(0xffffffffu, v.z, o)));
  return v;
}

__device__ __forceinline__ float3 block_merge(float3 v, float3* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = shfl_merge(v);
  __syncthreads();  // smem may still be read from a previous merge
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  return shfl_merge(lane < nwarps ? smem[lane] : make_float3(0.f, 0.f, 0.f));
}

// The piece `k` (row k / pieces) of the rows as this thread's packs in registers; returns the packs it holds.
template <typename T>
__device__ __forceinline__ int load_piece(const T* __restrict__ x, int64_t n, int64_t k, int pieces,
                                          Pack<T> (&q)[kSplitPacks]) {
  const int64_t r = k / pieces, first = (k % pieces) * kSplitPiece, npacks = n / Pack<T>::N;
  const int cnt = (int)min((int64_t)kSplitPiece, npacks - first);
  const Pack<T>* xr = reinterpret_cast<const Pack<T>*>(x + r * n) + first;
#pragma unroll
  for (int p = 0; p < kSplitPacks; ++p) {
    const int j = p * kSplitThreads + threadIdx.x;
    if (j < cnt) q[p] = xr[j];
  }
  return cnt;
}

// Launch 1: each piece's exact (mean, centred sum of squares), one block a piece. Blocks go piece-major (piece 0 of
// every row, then piece 1, ...): a caller's last launch, in that order, then reads a piece of a row-sized operand
// (layer_norm's w and b over several dims) from DRAM once for all the rows.
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) split_stats_kernel(const T* __restrict__ x,
                                                                    float2* __restrict__ piece_stats, int64_t n,
                                                                    int pieces) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  Pack<T> q[kSplitPacks];
  const int64_t rows = gridDim.x / pieces, k = blockIdx.x % rows * pieces + blockIdx.x / rows;  // piece-major blocks
  const int cnt = load_piece(x, n, k, pieces, q);
  float s = 0.f;
#pragma unroll
  for (int p = 0; p < kSplitPacks; ++p)
    if (p * kSplitThreads + (int)threadIdx.x < cnt) {
#pragma unroll
      for (int e = 0; e < V; ++e) s += to_f(q[p].v[e]);
    }
  const float m = block_sum(s, smem) / ((float)cnt * V);
  float ss = 0.f;
#pragma unroll
  for (int p = 0; p < kSplitPacks; ++p)
    if (p * kSplitThreads + (int)threadIdx.x < cnt) {
#pragma unroll
      for (int e = 0; e < V; ++e) ss += (to_f(q[p].v[e]) - m) * (to_f(q[p].v[e]) - m);
    }
  const float m2 = block_sum(ss, smem);
  if (threadIdx.x == 0) piece_stats[k] = make_float2(m, m2);
}

// Launch 2: the pieces of row blockIdx.x merged into the row's mean and rstd = 1 / sqrt(biased variance + eps).
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) split_merge_kernel(const float2* __restrict__ piece_stats,
                                                                    float* __restrict__ mean_out,
                                                                    float* __restrict__ rstd_out, int64_t n,
                                                                    int pieces, float eps) {
  constexpr int V = Pack<T>::N;
  __shared__ float3 smem[32];
  const int64_t r = blockIdx.x, npacks = n / V;
  float3 acc = make_float3(0.f, 0.f, 0.f);
  for (int i = threadIdx.x; i < pieces; i += kSplitThreads) {
    const float2 o = piece_stats[r * pieces + i];
    acc = chan_merge(acc, make_float3((float)(min((int64_t)kSplitPiece, npacks - (int64_t)i * kSplitPiece) * V), o.x,
                                      o.y));
  }
  acc = block_merge(acc, smem);
  if (threadIdx.x == 0) mean_out[r] = acc.y, rstd_out[r] = rsqrtf(acc.z / (float)n + eps);
}

// The pieces of a row (0: rows not split: rows that one block holds in registers, unaligned rows, a grid too large).
template <typename T>
inline int split_pieces(int64_t rows, int64_t n, bool vec) {
  constexpr int V = Pack<T>::N;
  if (!vec || n <= (int64_t)1024 * max_packs(V) * V) return 0;
  const int64_t pieces = (n / V + kSplitPiece - 1) / kSplitPiece;
  return rows * pieces < 0x7fffffff ? (int)pieces : 0;
}

// Bytes of the pieces' statistics for these rows; 0 where rows are not split.
template <typename T>
inline int64_t split_workspace(int64_t rows, int64_t n) {
  return rows * split_pieces<T>(rows, n, n % Pack<T>::N == 0) * (int64_t)sizeof(float2);
}

}  // namespace tiered_ops
