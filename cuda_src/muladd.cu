// muladd: out = a * b + c elementwise over contiguous tensors, fp32 fma, one rounding to the dtype.
//
// Bytes: 3 reads + 1 write per element; no reuse, so 4 * numel * sizeof(T) is also the floor.
// Limits: 64-bit indexing (tensors over 2^31 elements); 16-byte loads when all four pointers are
// 16-byte aligned, else the scalar kernel.
// Versions: v1 — grid-stride over 16-byte packs, scalar tail.
// Backward: (da, db) = (g * b, g * a) in one pass: 3 reads + 2 writes per element (dc is g itself).
#include "common.cuh"

namespace tiered_ops {

template <typename T>
__global__ void muladd_v1_vec_kernel(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ c,
                                     T* __restrict__ out, int64_t numel) {
  constexpr int V = Pack<T>::N;
  const int64_t packs = numel / V;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < packs; p += stride) {
    const Pack<T> pa = reinterpret_cast<const Pack<T>*>(a)[p];
    const Pack<T> pb = reinterpret_cast<const Pack<T>*>(b)[p];
    const Pack<T> pc = reinterpret_cast<const Pack<T>*>(c)[p];
    Pack<T> q;
#pragma unroll
    for (int j = 0; j < V; ++j) q.v[j] = from_f<T>(fmaf(to_f(pa.v[j]), to_f(pb.v[j]), to_f(pc.v[j])));
    reinterpret_cast<Pack<T>*>(out)[p] = q;
  }
  // Tail: the last numel % V elements, one per thread of the first block.
  const int64_t i = packs * V + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (blockIdx.x == 0 && i < numel) out[i] = from_f<T>(fmaf(to_f(a[i]), to_f(b[i]), to_f(c[i])));
}

template <typename T>
__global__ void muladd_v1_scalar_kernel(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ c,
                                        T* __restrict__ out, int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride)
    out[i] = from_f<T>(fmaf(to_f(a[i]), to_f(b[i]), to_f(c[i])));
}

template <typename T>
static cudaError_t launch_muladd(const T* a, const T* b, const T* c, T* out, int64_t numel, cudaStream_t stream) {
  constexpr int threads = 256;
  const bool vec = aligned16(a) && aligned16(b) && aligned16(c) && aligned16(out);
  const int64_t work = vec ? numel / Pack<T>::N : numel;
  int64_t blocks = (work + threads - 1) / threads;
  blocks = blocks < 1 ? 1 : (blocks > 65535 * 64 ? 65535 * 64 : blocks);
  if (vec)
    muladd_v1_vec_kernel<T><<<(unsigned)blocks, threads, 0, stream>>>(a, b, c, out, numel);
  else
    muladd_v1_scalar_kernel<T><<<(unsigned)blocks, threads, 0, stream>>>(a, b, c, out, numel);
  return cudaGetLastError();
}

template <typename T, int V>
__global__ void muladd_bwd_v1_kernel(const T* __restrict__ g, const T* __restrict__ a, const T* __restrict__ b,
                                     T* __restrict__ da, T* __restrict__ db, int64_t numel) {
  const int64_t units = numel / V, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < units; p += stride) {
    float vg[V], va[V], vb[V];
    load_f<T, V>(g, p * V, vg);
    load_f<T, V>(a, p * V, va);
    load_f<T, V>(b, p * V, vb);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float t = va[j];
      va[j] = vg[j] * vb[j];
      vb[j] = vg[j] * t;
    }
    store_f<T, V>(da, p * V, va);
    store_f<T, V>(db, p * V, vb);
  }
  const int64_t i = units * V + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;  // tail: numel % V elements
  if (V > 1 && blockIdx.x == 0 && i < numel) {
    const float vg = to_f(g[i]);
    da[i] = from_f<T>(vg * to_f(b[i]));
    db[i] = from_f<T>(vg * to_f(a[i]));
  }
}

template <typename T>
static cudaError_t launch_muladd_bwd(const T* g, const T* a, const T* b, T* da, T* db, int64_t numel,
                                     cudaStream_t stream) {
  constexpr int threads = 256, V = Pack<T>::N;
  const bool vec = aligned16(g) && aligned16(a) && aligned16(b) && aligned16(da) && aligned16(db);
  const int64_t work = vec ? numel / V : numel;
  int64_t blocks = (work + threads - 1) / threads;
  blocks = blocks < 1 ? 1 : (blocks > 65535 * 64 ? 65535 * 64 : blocks);
  if (vec)
    muladd_bwd_v1_kernel<T, V><<<(unsigned)blocks, threads, 0, stream>>>(g, a, b, da, db, numel);
  else
    muladd_bwd_v1_kernel<T, 1><<<(unsigned)blocks, threads, 0, stream>>>(g, a, b, da, db, numel);
  return cudaGetLastError();
}

cudaError_t muladd_bwd(const void* g, const void* a, const void* b, void* da, void* db, int64_t numel, DType dtype,
                       cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_muladd_bwd(static_cast<const T*>(g), static_cast<const T*>(a),
                                               static_cast<const T*>(b), static_cast<T*>(da), static_cast<T*>(db),
                                               numel, stream));
  return cudaSuccess;
}

cudaError_t muladd_fwd(const void* a, const void* b, const void* c, void* out, int64_t numel, DType dtype,
                       cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_muladd(static_cast<const T*>(a), static_cast<const T*>(b),
                                           static_cast<const T*>(c), static_cast<T*>(out), numel, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
