// gelu: y = gelu(x + bias[i % n]) elementwise over contiguous x (bias over the last dim, optional), fp32
// math, one rounding; erf form or tanh approximation, as torch.nn.functional.gelu. Backward: dx = dy * gelu'(v).
//
// Bytes: forward 1 read + 1 write per element (+ bias, cached); backward 2 reads + 1 write (dbias is summed
// by the binding from dx).
// Limits: 64-bit indexing (tensors over 2^31 elements); 16-byte loads when the pointers are 16-byte aligned
// and the bias row length is a multiple of the pack width, else the scalar kernel.
// Versions: v1 — grid-stride over 16-byte packs, scalar tail.
#include "common.cuh"

namespace tiered_ops {

__device__ __forceinline__ float gelu_f(float v, bool tanh_approx) {
  if (v == -INFINITY) return 0.f;  // the limit; the formula gives -inf * 0 = NaN
  if (tanh_approx) return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
}

__device__ __forceinline__ float gelu_grad_f(float v, bool tanh_approx) {
  if (isinf(v)) return v > 0.f ? 1.f : 0.f;  // the limits, not +-inf * 0
  if (tanh_approx) {
    const float t = tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v));
    return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * 0.7978845608028654f * (1.f + 0.134145f * v * v);
  }
  return 0.5f * (1.f + erff(v * 0.7071067811865476f)) + v * 0.3989422804014327f * __expf(-0.5f * v * v);
}

// dy null: forward (out = gelu(v)); else backward (out = dy * gelu'(v)).
template <typename T, int V>
__global__ void gelu_v1_kernel(const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ dy,
                               T* __restrict__ out, int64_t numel, int64_t n, bool tanh_approx) {
  const int64_t units = numel / V, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < units; p += stride) {
    float v[V], b[V], g[V];
    load_f<T, V>(x, p * V, v);
    if (bias) load_f<T, V>(bias, (p * V) % n, b);  // n % V == 0 on this path: a pack never wraps a row
    if (dy) load_f<T, V>(dy, p * V, g);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float u = bias ? v[j] + b[j] : v[j];
      v[j] = dy ? g[j] * gelu_grad_f(u, tanh_approx) : gelu_f(u, tanh_approx);
    }
    store_f<T, V>(out, p * V, v);
  }
  const int64_t i = units * V + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;  // tail: numel % V elements
  if (V > 1 && blockIdx.x == 0 && i < numel) {
    const float u = bias ? to_f(x[i]) + to_f(bias[i % n]) : to_f(x[i]);
    out[i] = from_f<T>(dy ? to_f(dy[i]) * gelu_grad_f(u, tanh_approx) : gelu_f(u, tanh_approx));
  }
}

template <typename T>
static cudaError_t launch_gelu(const T* x, const T* bias, const T* dy, T* out, int64_t numel, int64_t n,
                               bool tanh_approx, cudaStream_t stream) {
  constexpr int threads = 256, V = Pack<T>::N;
  const bool vec = aligned16(x) && aligned16(out) && (!dy || aligned16(dy)) && (!bias || (aligned16(bias) && n % V == 0));
  const int64_t work = vec ? numel / V : numel;
  int64_t blocks = (work + threads - 1) / threads;
  blocks = blocks < 1 ? 1 : (blocks > 65535 * 64 ? 65535 * 64 : blocks);
  if (vec)
    gelu_v1_kernel<T, V><<<(unsigned)blocks, threads, 0, stream>>>(x, bias, dy, out, numel, n, tanh_approx);
  else
    gelu_v1_kernel<T, 1><<<(unsigned)blocks, threads, 0, stream>>>(x, bias, dy, out, numel, n, tanh_approx);
  return cudaGetLastError();
}

cudaError_t gelu_fwd(const void* x, const void* bias, void* y, int64_t numel, int64_t n, bool tanh_approx,
                     DType dtype, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_gelu(static_cast<const T*>(x), static_cast<const T*>(bias), (const T*)nullptr,
                                         static_cast<T*>(y), numel, n, tanh_approx, stream));
  return cudaSuccess;
}

cudaError_t gelu_bwd(const void* dy, const void* x, const void* bias, void* dx, int64_t numel, int64_t n,
                     bool tanh_approx, DType dtype, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_gelu(static_cast<const T*>(x), static_cast<const T*>(bias),
                                         static_cast<const T*>(dy), static_cast<T*>(dx), numel, n, tanh_approx,
                                         stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
