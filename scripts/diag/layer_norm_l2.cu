// layer_norm over giant rows with w and b as large as a row (fp32; layer_norm over three trailing dims, 16 rows of
// 64 x 256 x 256): the op's launches (cuda_src/layer_norm.cu: each piece's statistics, the row's merge, then every
// piece normalized, x read twice from DRAM and w and b read again for each row, 818 MB moved where a copy moves 537)
// against a candidate that holds w and b on chip and reads x's second time from L2. One block an SM, block p owns
// piece p of every row: it loads its piece of w into shared memory and its piece of b into shared memory and registers
// once (32 MB over the GPU's 132 SMs). For each row it reads its piece of x (L2 asked to keep it), folds it into the
// piece's (count, mean, centred sum of squares), publishes them (the row's last piece merges all of them into the
// row's mean and rstd), then normalizes the previous row's piece: read again from L2 (2 rows of x, 32 MB, stay
// there between the two reads), y written streaming. The wait for a row's merge falls a whole piece read behind it.
// Built for sm_90a: 64 registers at 1024 threads, spills of 12-40 bytes a thread (read back once a row). Per line:
// kernel time (median of 15 after 3), fraction of a device copy of x's bytes timed in the same run, and the worst
// difference from the op's y, mean and rstd, |a - b| / (1 + |b|).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I cuda_src -I scripts/diag \
//     scripts/diag/layer_norm_l2.cu -o /tmp/lnl2 && /tmp/lnl2 16 4194304
#include <string>

#include "diag_timing.cuh"
#include "layer_norm.cu"
using namespace tiered_ops;

constexpr int kThreads = 1024, kPacks = 8, kBShared = 6;  // a thread: 8 packs of the piece; b's first 6 in smem
constexpr int kBatch = 4;  // loads a thread has in flight in the statistics pass

__device__ __forceinline__ unsigned acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block p (of gridDim.x) owns packs [p * share, + share) of every row, thread t packs t + k * kThreads (k < kPacks).
// Dynamic shared memory: w's packs, then b's first kBShared packs a thread. `count`: 2 x rows zeroed counters (pieces
// published a row, then the row's merged flag); `part`: rows x gridDim.x (count, mean, M2).
template <bool HINT>
__global__ void __launch_bounds__(kThreads, 1) ln_l2_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                                            const float* __restrict__ b, float* __restrict__ y,
                                                            float* __restrict__ mean, float* __restrict__ rstd,
                                                            int64_t rows, int64_t n, int share, float eps,
                                                            unsigned* count, float3* part) {
  extern __shared__ __align__(16) float4 wb[];
  __shared__ float3 red[32];
  __shared__ float2 row_stat;
  __shared__ int last;
  const int tid = (int)threadIdx.x, P = (int)gridDim.x, p = (int)blockIdx.x;
  const int64_t npacks = n / 4, p0 = (int64_t)p * share;
  const int cnt = (int)max((int64_t)0, min((int64_t)share, npacks - p0));
  unsigned* merged = count + rows;
  const uint64_t keep = HINT ? l2_policy(true) : 0, drop = HINT ? l2_policy(false) : 0;
  float4* wsm = wb;                      // w: kPacks x kThreads
  float4* bs = wb + kPacks * kThreads;   // b: kBShared x kThreads
  float4 br[kPacks - kBShared];          // b's last packs, in registers
  const float4* wp = reinterpret_cast<const float4*>(w) + p0;
  const float4* bp = reinterpret_cast<const float4*>(b) + p0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int j = k * kThreads + tid;
    const float4 wv = j < cnt ? wp[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 bv = j < cnt ? bp[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    wsm[j] = wv;
    if (k < kBShared)
      bs[j] = bv;
    else
      br[k - kBShared] = bv;
  }  // each thread reads only its own packs back: no barrier needed
  auto piece = [&](int64_t r) { return reinterpret_cast<const float4*>(x + r * n) + p0; };
  auto publish = [&](int64_t r) {  // pass 1: the piece's statistics; the row's last piece merges them all
    const float4* src = piece(r);
    float3 acc = make_float3(0.f, 0.f, 0.f);
#pragma unroll
    for (int h = 0; h < kPacks; h += kBatch) {  // kBatch loads in flight, then folded: b's registers stay unspilled
      float4 q[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int j = (h + k) * kThreads + tid;
        if (j < cnt) q[k] = as_float4(load16<HINT>(src + j, keep));
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if ((h + k) * kThreads + tid < cnt) {
          const float4 v = q[k];
          const float m = (v.x + v.y + v.z + v.w) * 0.25f;
          const float m2 = (v.x - m) * (v.x - m) + (v.y - m) * (v.y - m) + (v.z - m) * (v.z - m) +
                           (v.w - m) * (v.w - m);
          acc = chan_merge(acc, make_float3(4.f, m, m2));
        }
      }
    }
    acc = block_merge(acc, red);
    if (tid == 0) {
      part[r * P + p] = acc;
      __threadfence();
      last = atomicAdd(count + r, 1u) == (unsigned)P - 1;
    }
    __syncthreads();
    if (last) {
      __threadfence();
      float3 a = make_float3(0.f, 0.f, 0.f);
      for (int j = tid; j < P; j += kThreads) {
        const float3* s = part + r * P + j;
        a = chan_merge(a, make_float3(__ldcg(&s->x), __ldcg(&s->y), __ldcg(&s->z)));
      }
      a = block_merge(a, red);
      if (tid == 0) {
        const float rs = rsqrtf(fmaxf(a.z / a.x, 0.f) + eps);
        mean[r] = a.y, rstd[r] = rs;
        __stcg(reinterpret_cast<float2*>(part + rows * P) + r, make_float2(a.y, rs));
        __threadfence();
        atomicExch(merged + r, 1u);
      }
    }
  };
  auto normalize = [&](int64_t r) {  // pass 2: the piece again (from L2), with w and b held here
    if (tid == 0) {
      while (acquire(merged + r) == 0) {
      }
      row_stat = __ldcg(reinterpret_cast<const float2*>(part + rows * P) + r);
    }
    __syncthreads();
    const float mu = row_stat.x, rs = row_stat.y;
    const float4* src = piece(r);
    float4* dst = reinterpret_cast<float4*>(y + r * n) + p0;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = k * kThreads + tid;
      if (j < cnt) {
        const float4 v = as_float4(load16<HINT>(src + j, drop)), wv = wsm[j];
        const float4 bv = k < kBShared ? bs[j] : br[k - kBShared];
        store16<HINT>(dst + j, as_uint4(make_float4((v.x - mu) * rs * wv.x + bv.x, (v.y - mu) * rs * wv.y + bv.y,
                                                    (v.z - mu) * rs * wv.z + bv.z, (v.w - mu) * rs * wv.w + bv.w)));
      }
    }
    __syncthreads();  // row_stat read by every thread before the next row's is written
  };
  if (rows > 0) publish(0);
  for (int64_t r = 0; r < rows; ++r) {
    if (r + 1 < rows) publish(r + 1);
    normalize(r);
  }
}

int main(int argc, char** argv) {
  if (argc < 3) {
    printf("usage: %s <rows> <n>   (fp32; n a multiple of 4)\n", argv[0]);
    return 1;
  }
  const int64_t rows = atoll(argv[1]), n = atoll(argv[2]), m = rows * n, npacks = n / 4;
  int sms = 0, optin = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  const int share = (int)((npacks + sms - 1) / sms);
  const size_t smem = (size_t)(kPacks + kBShared) * kThreads * 16;
  if (n % 4 || share > kPacks * kThreads || (int)smem > optin) {
    printf("%lldx%lld: not a candidate row (n a multiple of 4, at most %d packs a block, %zu bytes of %d)\n",
           (long long)rows, (long long)n, kPacks * kThreads, smem, optin);
    return 1;
  }
  float *x, *w, *b, *y, *ref, *mean, *rstd, *mean2, *rstd2;
  unsigned* count;
  float3* part;
  void* ws = nullptr;
  CK(cudaMalloc(&x, m * 4)); CK(cudaMalloc(&y, m * 4)); CK(cudaMalloc(&ref, m * 4));
  CK(cudaMalloc(&w, n * 4)); CK(cudaMalloc(&b, n * 4));
  CK(cudaMalloc(&mean, rows * 4)); CK(cudaMalloc(&rstd, rows * 4));
  CK(cudaMalloc(&mean2, rows * 4)); CK(cudaMalloc(&rstd2, rows * 4));
  CK(cudaMalloc(&count, 2 * rows * 4));
  CK(cudaMalloc(&part, (rows * sms + rows) * sizeof(float3) + 64));
  const int64_t wsb = layer_norm_fwd_workspace(rows, n, DType::F32);
  if (wsb) {
    CK(cudaMalloc(&ws, wsb));
    CK(cudaMemset(ws, 0, wsb));
  }
  fill<<<1024, 256>>>(x, m, 1234u, 8.f, 3.f);
  fill<<<1024, 256>>>(w, n, 77u, 1.f, 1.f);
  fill<<<1024, 256>>>(b, n, 99u, 1.f, 0.f);
  const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(y, x, m * 4, cudaMemcpyDeviceToDevice)); });
  const float op_ms = time_ms([&] { CK(layer_norm_fwd(x, w, b, ref, mean, rstd, rows, n, 1e-5f, ws, DType::F32, 0)); });
  printf("%lldx%lld fp32: copy %.1f us; the op %.1f us, %.3f of copy\n", (long long)rows, (long long)n,
         copy_ms * 1e3f, op_ms * 1e3f, copy_ms / op_ms);
  bool bad = false;
  auto candidate = [&](auto kernel, const char* name) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    if (per_sm < 1) {
      printf("  %s: no block fits an SM\n", name);
      bad = true;
      return;
    }
    const float ms = time_ms([&] {
      CK(cudaMemsetAsync(count, 0, 2 * rows * 4));
      kernel<<<sms, kThreads, smem>>>(x, w, b, y, mean2, rstd2, rows, n, share, 1e-5f, count, part);
    });
    CK(cudaGetLastError());
    const float dy = worst_diff(y, ref, m, 1.f), dm = worst_diff(mean2, mean, rows, 1.f),
                dr = worst_diff(rstd2, rstd, rows, 1.f);
    const bool ok = dy < 1e-4f && dm < 1e-4f && dr < 1e-4f;
    bad |= !ok;
    printf("  w, b on chip, x's second read from L2, %-5s %8.1f us, %.3f of copy; worst diff from the op: y %.1e, "
           "mean %.1e, rstd %.1e%s\n", name, ms * 1e3f, copy_ms / ms, dy, dm, dr, ok ? "" : " (DIFFERS)");
  };
  candidate(ln_l2_kernel<false>, "plain");
  candidate(ln_l2_kernel<true>, "hint");
  return bad ? 2 : 0;
}
