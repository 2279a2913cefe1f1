// rotary_embedding: transformers' apply_rotary_pos_emb (rotate-half) of q and k in one launch, fp32 math, one
// rounding. A row is one (batch, head, position) of head_dim elements; with r = rotary_dim / 2:
// out[j] = x[j] c[j] - x[j+r] s[j], out[j+r] = x[j+r] c[j+r] + x[j] s[j+r] (j < r), out[j] = x[j] past 2r.
// Backward (the rotation by -sin): dx[j] = g[j] c[j] + g[j+r] s[j+r], dx[j+r] = g[j+r] c[j+r] - g[j] s[j].
//
// Bytes: 1 read + 1 write of q and k per element, cos and sin once per (batch, position) (L2 across the heads).
// Limits: q and k read through their batch, head and position strides (a transpose's view in place; the last dim
// contiguous); cos and sin contiguous [batch or 1, seq, rotary_dim] (cos_batch_stride 0 broadcasts); outputs
// contiguous. 64-bit indexing; grid.y is q (0) and k (1), grid.x capped and grid-strided.
// Versions: v1 — one thread per rotated pair or passed element.
#include "common.cuh"

namespace tiered_ops {

struct RopeTensor {
  const void* x;
  void* out;
  int64_t heads, sb, sh, ss;  // heads and the batch, head and position strides of x (elements)
};

template <typename T, bool BWD>
__global__ void rotary_embedding_v1_kernel(RopeTensor q, RopeTensor k, const T* __restrict__ cos,
                                           const T* __restrict__ sin, int64_t batch, int64_t seq, int64_t head_dim,
                                           int64_t half, int64_t cos_batch_stride) {
  const RopeTensor t = blockIdx.y == 0 ? q : k;
  const T* __restrict__ x = static_cast<const T*>(t.x);
  T* __restrict__ out = static_cast<T*>(t.out);
  const int64_t width = half + (head_dim - 2 * half);  // work items a row: rotated pairs, then passed elements
  const int64_t total = batch * t.heads * seq * width;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / width, j = i - row * width;
    const int64_t s = row % seq, h = (row / seq) % t.heads, b = row / (seq * t.heads);
    const T* xr = x + b * t.sb + h * t.sh + s * t.ss;
    T* orow = out + row * head_dim;
    if (j < half) {
      const T* cr = cos + b * cos_batch_stride + s * 2 * half;
      const T* sr = sin + b * cos_batch_stride + s * 2 * half;
      const float x1 = to_f(xr[j]), x2 = to_f(xr[j + half]);
      const float c1 = to_f(cr[j]), c2 = to_f(cr[j + half]), s1 = to_f(sr[j]), s2 = to_f(sr[j + half]);
      orow[j] = from_f<T>(BWD ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
      orow[j + half] = from_f<T>(BWD ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    } else {
      const int64_t c = half + j;  // 2 * half + (j - half)
      orow[c] = xr[c];
    }
  }
}

template <typename T>
static cudaError_t launch_rope(RopeTensor q, RopeTensor k, const T* cos, const T* sin, int64_t batch, int64_t seq,
                               int64_t head_dim, int64_t half, int64_t cos_batch_stride, bool bwd,
                               cudaStream_t stream) {
  constexpr int threads = 256;
  const int64_t width = half + (head_dim - 2 * half);
  const int64_t most = batch * seq * width * (q.heads > k.heads ? q.heads : k.heads);
  int64_t blocks = (most + threads - 1) / threads;
  blocks = blocks < 1 ? 1 : (blocks > 65535 * 16 ? 65535 * 16 : blocks);
  const dim3 grid((unsigned)blocks, 2);
  if (bwd)
    rotary_embedding_v1_kernel<T, true><<<grid, threads, 0, stream>>>(q, k, cos, sin, batch, seq, head_dim, half,
                                                                      cos_batch_stride);
  else
    rotary_embedding_v1_kernel<T, false><<<grid, threads, 0, stream>>>(q, k, cos, sin, batch, seq, head_dim, half,
                                                                       cos_batch_stride);
  return cudaGetLastError();
}

// q_strides / k_strides: the batch, head and position strides (elements); outputs contiguous [batch, heads, seq, d].
cudaError_t rotary_embedding_run(const void* q, const void* k, void* q_out, void* k_out, const void* cos,
                                 const void* sin, int64_t batch, int64_t q_heads, int64_t k_heads, int64_t seq,
                                 int64_t head_dim, int64_t rotary_dim, const int64_t* q_strides,
                                 const int64_t* k_strides, int64_t cos_batch_stride, bool bwd, DType dtype,
                                 cudaStream_t stream) {
  if (batch * seq == 0 || q_heads + k_heads == 0) return cudaSuccess;
  const RopeTensor tq{q, q_out, q_heads, q_strides[0], q_strides[1], q_strides[2]};
  const RopeTensor tk{k, k_out, k_heads, k_strides[0], k_strides[1], k_strides[2]};
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_rope(tq, tk, static_cast<const T*>(cos), static_cast<const T*>(sin), batch, seq,
                                         head_dim, rotary_dim / 2, cos_batch_stride, bwd, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
