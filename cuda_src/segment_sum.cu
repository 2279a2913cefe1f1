// segment_sum: out[s, :] = sum of values[offsets[s]:offsets[s + 1], :] (values [E, D], offsets [S + 1] int64),
// fp32 sums, one rounding to the dtype. Backward: dvalues[e, :] = dout[segment of e, :].
//
// Skew (the Triton tier's split, block for program): rows are cut at a chunk of CH rows (256 to 4096, growing
// with E so that there are at most ~1024 row ranges). A segment of at most CH rows is summed whole by a block of
// the segment role (a few segments per block when they are short; an empty one stores zeros). A longer one is
// summed by the blocks of the row ranges it crosses, each writing an fp32 partial (at most two per range: the
// segment holding the range's first row and the one holding its last), and the combine kernel adds each long
// segment's partials in range order and writes its sum. Each range block also records the long segment that starts
// in its range (or -1), so that the combine's block reads that id instead of searching for it. No block sums more
// than CH rows, one giant segment is spread over E / CH blocks, many empty segments are many cheap blocks; no atomics,
// so the sums are deterministic.
// (A row-parallel pass with atomics would serialize E / CH adds on the giant segment's D addresses at the L2 and
// need a zeroed fp32 buffer and a rounding pass for 16-bit outputs.)
//
// Threads: a block of 128 threads (4 warps) takes a tile of rows x columns: `tpr` threads per row (a power of two
// up to 32), each with K units of V columns (V = 16 bytes of T when D and the pointers allow it, else 1), so a
// block covers tpr * K * V <= 256 columns (blockIdx.y walks wider rows) and 4 * 32 / tpr rows a step, four steps in
// flight per loop trip (two when a thread holds 8 columns). Sums: shuffles across a warp's rows, then the 4 warps
// through shared memory.
// Bytes: values read once (E * D), out written once (S * D), offsets (S + 1); partials 2 * D fp32 per range at most,
// and one int64 segment id per range.
// Backward: dout read (S * D), dvalues written (E * D), no combine.
// Contract: offsets are not read on the host (a sync): malformed offsets (unsorted, offsets[0] != 0,
// offsets[-1] != E) give unspecified values, never an access out of bounds (boundaries clamped to [0, E], segment
// ids to [0, S)). Limits: any E, D, S; 64-bit row offsets.
// Versions: v1 — segment role + row-range role in one launch, one combine launch when E > CH. v2 — the range blocks
// record the long segment starting in their range: v1's combine blocks each ran a binary search over the offsets
// (log2 S dependent loads per block, most blocks then exiting), which cost more than the main kernel's range role.
#include "common.cuh"

namespace tiered_ops {
namespace {

constexpr int kThreads = 128, kWarps = kThreads / 32, kMaxCols = 256, kUnroll = 4;
constexpr int64_t kMinChunk = 256, kMaxChunk = 4096, kRanges = 1024;
constexpr int kCombineCols = 32, kCombineRows = 8;  // combine block: 32 columns x 8 partial rows

int64_t chunk_rows(int64_t rows) {
  const int64_t want = (rows + kRanges - 1) / kRanges;
  int64_t ch = kMinChunk;
  while (ch < want && ch < kMaxChunk) ch *= 2;
  return ch;
}

int64_t ranges_of(int64_t rows, int64_t ch) { return rows > ch ? (rows + ch - 1) / ch : 0; }

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Rows [a, b) of segment s, clamped to [0, E].
__device__ __forceinline__ void bounds(const int64_t* __restrict__ off, int64_t s, int64_t E, int64_t& a, int64_t& b) {
  a = clamp64(off[s], 0, E);
  b = clamp64(off[s + 1], a, E);
}

// The segment holding `row`: the last s in [0, S) with offsets[s] <= row (stays in [0, S) for any offsets).
__device__ __forceinline__ int64_t find_segment(const int64_t* __restrict__ off, int64_t row, int64_t S) {
  int64_t lo = 0, hi = S - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (off[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// This thread's place in the block's tile.
struct Lane {
  int tpr, c, first_row, step;  // threads per row, unit index in the row, first row offset, rows per step
  __device__ explicit Lane(int tpr_) : tpr(tpr_) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rpw = 32 / tpr_;
    c = lane % tpr_;
    first_row = warp * rpw + lane / tpr_;
    step = kWarps * rpw;
  }
};

// Column sums over rows [a, b) of this thread's units, U rows in flight.
template <typename T, int V, int K>
__device__ __forceinline__ void sum_rows(const T* __restrict__ x, int64_t a, int64_t b, int64_t D, int64_t col0,
                                         const Lane& ln, float (&acc)[K][V]) {
  constexpr int U = (K * V >= 8 || K >= 4) ? kUnroll / 2 : kUnroll;  // 8+ columns or 4+ units: half the rows
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) acc[k][j] = 0.f;
  for (int64_t r = a + ln.first_row; r < b; r += (int64_t)U * ln.step) {
    float v[U][K][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t row = r + (int64_t)u * ln.step;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t col = col0 + (int64_t)(ln.c + k * ln.tpr) * V;
        if (row < b && col < D) {
          load_f<T, V>(x, row * D + col, v[u][k]);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) v[u][k][j] = 0.f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[k][j] += v[u][k][j];
  }
}

// The block's column sums: across the rows of a warp with shuffles, then across warps in shared memory. Afterwards
// threads of warp 0 with lane < tpr hold the block's sums of their units in acc. Every thread of the block calls it.
template <int V, int K>
__device__ __forceinline__ void block_reduce(float (&acc)[K][V], const Lane& ln, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j)
      for (int o = ln.tpr; o < 32; o <<= 1) acc[k][j] += __shfl_xor_sync(0xffffffffu, acc[k][j], o);
  __syncthreads();  // smem may still be read by the previous segment's reduction
  if (lane < ln.tpr)
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int j = 0; j < V; ++j) smem[warp * kMaxCols + (ln.c + k * ln.tpr) * V + j] = acc[k][j];
  __syncthreads();
  if (warp == 0 && lane < ln.tpr)
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) t += smem[w * kMaxCols + (ln.c + k * ln.tpr) * V + j];
        acc[k][j] = t;
      }
}

// Rows [a, b) summed into dst (a row of D: T values when OUT_T, else fp32 partials).
template <typename T, int V, int K, bool OUT_T>
__device__ __forceinline__ void sum_into(const T* __restrict__ x, int64_t a, int64_t b, int64_t D, int64_t col0,
                                         const Lane& ln, float* smem, void* dst) {
  float acc[K][V];
  sum_rows<T, V, K>(x, a, b, D, col0, ln, acc);
  block_reduce<V, K>(acc, ln, smem);
  if ((threadIdx.x >> 5) != 0 || (threadIdx.x & 31) >= ln.tpr) return;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t col = col0 + (int64_t)(ln.c + k * ln.tpr) * V;
    if (col >= D) continue;
    if constexpr (OUT_T) {
      store_f<T, V>(static_cast<T*>(dst), col, acc[k]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) static_cast<float*>(dst)[col + j] = acc[k][j];
    }
  }
}

template <typename T, int V, int K>
__global__ void __launch_bounds__(kThreads)
segment_sum_v2_kernel(const T* __restrict__ x, const int64_t* __restrict__ off, T* __restrict__ out,
                      float* __restrict__ ws, int64_t* __restrict__ starts, int64_t E, int64_t D, int64_t S,
                      int64_t ch, int64_t seg_blocks, int segs, int tpr) {
  __shared__ float smem[kWarps * kMaxCols];
  const Lane ln(tpr);
  const int64_t col0 = (int64_t)blockIdx.y * tpr * K * V;
  if ((int64_t)blockIdx.x < seg_blocks) {  // segment role: segments of at most CH rows, whole
    for (int j = 0; j < segs; ++j) {
      const int64_t s = (int64_t)blockIdx.x * segs + j;
      if (s >= S) break;
      int64_t a, b;
      bounds(off, s, E, a, b);
      if (b - a <= ch) sum_into<T, V, K, true>(x, a, b, D, col0, ln, smem, out + s * D);
    }
    return;
  }
  // Row-range role: range p's pieces of long segments, as fp32 partials ws[2p] and ws[2p + 1]; starts[p]: the long
  // segment that starts in range p (it holds the range's last row), else -1.
  const int64_t p = (int64_t)blockIdx.x - seg_blocks, lo = p * ch, hi = lo + ch < E ? lo + ch : E;
  const int64_t sa = find_segment(off, lo, S), sb = find_segment(off, hi - 1, S);
  int64_t a, b, a2, b2;
  bounds(off, sb, E, a2, b2);
  if (blockIdx.y == 0 && threadIdx.x == 0) starts[p] = (b2 - a2 > ch && a2 >= lo) ? sb : -1;
  bounds(off, sa, E, a, b);
  if (b - a > ch) sum_into<T, V, K, false>(x, lo, b < hi ? b : hi, D, col0, ln, smem, ws + 2 * p * D);
  if (sb != sa && b2 - a2 > ch)
    sum_into<T, V, K, false>(x, a2 > lo ? a2 : lo, hi, D, col0, ln, smem, ws + (2 * p + 1) * D);
}

// Block q: the long segment starting in row range q (starts[q], recorded by the range's block; -1: none, and the block
// exits), its partials added in range order: ws[2q] or ws[2q + 1] (slot 0 when it also holds the range's first row),
// then slot 0 of each later range. 8 rows of threads take every 8th partial, 32 columns wide (coalesced), then add up
// through shared memory.
template <typename T>
__global__ void __launch_bounds__(kCombineCols * kCombineRows)
segment_sum_combine_v2_kernel(const float* __restrict__ ws, const int64_t* __restrict__ starts,
                              const int64_t* __restrict__ off, T* __restrict__ out, int64_t E, int64_t D, int64_t ch) {
  __shared__ float red[kCombineRows][kCombineCols + 1];
  const int64_t q = blockIdx.x, lo = q * ch, s = starts[q];
  if (s < 0) return;  // the same for the whole block
  int64_t a, b;
  bounds(off, s, E, a, b);  // the bounds the range block read: b - a > ch, a in [lo, lo + ch)
  const int tx = threadIdx.x % kCombineCols, ty = threadIdx.x / kCombineCols;
  const int64_t col = (int64_t)blockIdx.y * kCombineCols + tx, last = (b - 1) / ch + 1;
  float acc = 0.f;
  if (col < D) {
    if (ty == 0) acc = ws[(2 * q + (a == lo ? 0 : 1)) * D + col];
#pragma unroll 4
    for (int64_t r = q + 1 + ty; r < last; r += kCombineRows) acc += ws[2 * r * D + col];
  }
  red[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < D) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < kCombineRows; ++i) t += red[i][tx];
    out[s * D + col] = from_f<T>(t);
  }
}

// Rows [a, b) of dx set to this thread's units of g.
template <typename T, int V, int K>
__device__ __forceinline__ void fill_rows(T* __restrict__ dx, int64_t a, int64_t b, int64_t D, int64_t col0,
                                          const Lane& ln, const float (&g)[K][V]) {
  for (int64_t r = a + ln.first_row; r < b; r += ln.step) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t col = col0 + (int64_t)(ln.c + k * ln.tpr) * V;
      if (col < D) store_f<T, V>(dx, r * D + col, g[k]);
    }
  }
}

template <typename T, int V, int K>
__device__ __forceinline__ void load_row(const T* __restrict__ dout, int64_t s, int64_t D, int64_t col0,
                                         const Lane& ln, float (&g)[K][V]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t col = col0 + (int64_t)(ln.c + k * ln.tpr) * V;
    if (col < D) {
      load_f<T, V>(dout, s * D + col, g[k]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) g[k][j] = 0.f;
    }
  }
}

// The forward's split: a short segment's rows by its segment block, a long one's by the row ranges it crosses.
template <typename T, int V, int K>
__global__ void __launch_bounds__(kThreads)
segment_sum_bwd_v1_kernel(const T* __restrict__ dout, const int64_t* __restrict__ off, T* __restrict__ dx, int64_t E,
                          int64_t D, int64_t S, int64_t ch, int64_t seg_blocks, int segs, int tpr) {
  const Lane ln(tpr);
  const int64_t col0 = (int64_t)blockIdx.y * tpr * K * V;
  float g[K][V];
  int64_t a, b;
  if ((int64_t)blockIdx.x < seg_blocks) {
    for (int j = 0; j < segs; ++j) {
      const int64_t s = (int64_t)blockIdx.x * segs + j;
      if (s >= S) break;
      bounds(off, s, E, a, b);
      if (b - a > ch || a == b) continue;
      load_row<T, V, K>(dout, s, D, col0, ln, g);
      fill_rows<T, V, K>(dx, a, b, D, col0, ln, g);
    }
    return;
  }
  const int64_t p = (int64_t)blockIdx.x - seg_blocks, lo = p * ch, hi = lo + ch < E ? lo + ch : E;
  const int64_t sa = find_segment(off, lo, S), sb = find_segment(off, hi - 1, S);
  bounds(off, sa, E, a, b);
  if (b - a > ch) {
    load_row<T, V, K>(dout, sa, D, col0, ln, g);
    fill_rows<T, V, K>(dx, lo, b < hi ? b : hi, D, col0, ln, g);
  }
  bounds(off, sb, E, a, b);
  if (sb != sa && b - a > ch) {
    load_row<T, V, K>(dout, sb, D, col0, ln, g);
    fill_rows<T, V, K>(dx, a > lo ? a : lo, hi, D, col0, ln, g);
  }
}

// Launch geometry: V (16-byte packs when D and every pointer allow it), tpr, K, column blocks, segments per block.
struct Geometry {
  bool vec;
  int tpr, k, segs;
  int64_t ch, ranges, seg_blocks, col_blocks;
};

template <typename T>
Geometry geometry(int64_t E, int64_t D, int64_t S, bool aligned) {
  Geometry g;
  const int V = Pack<T>::N;
  g.vec = aligned && D % V == 0;
  const int v = g.vec ? V : 1;
  const int64_t units = (D + v - 1) / v;
  g.tpr = 1;
  while (g.tpr < 32 && g.tpr < units) g.tpr *= 2;
  const int kmax = kMaxCols / (32 * v);  // 8 scalar, 2 fp32 packs, 1 16-bit pack
  g.k = 1;
  while (g.k < kmax && (int64_t)g.tpr * g.k < units) g.k *= 2;
  g.col_blocks = (D + (int64_t)g.tpr * g.k * v - 1) / ((int64_t)g.tpr * g.k * v);
  g.ch = chunk_rows(E);
  g.ranges = ranges_of(E, g.ch);
  const int64_t rows_per_step = (int64_t)kWarps * (32 / g.tpr), mean = S > 0 ? E / S : 0;
  int64_t segs = mean > 0 ? rows_per_step * kUnroll / mean : 8;  // short segments: a few per block
  g.segs = (int)(segs < 1 ? 1 : (segs > 8 ? 8 : segs));
  g.seg_blocks = (S + g.segs - 1) / g.segs;
  return g;
}

// Runs the statement with `constexpr int V` and `constexpr int K` set from the geometry (only the instantiations
// the geometry can choose: K * V * 32 <= kMaxCols).
#define SEGMENT_SUM_WITH_VK(T, geo, ...)                                     \
  if ((geo).vec) {                                                          \
    constexpr int V = Pack<T>::N;                                           \
    switch ((geo).k) {                                                      \
      case 1: { constexpr int K = 1; __VA_ARGS__; } break;                  \
      case 2:                                                               \
        if constexpr (32 * 2 * V <= kMaxCols) {                             \
          constexpr int K = 2;                                              \
          __VA_ARGS__;                                                      \
          break;                                                            \
        }                                                                   \
        return cudaErrorInvalidValue;                                       \
      default: return cudaErrorInvalidValue;                                \
    }                                                                       \
  } else {                                                                  \
    constexpr int V = 1;                                                    \
    switch ((geo).k) {                                                      \
      case 1: { constexpr int K = 1; __VA_ARGS__; } break;                  \
      case 2: { constexpr int K = 2; __VA_ARGS__; } break;                  \
      case 4: { constexpr int K = 4; __VA_ARGS__; } break;                  \
      case 8: { constexpr int K = 8; __VA_ARGS__; } break;                  \
      default: return cudaErrorInvalidValue;                                \
    }                                                                       \
  }

template <typename T>
cudaError_t launch_fwd(const T* x, const int64_t* off, T* out, float* ws, int64_t E, int64_t D, int64_t S,
                       cudaStream_t stream) {
  const Geometry g = geometry<T>(E, D, S, aligned16(x) && aligned16(out));
  const dim3 grid((unsigned)(g.seg_blocks + g.ranges), (unsigned)g.col_blocks);
  int64_t* starts = reinterpret_cast<int64_t*>(ws + 2 * g.ranges * D);  // after the partials (8-byte aligned)
  SEGMENT_SUM_WITH_VK(T, g,
                      segment_sum_v2_kernel<T, V, K><<<grid, kThreads, 0, stream>>>(
                          x, off, out, ws, starts, E, D, S, g.ch, g.seg_blocks, g.segs, g.tpr));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || g.ranges == 0) return err;
  const dim3 cgrid((unsigned)g.ranges, (unsigned)((D + kCombineCols - 1) / kCombineCols));
  segment_sum_combine_v2_kernel<T><<<cgrid, kCombineCols * kCombineRows, 0, stream>>>(ws, starts, off, out, E, D, g.ch);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const T* dout, const int64_t* off, T* dx, int64_t E, int64_t D, int64_t S,
                       cudaStream_t stream) {
  const Geometry g = geometry<T>(E, D, S, aligned16(dout) && aligned16(dx));
  const dim3 grid((unsigned)(g.seg_blocks + g.ranges), (unsigned)g.col_blocks);
  SEGMENT_SUM_WITH_VK(T, g,
                      segment_sum_bwd_v1_kernel<T, V, K><<<grid, kThreads, 0, stream>>>(
                          dout, off, dx, E, D, S, g.ch, g.seg_blocks, g.segs, g.tpr));
  return cudaGetLastError();
}

}  // namespace

int64_t segment_sum_workspace(int64_t rows, int64_t d) {
  return 2 * ranges_of(rows, chunk_rows(rows)) * (d + 1);  // the partials, then one int64 (two floats) per range
}

cudaError_t segment_sum_fwd(const void* values, const int64_t* offsets, void* out, float* ws, int64_t rows, int64_t d,
                            int64_t segments, DType dtype, cudaStream_t stream) {
  if (segments == 0 || d == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_fwd(static_cast<const T*>(values), offsets, static_cast<T*>(out), ws, rows, d,
                                        segments, stream));
  return cudaSuccess;
}

cudaError_t segment_sum_bwd(const void* dout, const int64_t* offsets, void* dvalues, int64_t rows, int64_t d,
                            int64_t segments, DType dtype, cudaStream_t stream) {
  if (segments == 0 || d == 0 || rows == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_bwd(static_cast<const T*>(dout), offsets, static_cast<T*>(dvalues), rows, d,
                                        segments, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
