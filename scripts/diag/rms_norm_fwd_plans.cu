// rms_norm's forward (bf16 rows held in registers, w as x's dtype) at a few launch shapes, side by side with a device copy
// of the same bytes in one run (standalone: the project's common.cuh, no torch). Variants: the op's v2 kernel as it is
// (w read after the row's reduction), w read before it (its latency under x's), and both with fewer packs a thread and
// more threads a row. Each line: kernel time (median of 25), fraction of the copy, worst relative error of three rows
// against a float64 host reference.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I cuda_src scripts/diag/rms_norm_fwd_plans.cu -o rp
//   ./rp 16384 4096
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common.cuh"
#include "diag_timing.cuh"

using namespace tiered_ops;
using T = __nv_bfloat16;

// EARLY: w's packs loaded before the row's reduction. LB: the launch bound's threads (1024: the op's).
template <int P, bool EARLY, int LB, int MINB = 1>
__global__ void __launch_bounds__(LB, MINB) rn(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                         int64_t rows, int n, float eps, int tpr) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  for_reg_rows(rows, n, tpr, [&](const RegRow& row) {
    const int64_t r = row.r;
    Pack<T> q[P], qw[P];
    if (EARLY) row.each<P, V>([&](int p, int i) { qw[p] = load_pack(w + i); });
    float ss = 0.f;
    row.load<P, V>(x + r * n, q, [&](float v) { ss += v * v; });
    const float rstd = rsqrtf(group_sum(ss, tpr, smem) / (float)n + eps);
    row.each<P, V>([&](int p, int i) {
      float pw[V], a[V];
      if (EARLY) {
#pragma unroll
        for (int j = 0; j < V; ++j) pw[j] = to_f(qw[p].v[j]);
      } else {
        load_f<T, V>(w, i, pw);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = to_f(from_f<T>(to_f(q[p].v[j]) * rstd)) * pw[j];
      store_f<T, V>(y, r * n + i, a);
    });
  });
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// A persistent grid, a row a block at a time: S rows in flight in shared memory (cp.async, each thread copying and
// reading only its own packs, so its wait is all the ordering they need), w's packs in registers once for every row.
template <int P, int S, int MINB = 1>
__global__ void __launch_bounds__(256, MINB) rn_pipe(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                               int64_t rows, int n, float eps, int tpr) {
  constexpr int V = Pack<T>::N;
  extern __shared__ __align__(16) unsigned char raw[];
  Pack<T>* ring = reinterpret_cast<Pack<T>*>(raw);
  __shared__ float smem[32];
  const int tid = threadIdx.x, nt = blockDim.x, npk = n / V;
  const int64_t G = gridDim.x;
  Pack<T> qw[P];  // raw: converted where used
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int j = p * nt + tid;
    if (j < npk) qw[p] = load_pack(w + (int64_t)j * V);
  }
  auto issue = [&](int64_t r, int stage) {
    if (r < rows) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int j = p * nt + tid;
        if (j < npk) cp_async16(ring + (stage * P + p) * nt + tid, x + r * n + (int64_t)j * V);
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue(blockIdx.x + s * G, s);
  int k = 0;
  for (int64_t r = blockIdx.x; r < rows; r += G, ++k) {
    issue(r + (S - 1) * G, (k + S - 1) % S);
    cp_wait<S - 1>();
    const int st = k % S;
    Pack<T> q[P];
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int j = p * nt + tid;
      if (j < npk) {
        q[p] = ring[(st * P + p) * nt + tid];
#pragma unroll
        for (int e = 0; e < V; ++e) ss += to_f(q[p].v[e]) * to_f(q[p].v[e]);
      }
    }
    const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int j = p * nt + tid;
      if (j < npk) {
        float a[V];
#pragma unroll
        for (int e = 0; e < V; ++e) a[e] = to_f(from_f<T>(to_f(q[p].v[e]) * rstd)) * to_f(qw[p].v[e]);
        store_f<T, V>(y, r * n + (int64_t)j * V, a);
      }
    }
  }
  cp_wait<0>();
}

static double check(const T* dx, const T* dw, const T* dy, long rows, long n) {
  std::vector<T> hx(n), hy(n), hw(n);
  CK(cudaMemcpy(hw.data(), dw, n * 2, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (long r : {0L, rows / 2, rows - 1}) {
    CK(cudaMemcpy(hx.data(), dx + r * n, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hy.data(), dy + r * n, n * 2, cudaMemcpyDeviceToHost));
    double ss = 0;
    for (long i = 0; i < n; ++i) ss += (double)__bfloat162float(hx[i]) * __bfloat162float(hx[i]);
    const double rstd = 1.0 / std::sqrt(ss / n + 1e-6);
    for (long i = 0; i < n; ++i) {
      const double ref = __bfloat162float(hx[i]) * rstd * __bfloat162float(hw[i]);
      worst = std::max(worst, std::fabs(__bfloat162float(hy[i]) - ref) / (std::fabs(ref) + 1e-2));
    }
  }
  return worst;
}

int main(int argc, char** argv) {
  const long rows = atol(argv[1]), n = atol(argv[2]);
  T *x, *y, *z, *w;
  const size_t bytes = (size_t)rows * n * 2;
  CK(cudaMalloc(&x, bytes));
  CK(cudaMalloc(&y, bytes));
  CK(cudaMalloc(&z, bytes));
  CK(cudaMalloc(&w, n * 2));
  fill<<<1024, 256>>>(x, rows * n, 1234u, 4.f, 0.f);
  fill<<<64, 256>>>(w, n, 77u, 1.f, 1.f);
  const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(z, x, bytes, cudaMemcpyDeviceToDevice)); }, 25, 5);
  printf("%ld x %ld bf16: copy %.1f us\n", rows, n, copy_ms * 1e3);
  auto run = [&](const char* name, auto kern, int P, int threads_per_block) {
    constexpr int V = Pack<T>::N;
    const long packs = n / V;
    int tpr = 1;
    while ((long)tpr * P < packs) tpr *= 2;
    if (tpr > 1024) return;
    const int threads = std::max(tpr, threads_per_block), rpb = threads / tpr;
    const unsigned blocks = (unsigned)((rows + rpb - 1) / rpb);
    const float ms = time_ms([&] { kern<<<blocks, threads>>>(x, w, y, rows, (int)n, 1e-6f, tpr); }, 25, 5);
    cudaFuncAttributes at;
    CK(cudaFuncGetAttributes(&at, kern));
    const double err = check(x, w, y, rows, n);
    printf("%-34s P%d tpr%-4d %4d thr %3d regs %8.1f us  %.3f of copy  err %.1e\n", name, P, tpr, threads, at.numRegs,
           ms * 1e3, copy_ms / ms, err);
    CK(cudaMemset(y, 0, bytes));
  };
  run("the op's (w after the reduction)", rn<4, false, 1024>, 4, 128);
  run("w before the reduction", rn<4, true, 1024>, 4, 128);
  run("w before, bound 128", rn<4, true, 128>, 4, 128);
  run("w after, 2 packs", rn<2, false, 1024>, 2, 128);
  run("w before, 2 packs", rn<2, true, 1024>, 2, 128);
  run("w before, 2 packs, bound 256", rn<2, true, 256>, 2, 256);
  run("w before, 1 pack", rn<1, true, 1024>, 1, 128);
  run("w before, 8 packs, bound 128", rn<8, true, 128>, 8, 128);
  auto pipe = [&](const char* name, auto kern, int P, int S, int per_sm) {
    constexpr int V = Pack<T>::N;
    const long packs = n / V;
    int nt = 32;
    while ((long)nt * P < packs) nt *= 2;
    if (nt > 256) return;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t smem = (size_t)S * P * nt * 16;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const unsigned blocks = (unsigned)std::min<long>(rows, (long)sms * per_sm);
    const float ms = time_ms([&] { kern<<<blocks, nt, smem>>>(x, w, y, rows, (int)n, 1e-6f, nt); }, 25, 5);
    CK(cudaGetLastError());
    cudaFuncAttributes at;
    CK(cudaFuncGetAttributes(&at, kern));
    const double err = check(x, w, y, rows, n);
    printf("%-34s P%d S%d %4d thr %3d regs %4u blocks %8.1f us  %.3f of copy  err %.1e\n", name, P, S, nt, at.numRegs,
           blocks, ms * 1e3, copy_ms / ms, err);
    CK(cudaMemset(y, 0, bytes));
  };
  run("w after, 2 packs, 8 blocks an SM", rn<2, false, 256, 8>, 2, 256);
  run("w after, 2 packs, 6 blocks an SM", rn<2, false, 256, 6>, 2, 256);
  run("w after, 1 pack, 4 blocks an SM", rn<1, false, 512, 4>, 1, 512);
  pipe("pipelined rows, 8 an SM", rn_pipe<2, 3, 8>, 2, 3, 8);
  pipe("pipelined rows, 6 an SM", rn_pipe<2, 3, 6>, 2, 3, 6);
  pipe("pipelined rows, 6 an SM", rn_pipe<2, 2, 6>, 2, 2, 6);
  pipe("pipelined rows", rn_pipe<4, 2>, 4, 2, 8);
  pipe("pipelined rows", rn_pipe<4, 3>, 4, 3, 8);
  pipe("pipelined rows", rn_pipe<4, 4>, 4, 4, 6);
  pipe("pipelined rows", rn_pipe<4, 3>, 4, 3, 6);
  pipe("pipelined rows", rn_pipe<2, 3>, 2, 3, 8);
  pipe("pipelined rows", rn_pipe<2, 4>, 2, 4, 8);
  return 0;
}
