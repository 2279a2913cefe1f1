// swiglu: out = act(gate) * up elementwise over contiguous tensors, act silu, gelu (tanh form) or gelu (erf form);
// fp32 math, one rounding to the dtype. Backward in one pass, recomputing the activation from gate:
// dgate = dy * up * act'(gate), dup = dy * act(gate).
//
// Bytes: forward 2 reads + 1 write per element; backward 3 reads + 2 writes; no reuse, so these are the floors.
// Limits: 64-bit indexing (tensors over 2^31 elements); grid-stride loops over at most 65535 * 64 blocks; 16-byte
// loads when every pointer is 16-byte aligned, else one element per thread.
// Special values: act at +-inf is its limit (+inf there, 0 at -inf), act' too (1 at +inf, 0 at -inf).
// Versions: v1 — grid-stride over 16-byte packs, scalar tail; the activation a template parameter.
#include "common.cuh"

namespace tiered_ops {

// The activation codes of swiglu.cpp: 0 silu, 1 gelu (tanh form), 2 gelu (erf form).
template <int ACT>
__device__ __forceinline__ float swiglu_act(float v) {
  if (v == -INFINITY) return 0.f;  // the limit; the formulas give -inf * 0 = NaN
  if (ACT == 0) return v / (1.f + __expf(-v));
  if (ACT == 1) return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
}

template <int ACT>
__device__ __forceinline__ float swiglu_act_grad(float v) {
  if (isinf(v)) return v > 0.f ? 1.f : 0.f;  // the limits, not +-inf * 0
  if (ACT == 0) {
    const float s = 1.f / (1.f + __expf(-v));
    return s * (1.f + v * (1.f - s));
  }
  if (ACT == 1) {
    const float t = tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v));
    return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * 0.7978845608028654f * (1.f + 0.134145f * v * v);
  }
  return 0.5f * (1.f + erff(v * 0.7071067811865476f)) + v * 0.3989422804014327f * __expf(-0.5f * v * v);
}

template <typename T, int V, int ACT>
__global__ void swiglu_v1_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                                 int64_t numel) {
  const int64_t units = numel / V, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < units; p += stride) {
    float g[V], u[V];
    load_f<T, V>(gate, p * V, g);
    load_f<T, V>(up, p * V, u);
#pragma unroll
    for (int j = 0; j < V; ++j) g[j] = swiglu_act<ACT>(g[j]) * u[j];
    store_f<T, V>(out, p * V, g);
  }
  const int64_t i = units * V + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;  // tail: numel % V elements
  if (V > 1 && blockIdx.x == 0 && i < numel) out[i] = from_f<T>(swiglu_act<ACT>(to_f(gate[i])) * to_f(up[i]));
}

template <typename T, int V, int ACT>
__global__ void swiglu_bwd_v1_kernel(const T* __restrict__ dy, const T* __restrict__ gate, const T* __restrict__ up,
                                     T* __restrict__ dgate, T* __restrict__ dup, int64_t numel) {
  const int64_t units = numel / V, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < units; p += stride) {
    float d[V], g[V], u[V];
    load_f<T, V>(dy, p * V, d);
    load_f<T, V>(gate, p * V, g);
    load_f<T, V>(up, p * V, u);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float v = g[j];
      g[j] = d[j] * u[j] * swiglu_act_grad<ACT>(v);
      u[j] = d[j] * swiglu_act<ACT>(v);
    }
    store_f<T, V>(dgate, p * V, g);
    store_f<T, V>(dup, p * V, u);
  }
  const int64_t i = units * V + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;  // tail: numel % V elements
  if (V > 1 && blockIdx.x == 0 && i < numel) {
    const float d = to_f(dy[i]), v = to_f(gate[i]);
    dgate[i] = from_f<T>(d * to_f(up[i]) * swiglu_act_grad<ACT>(v));
    dup[i] = from_f<T>(d * swiglu_act<ACT>(v));
  }
}

static int64_t swiglu_blocks(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return blocks < 1 ? 1 : (blocks > 65535 * 64 ? 65535 * 64 : blocks);
}

template <typename T, int ACT>
static cudaError_t launch_swiglu(const T* dy, const T* gate, const T* up, T* out, T* dup, int64_t numel,
                                 cudaStream_t stream) {
  constexpr int threads = 256, V = Pack<T>::N;
  const bool vec = aligned16(gate) && aligned16(up) && aligned16(out) && (!dy || (aligned16(dy) && aligned16(dup)));
  const unsigned blocks = (unsigned)swiglu_blocks(vec ? numel / V : numel, threads);
  if (dy == nullptr) {
    if (vec)
      swiglu_v1_kernel<T, V, ACT><<<blocks, threads, 0, stream>>>(gate, up, out, numel);
    else
      swiglu_v1_kernel<T, 1, ACT><<<blocks, threads, 0, stream>>>(gate, up, out, numel);
  } else if (vec) {
    swiglu_bwd_v1_kernel<T, V, ACT><<<blocks, threads, 0, stream>>>(dy, gate, up, out, dup, numel);
  } else {
    swiglu_bwd_v1_kernel<T, 1, ACT><<<blocks, threads, 0, stream>>>(dy, gate, up, out, dup, numel);
  }
  return cudaGetLastError();
}

// dy null: the forward (out = act(gate) * up); else the backward (out = dgate, dup).
template <typename T>
static cudaError_t launch_swiglu_act(const void* dy, const void* gate, const void* up, void* out, void* dup,
                                     int64_t numel, int act, cudaStream_t stream) {
  const T *d = static_cast<const T*>(dy), *g = static_cast<const T*>(gate), *u = static_cast<const T*>(up);
  T *o = static_cast<T*>(out), *du = static_cast<T*>(dup);
  switch (act) {
    case 0: return launch_swiglu<T, 0>(d, g, u, o, du, numel, stream);
    case 1: return launch_swiglu<T, 1>(d, g, u, o, du, numel, stream);
    case 2: return launch_swiglu<T, 2>(d, g, u, o, du, numel, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t swiglu_fwd(const void* gate, const void* up, void* out, int64_t numel, int act, DType dtype,
                       cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T, return launch_swiglu_act<T>(nullptr, gate, up, out, nullptr, numel, act, stream));
  return cudaSuccess;
}

cudaError_t swiglu_bwd(const void* dy, const void* gate, const void* up, void* dgate, void* dup, int64_t numel,
                       int act, DType dtype, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T, return launch_swiglu_act<T>(dy, gate, up, dgate, dup, numel, act, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
