// What the standalone diagnostics (softmax_plans.cu, layer_norm_plans.cu, rms_norm_fwd_plans.cu,
// rms_norm_bwd_versions.cu, layer_norm_bwd_ring.cu) share: a CUDA call checked (the file, line and error, then exit),
// their inputs filled, and a launch's kernel time as their tables give it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                            \
  do {                                                                   \
    cudaError_t e_ = (x);                                                \
    if (e_ != cudaSuccess) {                                             \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));  \
      exit(1);                                                           \
    }                                                                    \
  } while (0)

// The median of `reps` timed calls of f (ms, CUDA events, each waited on), after `warm` untimed ones. ONCE=1 in the
// environment: f launched once, untimed (a profiler's run), 1 returned.
template <class F>
static float time_ms(F f, int reps = 15, int warm = 3) {
  if (getenv("ONCE")) {
    f();
    CK(cudaDeviceSynchronize());
    return 1.f;
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// x[i] = a hash of (i, seed) spread uniformly over [shift - scale / 2, shift + scale / 2), as T (float or bf16).
template <typename T>
__global__ void fill(T* x, long n, unsigned seed, float scale, float shift) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    x[i] = T(((h & 0xffffff) / 16777216.f - 0.5f) * scale + shift);
  }
}
