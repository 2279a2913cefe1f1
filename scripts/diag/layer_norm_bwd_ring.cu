// layer_norm's backward v2 (cuda_src/layer_norm.cu, rows of at most 4096 elements) against a candidate that takes a
// block's rows through a ring of shared memory, the rms norms' backward design (cuda_src/rms_grads.cuh): x and dy of
// the block's next two rows copied (cp.async) while it works on this one, so its loads stay in flight through the
// row's reductions and stores. Both run on the same inputs and the same grid (the op's, layer_norm_bwd_blocks),
// standalone, with the harness's L2 flush before each timed call and a device copy of x's bytes for scale; each line
// ends with a checksum of dx, dw and db (FNV-1a over their bits): the same in the two, as the ring changes where a
// row is loaded from, not what is computed. Build and run (from the repository root):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I cuda_src -I scripts/diag \
//     scripts/diag/layer_norm_bwd_ring.cu -o /tmp/lnr && /tmp/lnr <rows> <n> [bf16|fp32]
#include <string>

#include "async_copy.cuh"
#include "diag_timing.cuh"
#include "layer_norm.cu"
using namespace tiered_ops;

constexpr int kStages = 2;  // rows a block has in flight ahead of the one it works on

// The ring's bytes for rows on `threads` threads of K packs: kStages rows of x and dy.
template <typename T, int K>
constexpr size_t ring_bytes(int threads) {
  return (size_t)kStages * 2 * K * threads * sizeof(Pack<T>);
}

// layer_norm_bwd_v2_kernel's math, its rows through the ring (dynamic shared memory of ring_bytes).
template <typename T, int K>
__global__ void __launch_bounds__(256, 2) ln_bwd_ring_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                             const T* __restrict__ w, const float* __restrict__ mean,
                                                             const float* __restrict__ rstd, T* __restrict__ dx,
                                                             float* pw, float* pb, int64_t rows, int n) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[64];
  extern __shared__ __align__(16) unsigned char ring_raw[];
  Pack<T>* const ring = reinterpret_cast<Pack<T>*>(ring_raw);
  const int nt = (int)blockDim.x, tid = (int)threadIdx.x;
  // Slot of tensor t (x, dy), pack k of this thread, in stage st: only this thread writes and reads it.
  auto slot = [&](int st, int t, int k) { return ring + ((st * 2 + t) * K + k) * nt + tid; };
  auto fetch = [&](int64_t r, int st) {  // row r's packs into stage st, one group (empty past the last row)
    if (r < rows) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = (k * nt + tid) * V;
        if (i < n) {
          async_copy16(slot(st, 0, k), x + r * n + i);
          async_copy16(slot(st, 1, k), dy + r * n + i);
        }
      }
    }
    async_copy_commit();
  };
#pragma unroll
  for (int st = 0; st < kStages; ++st) fetch(blockIdx.x + (int64_t)st * gridDim.x, st);
  float wv[K][V], aw[K][V], ab[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = (k * nt + tid) * V;
    load_or<T, V>(i < n ? w : nullptr, i, wv[k], 1.f);
#pragma unroll
    for (int j = 0; j < V; ++j) aw[k][j] = 0.f, ab[k][j] = 0.f;
  }
  int st = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const LineRow row{r * n, n};
    const float mu = mean[r], rs = rstd[r];
    Pack<T> qx[K], qd[K];  // raw; zero past the row's end, so they add nothing to the sums
    async_copy_wait<kStages - 1>();  // this row's group landed; the later rows' may be in flight
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const bool in = (k * nt + tid) * V < n;
      qx[k] = in ? *slot(st, 0, k) : Pack<T>{};
      qd[k] = in ? *slot(st, 1, k) : Pack<T>{};
    }
    fetch(r + (int64_t)kStages * gridDim.x, st);  // the slots just read, for the row a ring ahead
    st = st + 1 == kStages ? 0 : st + 1;
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float g = to_f(qd[k].v[j]) * wv[k][j];
        s1 += g * (to_f(qx[k].v[j]) - mu) * rs, s2 += g;
      }
    }
    block_sum2(s1, s2, smem);
    const float c1 = s1 / (float)n, c2 = s2 / (float)n;
    row.each<K, V>([&](int k, int i) {
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = (to_f(qx[k].v[j]) - mu) * rs, d = to_f(qd[k].v[j]);
        aw[k][j] += d * a, ab[k][j] += d;
        o[j] = rs * (d * wv[k][j] - a * c1 - c2);
      }
      store_f<T, V>(dx, row.base + i, o);
    });
  }
  const LineRow mine{(int64_t)blockIdx.x * n, n};
  auto put = [](float* p, const float (&v)[V]) {
#pragma unroll
    for (int j = 0; j < V; j += 4) *reinterpret_cast<float4*>(p + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
  };
  mine.each<K, V>([&](int k, int i) {
    if (pw) put(pw + mine.base + i, aw[k]);
    if (pb) put(pb + mine.base + i, ab[k]);
  });
}

template <typename T>
static int run(int64_t rows, int64_t n, DType dt, const char* name) {
  constexpr int V = Pack<T>::N, K = 16 / V;
  const LnBwdPlan p = ln_bwd_v2_plan(n, V);
  if (!p.k) {
    printf("%lldx%lld %s: not a backward v2 row (at most 4096 elements, a multiple of %d)\n", (long long)rows,
           (long long)n, name, V);
    return 1;
  }
  const int64_t m = rows * n, blocks = layer_norm_bwd_blocks(rows, n, dt, 2);
  const size_t ring = ring_bytes<T, K>(p.threads);
  const auto cand = ln_bwd_ring_kernel<T, K>;
  CK(cudaFuncSetAttribute(reinterpret_cast<const void*>(cand), cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)ring));
  int per_sm = 0, sms = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, cand, p.threads, ring));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  T *x, *dy, *dx, *w, *b, *y, *dw, *db;
  float *mean, *rstd, *part;
  void* ws = nullptr;
  char* fl;
  CK(cudaMalloc(&x, m * sizeof(T))); CK(cudaMalloc(&dy, m * sizeof(T))); CK(cudaMalloc(&dx, m * sizeof(T)));
  CK(cudaMalloc(&y, m * sizeof(T))); CK(cudaMalloc(&w, n * sizeof(T))); CK(cudaMalloc(&b, n * sizeof(T)));
  CK(cudaMalloc(&dw, n * sizeof(T))); CK(cudaMalloc(&db, n * sizeof(T)));
  CK(cudaMalloc(&mean, rows * 4)); CK(cudaMalloc(&rstd, rows * 4)); CK(cudaMalloc(&part, 2 * blocks * n * 4));
  const int64_t wsb = layer_norm_fwd_workspace(rows, n, dt);
  if (wsb) CK(cudaMalloc(&ws, wsb));
  CK(cudaMalloc(&fl, 256 << 20));
  fill<<<1024, 256>>>(x, m, 1u, 4.f, 0.5f);
  fill<<<1024, 256>>>(dy, m, 2u, 4.f, 0.f);
  fill<<<64, 256>>>(w, n, 3u, 2.f, 1.f);
  fill<<<64, 256>>>(b, n, 4u, 1.f, 0.f);
  CK(layer_norm_fwd(x, w, b, y, mean, rstd, rows, n, 1e-5f, ws, dt, 0));  // the op's own mean and rstd
  CK(cudaDeviceSynchronize());
  float* pb = part + blocks * n;
  auto op = [&] { CK(layer_norm_bwd(dy, x, w, mean, rstd, dx, part, pb, dw, db, rows, n, blocks, dt, 0)); };
  auto candidate = [&] {
    if (rows > blocks) {
      cand<<<(unsigned)blocks, p.threads, ring>>>(dy, x, w, mean, rstd, dx, part, pb, rows, (int)n);
    } else {  // a row a block: nothing to copy ahead
      layer_norm_bwd_v2_kernel<T, K><<<(unsigned)blocks, p.threads>>>(dy, x, w, mean, rstd, dx, part, pb, rows,
                                                                       (int)n);
    }
    CK(cudaGetLastError());
    CK(launch_reduce_partials<T>(part, pb, dw, db, blocks, n, 0));
  };
  cudaEvent_t a, e;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&e));
  auto timed = [&](auto f) {  // median of 35 after 5, each after the L2 flush
    std::vector<float> ts;
    for (int i = 0; i < 40; ++i) {
      CK(cudaMemsetAsync(fl, i, 256 << 20));
      CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(e)); CK(cudaEventSynchronize(e));
      float ms; CK(cudaEventElapsedTime(&ms, a, e));
      if (i >= 5) ts.push_back(ms * 1e3f);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  auto checksum = [&] {
    std::vector<unsigned char> h((m + 2 * n) * sizeof(T));
    CK(cudaMemcpy(h.data(), dx, m * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.data() + m * sizeof(T), dw, n * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.data() + (m + n) * sizeof(T), db, n * sizeof(T), cudaMemcpyDeviceToHost));
    uint64_t sum = 1469598103934665603ull;
    for (unsigned char v : h) sum = (sum ^ v) * 1099511628211ull;
    return (unsigned long long)sum;
  };
  const float cp = timed([&] { CK(cudaMemcpyAsync(dx, x, m * sizeof(T), cudaMemcpyDeviceToDevice)); });
  const double copy_rate = 2.0 * m * sizeof(T) / cp, bytes = 3.0 * m * sizeof(T);  // x, dy read; dx written
  const float t_op = timed(op);
  op();
  CK(cudaDeviceSynchronize());
  const unsigned long long s_op = checksum();
  const float t_cand = timed(candidate);
  candidate();
  CK(cudaDeviceSynchronize());
  const unsigned long long s_cand = checksum();
  printf("%lldx%lld %s, %lld blocks of %d (ring: %zu bytes, %d blocks an SM of %d SMs), copy %.1f us:\n",
         (long long)rows, (long long)n, name, (long long)blocks, p.threads, ring, per_sm, sms, cp);
  printf("  op v2   %.1f us (%.3f of copy); sum %016llx\n", t_op, bytes / t_op / copy_rate, s_op);
  printf("  ring    %.1f us (%.3f of copy); sum %016llx %s\n", t_cand, bytes / t_cand / copy_rate, s_cand,
         s_op == s_cand ? "(same)" : "(DIFFERS)");
  return s_op == s_cand ? 0 : 2;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    printf("usage: %s <rows> <n> [bf16|fp32]\n", argv[0]);
    return 1;
  }
  const int64_t rows = atoll(argv[1]), n = atoll(argv[2]);
  const bool fp32 = argc > 3 && std::string(argv[3]) == "fp32";
  return fp32 ? run<float>(rows, n, DType::F32, "fp32") : run<__nv_bfloat16>(rows, n, DType::BF16, "bf16");
}
