// cross_entropy over rows of logits [N, V] (row stride `stride`, last dim contiguous) with int64 targets.
// Forward, per row: lse = m + log(sum exp(x - m)) by an online softmax (each thread keeps a running max m and a sum
// of exp(x - m) over its elements, rescaled when m grows; the block combines the pairs once), then
// loss = lse - (1 - s) x[t] - s / V sum(x), s = label_smoothing; an ignored row (t == ignore_index) writes loss 0
// without reading its logits. Writes float32 loss[N] and lse[N]. The reductions ('sum', 'mean': the sum over the count of
// rows whose target is not ignore_index, 0 / 0 = NaN where every row is ignored) take one more launch of one block, which
// sums loss in a fixed order (the same bits every run) and writes the scalar in the output dtype.
// Backward, per row: dx = (exp(x - lse) - s / V - (1 - s) [j == t]) * g[row * g_stride] (g_stride 0: one scalar, for
// 'mean' the output gradient over that count, from the same one-block kernel);
// an ignored row 0, NaN where its lse is not finite (torch's 0 * softmax: its logits are read for that).
//
// Bytes: forward 1 read of the logits + 16 N (targets, loss, lse); nothing [N, V] is written. Backward 1 read of
// the logits + 1 write of dx + 12 N (targets, lse). Memory-bound on an H100 (V >= 32000: 64 KB and more per row).
// Limits: any V; one block of up to 1024 threads per row (grid-stride over rows). The forward reads each row in 16-byte
// packs between single elements up to its first 16-byte boundary and after its last whole pack (two packs per thread
// issued before either is used); the backward reads and writes packs when every row is 16-byte aligned and V is a
// multiple of the pack (its loop unrolled twice), else one element at a time. Targets are not checked (it would cost a sync): a target outside [0, V) that is not ignore_index makes
// that row's loss and gradient NaN; no out-of-bounds read.
// Versions: v1 — block per row, online softmax in one pass, recompute in the backward.
// v2 (forward) — packs in rows that do not start on a 16-byte boundary, between a head and a tail of single elements;
// v1 read such rows (an odd V: GPT-2's 50257) one element at a time.
#include "common.cuh"

namespace tiered_ops {

// One thread's running state over its elements: max, sum of exp(x - max) (NaN once a NaN was seen), sum of x.
struct Online {
  float m = -INFINITY, s = 0.f, xs = 0.f;

  template <int V>
  __device__ __forceinline__ void add(const float (&v)[V]) {
    float mx = v[0];
    bool nan = false;
#pragma unroll
    for (int j = 0; j < V; ++j) mx = fmaxf(mx, v[j]), nan |= v[j] != v[j], xs += v[j];
    if (nan) s = NAN;  // fmaxf drops NaN: the sum carries it
    const float m_new = fmaxf(m, mx);
    if (m_new != -INFINITY) {  // everything so far -inf: nothing to add (avoids -inf - -inf)
      s *= __expf(m - m_new);
#pragma unroll
      for (int j = 0; j < V; ++j) s += __expf(v[j] - m_new);
      m = m_new;
    }
  }
};

// V: the pack width, or 1 (one element at a time). With packs, a row is a head of single elements up to its first
// 16-byte boundary (fewer than V), a body of whole packs and a tail of single elements (fewer than V): rows need not
// start on a boundary (an odd vocabulary, a row stride no multiple of the pack); x is element-aligned.
template <typename T, int V>
__global__ void __launch_bounds__(1024) ce_fwd_v2_kernel(const T* __restrict__ x, const int64_t* __restrict__ target,
                                                         float* __restrict__ loss, float* __restrict__ lse,
                                                         int64_t rows, int64_t n, int64_t stride, int64_t ignore_index,
                                                         float smoothing) {
  __shared__ float smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t t = target[r];
    if (t == ignore_index) {  // the same for the whole block: no thread reaches the reductions below
      if (threadIdx.x == 0) loss[r] = 0.f, lse[r] = 0.f;
      continue;
    }
    const T* xr = x + r * stride;
    int64_t head = 0;
    if constexpr (V > 1) {
      const int64_t to_boundary = (int64_t)((16 - (reinterpret_cast<uintptr_t>(xr) & 15)) & 15) / (int64_t)sizeof(T);
      head = to_boundary < n ? to_boundary : n;
    }
    const int64_t body = (n - head) / V * V;
    Online o;
    for (int64_t i = threadIdx.x; i < n - body; i += blockDim.x) {  // the head's and the tail's single elements
      const float a[1] = {to_f(xr[i < head ? i : i + body])};
      o.add<1>(a);
    }
    const T* xb = xr + head;
    const int64_t step = (int64_t)blockDim.x * V;
    for (int64_t i = (int64_t)threadIdx.x * V; i < body; i += 2 * step) {
      float a[V], b[V];
      load_f<T, V>(xb, i, a);  // both loads issued before either is used
      const bool second = i + step < body;
      if (second) load_f<T, V>(xb, i + step, b);
      o.add<V>(a);
      if (second) o.add<V>(b);
    }
    const float m_row = block_max(o.m, smem);
    // NaN * 0 stays NaN: a thread that saw a NaN makes the row NaN, as in torch
    const float s_row = block_sum(o.s * (o.m == -INFINITY ? 0.f : __expf(o.m - m_row)), smem);
    const float xs_row = smoothing > 0.f ? block_sum(o.xs, smem) : 0.f;
    if (threadIdx.x == 0) {
      const float l = m_row + logf(s_row);
      const bool ok = t >= 0 && t < n;
      const float xt = ok ? to_f(xr[t]) : 0.f;
      loss[r] = ok ? l - (1.f - smoothing) * xt - smoothing / (float)n * xs_row : NAN;
      lse[r] = l;
    }
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(1024) ce_bwd_v1_kernel(const T* __restrict__ x, const int64_t* __restrict__ target,
                                                         const float* __restrict__ lse, const float* __restrict__ g,
                                                         int64_t g_stride, T* __restrict__ dx, int64_t rows, int64_t n,
                                                         int64_t stride, int64_t ignore_index, float smoothing) {
  __shared__ float smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t t = target[r];
    T* dr = dx + r * n;
    const T* xr = x + r * stride;
    const int64_t step = (int64_t)blockDim.x * V;
    if (t == ignore_index) {  // the same for the whole block
      // torch's gradient of an ignored row is 0 * softmax: 0, or NaN across the row where its lse is not finite
      // (a NaN, a +inf, or every entry -inf): the row's max, a NaN counted as +inf, says which.
      float m = -INFINITY;
      for_row<V>(n, [&](int64_t i) {
        float a[V];
        load_f<T, V>(xr, i, a);
#pragma unroll
        for (int j = 0; j < V; ++j) m = fmaxf(m, a[j] != a[j] ? INFINITY : a[j]);
      });
      const float zero = block_max(m, smem) * 0.f;  // NaN for +-inf
      float z[V];
#pragma unroll
      for (int j = 0; j < V; ++j) z[j] = zero;
      for_row<V>(n, [&](int64_t i) { store_f<T, V>(dr, i, z); });
      continue;
    }
    const float scale = g[r * g_stride], l = lse[r], off = smoothing / (float)n, hit = 1.f - smoothing;
    const bool ok = t >= 0 && t < n;
    // no dependence between iterations: unrolled, the next pack's load is in flight while this one is computed
#pragma unroll 2
    for (int64_t i = (int64_t)threadIdx.x * V; i < n; i += step) {
      float a[V];
      load_f<T, V>(xr, i, a);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = ok ? (__expf(a[j] - l) - off - (i + j == t ? hit : 0.f)) * scale : NAN;
      store_f<T, V>(dr, i, a);
    }
  }
}

// One value of type O: the sum of num[:rows] (sum_rows: the forward's losses) or num[0] (the backward's output
// gradient), with `mean` over the count of rows whose target is not ignore_index (as a float, like torch's float32
// sum divided by an int64 count). One block: each thread sums rows in a stride, then the block.
template <typename I, typename O>
__global__ void __launch_bounds__(1024) ce_reduce_kernel(const I* __restrict__ num, const int64_t* __restrict__ target,
                                                         O* __restrict__ out, int64_t rows, int64_t ignore_index,
                                                         bool mean, bool sum_rows) {
  __shared__ float smem[32];
  __shared__ unsigned long long counted;
  if (threadIdx.x == 0) counted = 0;
  float s = 0.f;
  unsigned long long c = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    if (sum_rows) s += to_f(num[r]);
    c += mean && target[r] != ignore_index;
  }
  s = sum_rows ? block_sum(s, smem) : to_f(num[0]);
  __syncthreads();  // the count's start before the adds
  if (mean) atomicAdd(&counted, c);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = from_f<O>(mean ? s / (float)counted : s);
}

// 16-byte packs when every row start is 16-byte aligned and V is a whole number of packs.
template <typename T>
static bool packed(const void* p, int64_t n, int64_t stride) {
  constexpr int V = Pack<T>::N;
  return aligned16(p) && n % V == 0 && stride % V == 0;
}

template <typename T>
static cudaError_t launch_ce_fwd(const T* x, const int64_t* target, float* loss, float* lse, int64_t rows, int64_t n,
                                 int64_t stride, int64_t ignore_index, float smoothing, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  // threads for half the row: two packs per thread per iteration
  return launch_block_rows(true, V, ce_fwd_v2_kernel<T, V>, ce_fwd_v2_kernel<T, V>, rows, (n + 1) / 2, stream, x,
                           target, loss, lse, rows, n, stride, ignore_index, smoothing);
}

template <typename T>
static cudaError_t launch_ce_bwd(const T* x, const int64_t* target, const float* lse, const float* g, int64_t g_stride,
                                 T* dx, int64_t rows, int64_t n, int64_t stride, int64_t ignore_index, float smoothing,
                                 cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = packed<T>(x, n, stride) && aligned16(dx);
  return launch_block_rows(vec, V, ce_bwd_v1_kernel<T, V>, ce_bwd_v1_kernel<T, 1>, rows, n, stream, x, target, lse, g,
                           g_stride, dx, rows, n, stride, ignore_index, smoothing);
}

cudaError_t cross_entropy_fwd(const void* x, const int64_t* target, float* loss, float* lse, int64_t rows, int64_t n,
                              int64_t stride, int64_t ignore_index, float smoothing, DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_ce_fwd(static_cast<const T*>(x), target, loss, lse, rows, n, stride, ignore_index,
                                           smoothing, stream));
  return cudaSuccess;
}

cudaError_t cross_entropy_reduce(const void* num, DType num_dtype, bool sum_rows, const int64_t* target, void* out,
                                 DType out_dtype, int64_t rows, int64_t ignore_index, bool mean, cudaStream_t stream) {
  const int threads = (int)std::min<int64_t>(1024, std::max<int64_t>(32, (rows + 31) / 32 * 32));
  TIERED_OPS_DISPATCH(num_dtype, I,
                      TIERED_OPS_DISPATCH(out_dtype, O,
                                          ce_reduce_kernel<I, O><<<1, threads, 0, stream>>>(
                                              static_cast<const I*>(num), target, static_cast<O*>(out), rows,
                                              ignore_index, mean, sum_rows)));
  return cudaGetLastError();
}

cudaError_t cross_entropy_bwd(const void* x, const int64_t* target, const float* lse, const float* g, int64_t g_stride,
                              void* dx, int64_t rows, int64_t n, int64_t stride, int64_t ignore_index, float smoothing,
                              DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_ce_bwd(static_cast<const T*>(x), target, lse, g, g_stride, static_cast<T*>(dx),
                                           rows, n, stride, ignore_index, smoothing, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
