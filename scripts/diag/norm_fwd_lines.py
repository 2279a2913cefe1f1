"""The norms' forward at rows of 4096-5120 (bf16) in one process, timed as the harness times a kernel
(timing.time_call: L2 flushed before each call): the op's Triton and CUDA tiers, a device copy of the same bytes, and
straight-line CUDA variants built here (one row a block, no grid-stride loop, P packs a thread converted to fp32 as
loaded, the weight read after the reduction), with the loads through the read-only path (`nc`), plain (`pl`) or
streaming (`cs`: ld.global.cs / st.global.cs). Each line: kernel time, fraction of the copy, registers, worst error
against a float64 reference. Run on a GPU with the extension built: PYTHONPATH=. python scripts/diag/norm_fwd_lines.py
"""
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from tiered_ops.measure.timing import time_call
from tiered_ops.tiers import cuda_ext
from tiered_ops.tiers.catalog import get_op

SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "common.cuh"
using namespace tiered_ops;
using T = __nv_bfloat16;
constexpr int V = 8;

template <int L> __device__ __forceinline__ Pack<T> ld(const T* p) {
  if constexpr (L == 0) return *reinterpret_cast<const Pack<T>*>(p);  // via a const __restrict__ below: ld.global.nc
  Pack<T> q;
  uint4& u = *reinterpret_cast<uint4*>(&q);
  if constexpr (L == 1)
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
  else
    asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
  return q;
}
template <int L> __device__ __forceinline__ void st(T* p, const float (&a)[V]) {
  Pack<T> q;
#pragma unroll
  for (int j = 0; j < V; ++j) q.v[j] = from_f<T>(a[j]);
  if constexpr (L == 2) {
    const uint4 u = *reinterpret_cast<const uint4*>(&q);
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w));
  } else {
    *reinterpret_cast<Pack<T>*>(p) = q;
  }
}

// The thread's P packs of the row at xr as floats into a (0 past the row's end), loaded as L says; the sum of f over
// them.
template <int P, int L, typename F>
__device__ __forceinline__ float load_row(const T* xr, int n, float (&a)[P][V], F f) {
  float s = 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = (p * blockDim.x + threadIdx.x) * V;
    const Pack<T> q = i < n ? ld<L>(xr + i) : Pack<T>{};
#pragma unroll
    for (int j = 0; j < V; ++j) a[p][j] = i < n ? to_f(q.v[j]) : 0.f, s += f(a[p][j]);
  }
  return s;
}

template <int P, int L>
__global__ void __launch_bounds__(1024) rms_line(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                                 int n, float eps) {
  __shared__ float smem[32];
  const int64_t base = (int64_t)blockIdx.x * n;
  float a[P][V];
  const float ss = load_row<P, L>(x + base, n, a, [](float v) { return v * v; });
  const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = (p * blockDim.x + threadIdx.x) * V;
    if (i < n) {
      const Pack<T> qw = ld<L == 2 ? 0 : L>(w + i);
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = to_f(from_f<T>(a[p][j] * rstd)) * to_f(qw.v[j]);
      st<L>(y + base + i, o);
    }
  }
}

template <int P, int L>
__global__ void __launch_bounds__(1024) ln_line(const T* __restrict__ x, const T* __restrict__ w,
                                                const T* __restrict__ b, T* __restrict__ y, float* mean_out,
                                                float* rstd_out, int n, float eps) {
  __shared__ float smem[32];
  const int64_t base = (int64_t)blockIdx.x * n;
  float a[P][V];
  const float mean = block_sum(load_row<P, L>(x + base, n, a, [](float v) { return v; }), smem) / (float)n;
  float ss = 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = (p * blockDim.x + threadIdx.x) * V;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = i < n ? a[p][j] - mean : 0.f;
      ss += d * d;
    }
  }
  const float rstd = rsqrtf(block_sum(ss, smem) / (float)n + eps);
  if (threadIdx.x == 0) mean_out[blockIdx.x] = mean, rstd_out[blockIdx.x] = rstd;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = (p * blockDim.x + threadIdx.x) * V;
    if (i < n) {
      const Pack<T> qw = ld<L == 2 ? 0 : L>(w + i), qb = ld<L == 2 ? 0 : L>(b + i);
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = (a[p][j] - mean) * rstd * to_f(qw.v[j]) + to_f(qb.v[j]);
      st<L>(y + base + i, o);
    }
  }
}

static int threads_for(int n, int P) { int t = (n / V + P - 1) / P; return (t + 31) / 32 * 32; }

template <int P, int L>
std::vector<int64_t> rms(torch::Tensor x, torch::Tensor w, torch::Tensor y) {
  const int n = x.size(-1), rows = x.numel() / n, t = threads_for(n, P);
  auto k = rms_line<P, L>;
  if (rows) k<<<rows, t, 0, c10::cuda::getCurrentCUDAStream()>>>((const T*)x.data_ptr(), (const T*)w.data_ptr(),
                                                                 (T*)y.data_ptr(), n, 1e-6f);
  cudaFuncAttributes at;
  cudaFuncGetAttributes(&at, k);
  return {t, at.numRegs};
}

template <int P, int L>
std::vector<int64_t> ln(torch::Tensor x, torch::Tensor w, torch::Tensor b, torch::Tensor y, torch::Tensor m,
                        torch::Tensor r) {
  const int n = x.size(-1), rows = x.numel() / n, t = threads_for(n, P);
  auto k = ln_line<P, L>;
  if (rows) k<<<rows, t, 0, c10::cuda::getCurrentCUDAStream()>>>(
      (const T*)x.data_ptr(), (const T*)w.data_ptr(), (const T*)b.data_ptr(), (T*)y.data_ptr(),
      (float*)m.data_ptr(), (float*)r.data_ptr(), n, 1e-5f);
  cudaFuncAttributes at;
  cudaFuncGetAttributes(&at, k);
  return {t, at.numRegs};
}
"""
NAMES = {f"rms_{p}_{ln}": (p, i) for p in (1, 2, 4) for i, ln in enumerate(("nc", "pl", "cs"))}
DEFS = "\n".join(f"template std::vector<int64_t> rms<{p}, {i}>(torch::Tensor, torch::Tensor, torch::Tensor);\n"
                 f"template std::vector<int64_t> ln<{p}, {i}>(torch::Tensor, torch::Tensor, torch::Tensor, "
                 "torch::Tensor, torch::Tensor, torch::Tensor);" for p, i in NAMES.values())
BIND = "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + "\n".join(
    f'm.def("rms_{p}_{i}", &rms<{p}, {i}>); m.def("ln_{p}_{i}", &ln<{p}, {i}>);' for p, i in NAMES.values()) + "\n}"

root = Path(__file__).resolve().parents[2]
ext = load_inline("norm_fwd_lines", cpp_sources="", cuda_sources=SRC + DEFS + BIND,
                  extra_include_paths=[str(root / "cuda_src")], extra_cuda_cflags=["-O3", "-std=c++17"],
                  verbose=False)
dev = torch.device("cuda")
assert cuda_ext.load() is None
for op in ("rms_norm", "layer_norm"):
    spec = get_op(op)
    for shape in ((8192, 4096), (16384, 4096), (4096, 5120)):
        p = spec.problem(shape)
        inp = spec.make_inputs(p, torch.bfloat16, dev, 0)
        x = inp.args[0]
        rows, n = shape
        src = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        copy = time_call(lambda: dst.copy_(src), dev).p50_us
        print(f"{op} {rows}x{n} bf16: copy {copy:.1f} us", flush=True)
        for impl in ("eager", "triton", "cuda"):
            fn = spec.impls[impl].unchecked
            us = time_call(lambda fn=fn: fn(*inp.args, **inp.kwargs), dev).p50_us
            print(f"  {impl:12s} {us:8.1f} us  {copy / us:.3f} of copy", flush=True)
        w = torch.rand(n, device=dev, dtype=torch.bfloat16) + 0.5
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        m = torch.empty(rows, device=dev)
        r = torch.empty(rows, device=dev)
        x64 = x.double()
        if op == "rms_norm":
            ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        else:
            ref = torch.nn.functional.layer_norm(x64, (n,), w.double(), b.double(), 1e-5)
        for name, (pk, li) in NAMES.items():
            f = getattr(ext, f"{'rms' if op == 'rms_norm' else 'ln'}_{pk}_{li}")
            call = (lambda f=f: f(x, w, y)) if op == "rms_norm" else (lambda f=f: f(x, w, b, y, m, r))
            t, regs = call()
            if t > 1024:
                continue
            torch.cuda.synchronize()
            err = ((y.double() - ref).abs() / (ref.abs() + 1e-2)).max().item()
            us = time_call(call, dev).p50_us
            print(f"  {name.replace('rms', 'line'):12s} {us:8.1f} us  {copy / us:.3f} of copy"
                  f"  {t:4d} thr {regs:3d} regs"
                  f"  err {err:.1e}", flush=True)
