// linear_cross_entropy's own kernel: the dlogits of one chunk of tokens, from its float32 logits [rows, n] (written
// by the wrapper's GEMM, contiguous) and the rows' lse, in the dtype of hidden (the GEMMs that follow read it; in
// float32 dx may be x itself: every element is read, then written, by one thread, so x and dx are not restrict):
// dx[r, j] = (exp(x[r, j] - lse[r]) - s / n - (1 - s) [j == t]) * g[r * g_stride] (g_stride 0: one scale for every
// row; for 'mean' the output gradient over the count of non-ignored targets), s = label_smoothing. An ignored row
// (t == ignore_index) is 0, or NaN across the row where its lse is not finite (torch's 0 * softmax: its logits are
// read for that); a target outside [0, n) makes its row NaN (targets are not checked on the device: no sync).
// The forward (float32 loss and lse per row) and the reductions are cross_entropy's kernels (cross_entropy.cu) on
// the chunk's float32 logits; the GEMMs are cuBLAS through ATen in the wrapper (linear_cross_entropy.cpp). The
// wrapper runs this kernel in the forward, right after the loss, for a scalar loss whose gradient is wanted (scale:
// 1, or 1 over the count for 'mean'; the backward then scales the gradients), else in the backward on recomputed
// logits.
//
// dx rows are dx_stride elements apart: the forward writes half-width dlogits over the chunk's own float32 logits
// (dx_stride 2 n), each tile of a row read before a barrier and written after it.
//
// Bytes: 1 read of the float32 logits (4 n per row) + 1 write of dx (2 n per row in bfloat16) + 12 bytes a row.
// Limits: any n; one block of 256 threads per row, the grid striding over rows (grid_rows); indices in int64.
// Versions: v1 — block per row, one element per thread per step (the float32 chunk is contiguous and n-aligned rows
// are not assumed: an odd vocabulary makes rows start anywhere); v2 — a row stride for dx and a barrier per tile
// of 8 elements a thread, so that dx may lie over x in a half dtype.
#include "common.cuh"

namespace tiered_ops {

constexpr int kTile = 8;  // elements a thread reads, then writes, per tile of a row

template <typename T>
__global__ void __launch_bounds__(256) lce_dlogits_kernel(const float* x, const int64_t* __restrict__ target,
                                                          const float* __restrict__ lse, const float* __restrict__ g,
                                                          int64_t g_stride, T* dx, int64_t dx_stride, int64_t rows,
                                                          int64_t n, int64_t ignore_index, float smoothing) {
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const float* xr = x + r * n;
    T* dr = dx + r * dx_stride;
    const int64_t t = target[r];
    if (t == ignore_index) {  // the same for the whole block: every thread reaches block_max
      float m = -INFINITY;
      for_row<1>(n, [&](int64_t j) {
        const float v = xr[j];
        m = fmaxf(m, v != v ? INFINITY : v);  // a NaN counts as +inf: the row's lse is not finite either way
      });
      const T z = from_f<T>(block_max(m, smem) * 0.f);  // 0, or NaN for +-inf; every read of the row done by then
      for_row<1>(n, [&](int64_t j) { dr[j] = z; });
      return;
    }
    const float l = lse[r], scale = g[r * g_stride], off = smoothing / (float)n, hit = 1.f - smoothing;
    const bool ok = t >= 0 && t < n;
    // tiles of kTile elements a thread, each read (the loads in flight together), then (after a barrier) written:
    // where dx lies over x (half-width dlogits over the row's own float32 bytes) a write reaches back only to
    // elements of this tile or earlier ones
    const int64_t tile = (int64_t)blockDim.x * kTile;
    for (int64_t base = 0; base < n; base += tile) {
      float d[kTile];
#pragma unroll
      for (int k = 0; k < kTile; ++k) {
        const int64_t j = base + threadIdx.x + (int64_t)k * blockDim.x;
        d[k] = j < n ? (ok ? (__expf(xr[j] - l) - off - (j == t ? hit : 0.f)) * scale : NAN) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kTile; ++k) {
        const int64_t j = base + threadIdx.x + (int64_t)k * blockDim.x;
        if (j < n) dr[j] = from_f<T>(d[k]);
      }
    }
  });
}

cudaError_t linear_cross_entropy_dlogits(const float* x, const int64_t* target, const float* lse, const float* g,
                                         int64_t g_stride, void* dx, int64_t dx_stride, int64_t rows, int64_t n,
                                         int64_t ignore_index, float smoothing, DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      lce_dlogits_kernel<T><<<grid_rows(rows), 256, 0, stream>>>(
                          x, target, lse, g, g_stride, static_cast<T*>(dx), dx_stride, rows, n, ignore_index,
                          smoothing));
  return cudaGetLastError();
}

}  // namespace tiered_ops
