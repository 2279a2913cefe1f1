// softmax over the last dim of contiguous rows: y = exp(x - max) / sum(exp(x - max)), fp32 math.
//
// Bytes: ideal 1 read + 1 write of the tensor. v1 reads each row twice (pass 1: online max and sum,
// pass 2: normalize and write); the second read hits L1/L2 for rows up to ~100 KB, beyond that it is a
// second DRAM read (1.5x the ideal traffic).
// Limits: any row length (the block loops over the row); one block per row, so few-row giant rows
// use few SMs (a split-row version is the next one to add).
// Versions: v1 — block per row, 16-byte loads when every row is 16-byte aligned.
// v2 — the row in registers (common.cuh, rows_config): 1 read + 1 write for rows of up to 32768
// elements that are a multiple of 16 bytes and aligned; several short rows per block, reduced with shuffles. v1 does the rest.
// Backward: dx = y * (dy - sum(dy * y)); block per row, reads y and dy twice (the second time from L1/L2 for
// rows up to ~100 KB), writes dx once.
#include "common.cuh"

namespace tiered_ops {

template <typename T, int V>
__global__ void softmax_v1_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    float m = -INFINITY, s = 0.f;  // this thread's running max and sum of exp(x - m)
    for_row<V>(n, [&](int64_t i) {
      float v[V];
      load_f<T, V>(xr, i, v);
      float mx = v[0];
      bool nan = v[0] != v[0];
#pragma unroll
      for (int j = 1; j < V; ++j) mx = fmaxf(mx, v[j]), nan |= v[j] != v[j];
      if (nan) s = NAN;  // fmaxf drops NaN; a NaN sum makes the whole row NaN, as in torch
      const float m_new = fmaxf(m, mx);
      if (m_new == -INFINITY) return;  // everything so far is -inf: nothing to add
      s *= __expf(m - m_new);
#pragma unroll
      for (int j = 0; j < V; ++j) s += __expf(v[j] - m_new);
      m = m_new;
    });
    const float m_row = block_max(m, smem);
    const float s_row = block_sum(s * (m == -INFINITY ? 0.f : __expf(m - m_row)), smem);
    const float inv = 1.f / s_row;
    for_row<V>(n, [&](int64_t i) {
      float v[V];
      load_f<T, V>(xr, i, v);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = __expf(v[j] - m_row) * inv;
      store_f<T, V>(yr, i, v);
    });
  });
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, 1) softmax_v2_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int n, int tpr) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  for_reg_rows(rows, n, tpr, [&](const RegRow& row) {
    const int64_t r = row.r;
    Pack<T> q[P];  // raw: 4 registers a pack
    float m = -INFINITY;
    row.load<P, V>(x + r * n, q, [&](float v) { m = fmaxf(m, v); });
    m = group_max(m, tpr, smem);
    float s = 0.f;  // a NaN anywhere makes s NaN, so the whole row is NaN, as in torch
    row.each<P, V>([&](int p, int) {
#pragma unroll
      for (int j = 0; j < V; ++j) s += __expf(to_f(q[p].v[j]) - m);
    });
    const float inv = 1.f / group_sum(s, tpr, smem);
    row.each<P, V>([&](int p, int i) {
      float a[V];
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = __expf(to_f(q[p].v[j]) - m) * inv;
      store_f<T, V>(y, r * n + i, a);
    });
  });
}

template <typename T>
static cudaError_t launch_softmax(const T* x, T* y, int64_t rows, int64_t n, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const RowsConfig c = rows_config(rows, n, V, aligned16(x) && aligned16(y));
  if (c.packs) {
    TIERED_OPS_WITH_PACKS(c.packs, V, P,
                          softmax_v2_kernel<T, P><<<c.blocks, c.threads, 0, stream>>>(x, y, rows, (int)n, c.tpr));
    return cudaGetLastError();
  }
  const bool vec = n % V == 0 && aligned16(x) && aligned16(y);
  return launch_block_rows(vec, V, softmax_v1_kernel<T, V>, softmax_v1_kernel<T, 1>, rows, n, stream, x, y, rows, n);
}

cudaError_t softmax_fwd(const void* x, void* y, int64_t rows, int64_t n, DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_softmax(static_cast<const T*>(x), static_cast<T*>(y), rows, n, stream));
  return cudaSuccess;
}

template <typename T, int V>
__global__ void softmax_bwd_v1_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                                      int64_t rows, int64_t n) {
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const int64_t base = r * n;
    float s = 0.f;
    for_row<V>(n, [&](int64_t i) {
      float a[V], b[V];
      load_f<T, V>(y, base + i, a);
      load_f<T, V>(dy, base + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) s += a[j] * b[j];
    });
    s = block_sum(s, smem);
    for_row<V>(n, [&](int64_t i) {
      float a[V], b[V];
      load_f<T, V>(y, base + i, a);
      load_f<T, V>(dy, base + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = a[j] * (b[j] - s);
      store_f<T, V>(dx, base + i, a);
    });
  });
}

template <typename T>
static cudaError_t launch_softmax_bwd(const T* dy, const T* y, T* dx, int64_t rows, int64_t n, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = n % V == 0 && aligned16(dy) && aligned16(y) && aligned16(dx);
  return launch_block_rows(vec, V, softmax_bwd_v1_kernel<T, V>, softmax_bwd_v1_kernel<T, 1>, rows, n, stream, dy, y,
                           dx, rows, n);
}

cudaError_t softmax_bwd(const void* dy, const void* y, void* dx, int64_t rows, int64_t n, DType dtype,
                        cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_softmax_bwd(static_cast<const T*>(dy), static_cast<const T*>(y),
                                                static_cast<T*>(dx), rows, n, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
