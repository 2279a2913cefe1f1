// qk_norm_rope: Qwen3's per-head RMSNorm of q and k (transformers' Llama form) then the rotate-half rotary embedding,
// q and k in one launch, fp32 math. A row is one (batch, head, position) of d = head_dim elements, h = d / 2:
// r = rsqrt(mean(x^2) + eps), y = round(x r) w, out[j] = y[j] c[j] - y[j+h] s[j], out[j+h] = y[j+h] c[j+h] + y[j] s[j+h].
// Backward, with g the output gradient: gy = the rotation of g by -sin, dx = r (gy w - x r mean(gy w x r)), and the
// block's sum over its rows of gy x r into its row of the (blocks, d) fp32 weight-gradient partials.
//
// Bytes: forward 1 read + 1 write of q and k, cos and sin once per (batch, position) (L2 across the heads); backward
// 2 reads + 1 write.
// Limits: head_dim even, up to 2048 (one thread a pair, one block a row at a time); q and k through their batch, head
// and position strides (last dim contiguous); gradients and outputs contiguous; grid.y is q (0) and k (1), grid.x
// blocks stride over the rows.
// Versions: v1 — one block per row at a time, a thread per rotated pair, the row's sum by block_sum.
#include "common.cuh"

namespace tiered_ops {

struct QkTensor {
  const void* x;   // q or k (strided rows)
  const void* g;   // the output gradient (contiguous; backward)
  void* out;       // output or input gradient (contiguous)
  const void* w;   // the norm's weight [d]
  float* partial;  // backward: (gridDim.x, d) weight-gradient partials
  int64_t heads, sb, sh, ss;
};

template <typename T, bool BWD>
__global__ void qk_norm_rope_v1_kernel(QkTensor q, QkTensor k, const T* __restrict__ cos, const T* __restrict__ sin,
                                       int64_t batch, int64_t seq, int64_t head_dim, int64_t cos_batch_stride,
                                       float eps) {
  __shared__ float smem[32];
  const QkTensor t = blockIdx.y == 0 ? q : k;
  const T* __restrict__ x = static_cast<const T*>(t.x);
  const T* __restrict__ w = static_cast<const T*>(t.w);
  T* __restrict__ out = static_cast<T*>(t.out);
  const int64_t half = head_dim / 2, rows = batch * t.heads * seq;
  const int64_t j = threadIdx.x;
  const bool on = j < half;
  const float w1 = on ? to_f(w[j]) : 0.f, w2 = on ? to_f(w[j + half]) : 0.f;
  float pw1 = 0.f, pw2 = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {  // the same trip count for every thread
    const int64_t s = row % seq, h = (row / seq) % t.heads, b = row / (seq * t.heads);
    const T* xr = x + b * t.sb + h * t.sh + s * t.ss;
    const T* cr = cos + b * cos_batch_stride + s * head_dim;
    const T* sr = sin + b * cos_batch_stride + s * head_dim;
    float x1 = 0.f, x2 = 0.f, c1 = 0.f, c2 = 0.f, s1 = 0.f, s2 = 0.f;
    if (on) {
      x1 = to_f(xr[j]), x2 = to_f(xr[j + half]);
      c1 = to_f(cr[j]), c2 = to_f(cr[j + half]), s1 = to_f(sr[j]), s2 = to_f(sr[j + half]);
    }
    const float r = rsqrtf(block_sum(x1 * x1 + x2 * x2, smem) / (float)head_dim + eps);
    T* orow = out + row * head_dim;
    if (!BWD) {
      const float y1 = to_f(from_f<T>(x1 * r)) * w1, y2 = to_f(from_f<T>(x2 * r)) * w2;  // rounded, then the weight
      if (on) {
        orow[j] = from_f<T>(y1 * c1 - y2 * s1);
        orow[j + half] = from_f<T>(y2 * c2 + y1 * s2);
      }
    } else {
      const T* gr = static_cast<const T*>(t.g) + row * head_dim;
      const float g1 = on ? to_f(gr[j]) : 0.f, g2 = on ? to_f(gr[j + half]) : 0.f;
      const float gy1 = g1 * c1 + g2 * s2, gy2 = g2 * c2 - g1 * s1;  // the rotation by -sin
      const float n1 = x1 * r, n2 = x2 * r, a1 = gy1 * w1, a2 = gy2 * w2;
      const float m = block_sum(a1 * n1 + a2 * n2, smem) / (float)head_dim;
      if (on) {
        orow[j] = from_f<T>(r * (a1 - n1 * m));
        orow[j + half] = from_f<T>(r * (a2 - n2 * m));
      }
      pw1 += gy1 * n1;
      pw2 += gy2 * n2;
    }
  }
  if (BWD && on) {
    t.partial[(int64_t)blockIdx.x * head_dim + j] = pw1;
    t.partial[(int64_t)blockIdx.x * head_dim + j + half] = pw2;
  }
}

cudaError_t qk_norm_rope_run(const void* q, const void* k, const void* gq, const void* gk, void* q_out, void* k_out,
                             const void* q_weight, const void* k_weight, float* q_partial, float* k_partial,
                             const void* cos, const void* sin, int64_t batch, int64_t q_heads, int64_t k_heads,
                             int64_t seq, int64_t head_dim, const int64_t* q_strides, const int64_t* k_strides,
                             int64_t cos_batch_stride, float eps, int64_t blocks, bool bwd, DType dtype,
                             cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  if (head_dim % 2 || head_dim > 2048 || blocks > 2147483647) return cudaErrorInvalidValue;
  const QkTensor tq{q, gq, q_out, q_weight, q_partial, q_heads, q_strides[0], q_strides[1], q_strides[2]};
  const QkTensor tk{k, gk, k_out, k_weight, k_partial, k_heads, k_strides[0], k_strides[1], k_strides[2]};
  const int threads = (int)((head_dim / 2 + 31) / 32 * 32);
  const dim3 grid((unsigned)blocks, 2);
  TIERED_OPS_DISPATCH(dtype, T, {
    const T* c = static_cast<const T*>(cos);
    const T* s = static_cast<const T*>(sin);
    if (bwd)
      qk_norm_rope_v1_kernel<T, true><<<grid, threads, 0, stream>>>(tq, tk, c, s, batch, seq, head_dim,
                                                                    cos_batch_stride, eps);
    else
      qk_norm_rope_v1_kernel<T, false><<<grid, threads, 0, stream>>>(tq, tk, c, s, batch, seq, head_dim,
                                                                     cos_batch_stride, eps);
    return cudaGetLastError();
  });
  return cudaSuccess;
}

}  // namespace tiered_ops
