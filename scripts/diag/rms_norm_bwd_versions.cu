// rms_norm backward (and forward) of one version of cuda_src, timed standalone (8192x4096 bf16 and the like), with the
// harness's L2 flush before each timed call and a device copy of the same bytes for scale. A version is a folder holding
// rms_norm.cu, norm_grads.cuh, common.cuh and launchers.h (`git show <commit>:cuda_src/<file>`); build and run:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I <version> -I scripts/diag \
//     scripts/diag/rms_norm_bwd_versions.cu -o /tmp/bwd && VERSION=<name> [PER_SM=k] /tmp/bwd <rows> <n>
// PER_SM: blocks an SM in the backward's persistent grid (default: the op's own, rms_norm_bwd_blocks). The line ends
// with a checksum of dx and dw, bit for bit the same in two versions that compute the same.
#include "rms_norm.cu"
#include "diag_timing.cuh"
using namespace tiered_ops;

int main(int argc, char** argv) {
  const int64_t rows = atoll(argv[1]), n = atoll(argv[2]);
  const int per_sm_env = getenv("PER_SM") ? atoi(getenv("PER_SM")) : 0;
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t blocks = per_sm_env ? std::min<int64_t>(rows, (int64_t)sms * per_sm_env)
                                    : rms_norm_bwd_blocks(rows, n, DType::BF16, true, false, false),
                m = rows * n;
  __nv_bfloat16 *x, *dy, *dx, *w, *dw, *y;
  float* part;
  char* fl;
  CK(cudaMalloc(&x, m * 2)); CK(cudaMalloc(&dy, m * 2)); CK(cudaMalloc(&dx, m * 2)); CK(cudaMalloc(&y, m * 2));
  CK(cudaMalloc(&w, n * 2)); CK(cudaMalloc(&dw, n * 2)); CK(cudaMalloc(&part, blocks * n * 4));
  CK(cudaMalloc(&fl, 256 << 20));
  fill<<<1024, 256>>>(x, m, 1u, 4.f, 0.f);
  fill<<<1024, 256>>>(dy, m, 2u, 4.f, 0.f);
  fill<<<64, 256>>>(w, n, 3u, 4.f, 0.f);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  auto timed = [&](auto f) {
    std::vector<float> ts;
    for (int i = 0; i < 40; ++i) {
      CK(cudaMemsetAsync(fl, i, 256 << 20));  // the harness's L2 flush
      CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
      float ms; CK(cudaEventElapsedTime(&ms, a, b));
      if (i >= 5) ts.push_back(ms * 1e3f);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  const float bwd = timed([&] {
    CK(rms_norm_bwd(dy, x, w, dx, part, dw, rows, n, 1e-6f, blocks, DType::BF16, 0, 0.f, false, false));
  });
  const float fwd = timed([&] { CK(rms_norm_fwd(x, w, y, rows, n, 1e-6f, DType::BF16, 0, 0.f, false, false)); });
  const float cp = timed([&] { CK(cudaMemcpyAsync(dx, x, m * 2, cudaMemcpyDeviceToDevice)); });
  const double copy_rate = 2.0 * m * 2 / cp;  // bytes per us
  CK(rms_norm_bwd(dy, x, w, dx, part, dw, rows, n, 1e-6f, blocks, DType::BF16, 0, 0.f, false, false));
  std::vector<uint16_t> h(m + n);
  CK(cudaMemcpy(h.data(), dx, m * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h.data() + m, dw, n * 2, cudaMemcpyDeviceToHost));
  uint64_t sum = 1469598103934665603ull;  // FNV-1a over the bits of dx, then dw
  for (uint16_t v : h) sum = (sum ^ v) * 1099511628211ull;
  printf("%s %lldx%lld blocks %lld: bwd %.1f us (%.3f of copy), fwd %.1f us (%.3f), copy %.1f us; sum %016llx\n",
         getenv("VERSION") ? getenv("VERSION") : "?", (long long)rows, (long long)n, (long long)blocks, bwd,
         3.0 * m * 2 / bwd / copy_rate, fwd, 2.0 * m * 2 / fwd / copy_rate, cp, (unsigned long long)sum);
  return 0;
}
