// layer_norm over giant rows (fp32, with w and b as large as a row; standalone, no torch): the op's two launches (each
// piece's exact mean and centred sum of squares, then the row's merged and the piece normalized, x read twice) against
// a persistent grid that holds each row once in the shared memory of all its blocks (clusters of cs, the row's
// clusters merging their (count, mean, centred sum of squares) through global memory; the next row copied into the
// slots the writes free), with and without L2 eviction hints (w and b kept, x and y streamed). Each line: kernel
// time (median of 15), fraction of a device copy of x's bytes timed in the same run, worst error of three rows
// against a float64 host reference.
//   NOCOOP=1: the persistent grid launched without the cooperative attribute.
//   ONCE=1: each kernel launched once, untimed (for Nsight Compute). TWO_ONLY=1: the two-pass plans alone.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a layer_norm_plans.cu -o lp && ./lp 16 4194304
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../cuda_src/split_rows.cuh"  // the op's Chan merge: chan_merge, shfl_merge, block_merge
#include "diag_timing.cuh"
namespace cg = cooperative_groups;
using tiered_ops::block_merge;
using tiered_ops::chan_merge;
using tiered_ops::shfl_merge;

constexpr int NT = 512, LAG = 4;

__device__ __forceinline__ void fold4(float4 q, float3& acc) {
  const float m = (q.x + q.y + q.z + q.w) * 0.25f;
  const float m2 = (q.x - m) * (q.x - m) + (q.y - m) * (q.y - m) + (q.z - m) * (q.z - m) + (q.w - m) * (q.w - m);
  acc = chan_merge(acc, make_float3(4.f, m, m2));
}

template <bool H>
__device__ __forceinline__ void cp16(void* s, const void* g, uint64_t pol) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(s));
  if (H)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(d), "l"(g), "l"(pol) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(g) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_g() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
template <bool H>
__device__ __forceinline__ float4 ldk(const float4* p, uint64_t pol) {
  float4 v;
  if (H)
    asm volatile("ld.global.nc.L2::cache_hint.v4.f32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p), "l"(pol));
  else
    v = __ldg(p);
  return v;
}
template <bool H>
__device__ __forceinline__ void stk(float4* p, float4 v, uint64_t pol) {
  if (H)
    asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w), "l"(pol) : "memory");
  else
    *p = v;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ unsigned long long g_span[2];  // the persistent grid's first block start and last block end (globaltimer, ns)
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Persistent row groups: group g (of G) takes rows g, g + G, ...; block k of its cluster q holds packs
// [(q * cs + k) * share, + share) of the row.
template <bool H>
__global__ void __launch_bounds__(NT) pg(const float4* __restrict__ x, const float4* __restrict__ w,
                                         const float4* __restrict__ b, float4* __restrict__ y, float* mean_out,
                                         float* rstd_out, long rows, long npacks, int share, int K, float eps,
                                         float4* part, unsigned* counts) {
  if (threadIdx.x == 0) atomicMin(&g_span[0], now_ns());
  extern __shared__ __align__(16) float4 buf[];
  __shared__ float3 red[32];
  __shared__ float3 stat[2];
  __shared__ float2 row_stat;
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks(), rank = (int)cluster.block_rank(), tid = threadIdx.x;
  const int c = blockIdx.x / cs, g = c / K, q = c % K, G = gridDim.x / (cs * K);
  const long p0 = (long)(q * cs + rank) * share;
  const int cnt = (int)max(0L, min((long)share, npacks - p0)), chunks = (cnt + NT - 1) / NT;
  unsigned* count = counts + g;
  float4* slots = part + (long)g * K * 2;
  uint64_t keep = 0, stream = 0;
  if (H) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(stream));
  }
  float3 acc = make_float3(0.f, 0.f, 0.f);
  auto fold = [&](int cc) {
    const int j = cc * NT + tid;
    if (j < cnt) fold4(buf[j], acc);
  };
  long r = g;
  if (r < rows) {
    const float4* src = x + r * npacks + p0;
    for (int cc = 0; cc < chunks; ++cc) {
      const int j = cc * NT + tid;
      if (j < cnt) cp16<H>(buf + j, src + j, stream);
      commit();
      if (cc >= LAG) wait_g<LAG>(), fold(cc - LAG);
    }
    wait_g<0>();
    for (int cc = max(0, chunks - LAG); cc < chunks; ++cc) fold(cc);
  }
  for (int it = 0; r < rows; r += G, ++it) {
    const float3 sb = block_merge(acc, red);
    if (tid == 0) stat[it & 1] = sb;
    cluster.sync();
    float3 rs = make_float3(0.f, 0.f, 0.f);
    for (int k = 0; k < cs; ++k) rs = chan_merge(rs, *cluster.map_shared_rank(&stat[it & 1], k));
    if (K > 1) {
      if (tid < 32) {
        float4* slot = slots + (it & 1);
        if (rank == 0 && tid == 0) __stcg(slot + 2 * q, make_float4(rs.x, rs.y, rs.z, 0.f)), __threadfence(), atomicAdd(count, 1u);
        while (ld_acquire(count) < (unsigned)K * (unsigned)(it + 1)) {
        }
        rs = make_float3(0.f, 0.f, 0.f);
        for (int k = tid; k < K; k += 32) {
          const float4 o = __ldcg(slot + 2 * k);
          rs = chan_merge(rs, make_float3(o.x, o.y, o.z));
        }
        rs = shfl_merge(rs);
        if (tid == 0) row_stat = make_float2(rs.y, rsqrtf(rs.z / rs.x + eps));
      }
      __syncthreads();
    } else if (tid == 0) {
      row_stat = make_float2(rs.y, rsqrtf(rs.z / rs.x + eps));
    }
    if (K == 1) __syncthreads();
    const float mean = row_stat.x, rstd = row_stat.y;
    if (q == 0 && rank == 0 && tid == 0) mean_out[r] = mean, rstd_out[r] = rstd;
    const bool more = r + G < rows;
    float4* dst = y + r * npacks + p0;
    const float4* next = x + (more ? r + G : r) * npacks + p0;
    acc = make_float3(0.f, 0.f, 0.f);
    float4 wa = make_float4(1.f, 1.f, 1.f, 1.f), ba = make_float4(0.f, 0.f, 0.f, 0.f), wb = wa, bb = ba;
    auto pre = [&](int cc, float4& wv, float4& bv) {
      const int j = cc * NT + tid;
      if (w && cc < chunks && j < cnt) wv = ldk<H>(w + p0 + j, keep), bv = ldk<H>(b + p0 + j, keep);
    };
    auto step = [&](int cc, const float4& wv, const float4& bv) {
      const int j = cc * NT + tid;
      if (cc >= chunks) return;
      if (j < cnt) {
        const float4 v = buf[j];
        stk<H>(dst + j, make_float4((v.x - mean) * rstd * wv.x + bv.x, (v.y - mean) * rstd * wv.y + bv.y,
                                    (v.z - mean) * rstd * wv.z + bv.z, (v.w - mean) * rstd * wv.w + bv.w), stream);
        if (more) cp16<H>(buf + j, next + j, stream);
      }
      commit();
      if (more && cc >= LAG) wait_g<LAG>(), fold(cc - LAG);
    };
    pre(0, wa, ba);
    pre(1, wb, bb);
    for (int cc = 0; cc < chunks; cc += 2) {
      step(cc, wa, ba);
      pre(cc + 2, wa, ba);
      step(cc + 1, wb, bb);
      pre(cc + 3, wb, bb);
    }
    if (more) {
      wait_g<0>();
      for (int cc = max(0, chunks - LAG); cc < chunks; ++cc) fold(cc);
    }
  }
  cluster.sync();
  if (threadIdx.x == 0) atomicMax(&g_span[1], now_ns());
}

// The op's two launches, simplified: pieces of NT x 4 packs, piece-major stats, then merge and normalize in reverse.
constexpr int PP = 4, PIECE = NT * PP;
__global__ void __launch_bounds__(NT) two_stats(const float4* __restrict__ x, float2* __restrict__ ps, long npacks,
                                                int pieces) {
  __shared__ float3 red[32];
  const long rows = gridDim.x / pieces, k = blockIdx.x % rows * pieces + blockIdx.x / rows;
  const long r = k / pieces, first = (k % pieces) * PIECE;
  const int cnt = (int)min((long)PIECE, npacks - first);
  float3 acc = make_float3(0.f, 0.f, 0.f);
  for (int p = 0; p < PP; ++p) {
    const int j = p * NT + threadIdx.x;
    if (j < cnt) fold4(x[r * npacks + first + j], acc);
  }
  acc = block_merge(acc, red);
  if (threadIdx.x == 0) ps[k] = make_float2(acc.y, acc.z);
}
// The row's (mean, rstd) from its pieces' statistics: every thread of the block calls it and gets it (block_merge
// hands the block's total to every thread).
__device__ float2 row_stat(const float2* __restrict__ ps, long r, long npacks, int pieces, float eps, float3* red) {
  float3 acc = make_float3(0.f, 0.f, 0.f);
  for (int i = threadIdx.x; i < pieces; i += NT) {
    const float2 o = ps[r * pieces + i];
    acc = chan_merge(acc, make_float3((float)(min((long)PIECE, npacks - (long)i * PIECE) * 4), o.x, o.y));
  }
  acc = block_merge(acc, red);
  return make_float2(acc.y, rsqrtf(acc.z / acc.x + eps));
}
__global__ void __launch_bounds__(NT) two_merge(const float2* __restrict__ ps, float2* __restrict__ rs, long npacks,
                                                int pieces, float eps) {
  __shared__ float3 red[32];
  const float2 st = row_stat(ps, blockIdx.x, npacks, pieces, eps, red);
  if (threadIdx.x == 0) rs[blockIdx.x] = st;
}
// Launch 2 (the op's: <false, false>: each block merges its row's pieces, then loads w and b) and its variants: EARLY
// loads the piece's w and b with x, before the row's merge; ROWSTAT reads the row's (mean, rstd) that a third launch in
// between merged (two_merge, a block a row) in place of merging in every block.
template <bool EARLY, bool ROWSTAT>
__global__ void __launch_bounds__(NT) two_norm_v(const float4* __restrict__ x, const float4* __restrict__ w,
                                                 const float4* __restrict__ b, float4* __restrict__ y,
                                                 const float2* __restrict__ ps, const float2* __restrict__ rs,
                                                 long npacks, int pieces, float eps) {
  __shared__ float3 red[32];
  const long rows = gridDim.x / pieces, gg = (long)gridDim.x - 1 - blockIdx.x;
  const long k = gg % rows * pieces + gg / rows, r = k / pieces, first = (k % pieces) * PIECE;
  const int cnt = (int)min((long)PIECE, npacks - first);
  float4 q[PP], qw[PP], qb[PP];
  auto load_wb = [&] {
    for (int p = 0; p < PP; ++p) {
      const int j = p * NT + threadIdx.x;
      if (j < cnt)
        qw[p] = w ? w[first + j] : make_float4(1.f, 1.f, 1.f, 1.f),
        qb[p] = b ? b[first + j] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  for (int p = 0; p < PP; ++p) {
    const int j = p * NT + threadIdx.x;
    if (j < cnt) q[p] = x[r * npacks + first + j];
  }
  if (EARLY) load_wb();
  const float2 sr = ROWSTAT ? rs[r] : row_stat(ps, r, npacks, pieces, eps, red);
  if (!EARLY) load_wb();
  for (int p = 0; p < PP; ++p) {
    const int j = p * NT + threadIdx.x;
    if (j < cnt) {
      const float4 v = q[p];
      y[r * npacks + first + j] = make_float4((v.x - sr.x) * sr.y * qw[p].x + qb[p].x, (v.y - sr.x) * sr.y * qw[p].y + qb[p].y,
                                              (v.z - sr.x) * sr.y * qw[p].z + qb[p].z, (v.w - sr.x) * sr.y * qw[p].w + qb[p].w);
    }
  }
}

static double check(const float* dx, const float* dw, const float* db, const float* dy, long rows, long n) {
  std::vector<float> hx(n), hy(n), hw(n), hb(n);
  CK(cudaMemcpy(hw.data(), dw, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), db, n * 4, cudaMemcpyDeviceToHost));
  double worst = 0;
  const long picks[] = {0, rows / 2, rows - 1};
  for (long r : picks) {
    CK(cudaMemcpy(hx.data(), dx + r * n, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hy.data(), dy + r * n, n * 4, cudaMemcpyDeviceToHost));
    double s = 0, ss = 0;
    for (long i = 0; i < n; ++i) s += hx[i];
    const double m = s / n;
    for (long i = 0; i < n; ++i) ss += (hx[i] - m) * (hx[i] - m);
    const double rstd = 1.0 / std::sqrt(ss / n + 1e-5);
    for (long i = 0; i < n; ++i) {
      const double ref = (hx[i] - m) * rstd * hw[i] + hb[i];
      worst = std::max(worst, std::fabs(hy[i] - ref) / (std::fabs(ref) + 1e-3));
    }
  }
  return worst;
}

int main(int argc, char** argv) {
  const long rows = atol(argv[1]), n = atol(argv[2]), npacks = n / 4;
  const bool affine = argc < 4 || std::string(argv[3]) != "noaffine";  // noaffine: no w and b (the checker's 1 and 0)
  int sms = 0, optin = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  float *x, *y, *z, *w, *b, *mean, *rstd;
  const size_t bytes = (size_t)rows * n * 4;
  CK(cudaMalloc(&x, bytes));
  CK(cudaMalloc(&y, bytes));
  CK(cudaMalloc(&z, bytes));
  CK(cudaMalloc(&w, n * 4));
  CK(cudaMalloc(&b, n * 4));
  CK(cudaMalloc(&mean, rows * 4));
  CK(cudaMalloc(&rstd, rows * 4));
  fill<<<1024, 256>>>(x, rows * n, 1234u, 8.f, 3.f);
  fill<<<1024, 256>>>(w, n, 77u, affine ? 1.f : 0.f, 1.f);
  fill<<<1024, 256>>>(b, n, 99u, affine ? 1.f : 0.f, 0.f);
  const float4* wk = affine ? (const float4*)w : nullptr;
  const float4* bk = affine ? (const float4*)b : nullptr;
  float4* part;
  unsigned* cnt;
  CK(cudaMalloc(&part, 1 << 22));
  CK(cudaMalloc(&cnt, 1 << 16));
  const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(z, x, bytes, cudaMemcpyDeviceToDevice)); });
  printf("%s%ld x %ld fp32: copy %.1f us, %.0f GB/s; %d SMs\n", affine ? "" : "no w, b: ", rows, n, copy_ms * 1e3, 2.0 * bytes / copy_ms / 1e6, sms);
  auto report = [&](const char* name, float ms) {
    const double err = check(x, w, b, y, rows, n);
    printf("%-40s %9.1f us  %.3f of copy  err %.2e\n", name, ms * 1e3, copy_ms / ms, err);
    CK(cudaMemset(y, 0, bytes));
  };
  {
    const int pieces = (int)((npacks + PIECE - 1) / PIECE);
    float2* ps = reinterpret_cast<float2*>(part);
    float2* rs = ps + rows * pieces;
    using N_t = void (*)(const float4*, const float4*, const float4*, float4*, const float2*, const float2*, long, int,
                         float);
    const struct { N_t k; bool merge; const char* name; } norms[] = {
        {two_norm_v<false, false>, false, "two launches (the op's v3)"},
        {two_norm_v<true, false>, false, "two launches, w and b early"},
        {two_norm_v<false, true>, true, "three launches (a row merge)"},
        {two_norm_v<true, true>, true, "three launches, w and b early"}};
    for (const auto& v : norms)
      report(v.name, time_ms([&] {
               two_stats<<<(unsigned)(rows * pieces), NT>>>((const float4*)x, ps, npacks, pieces);
               if (v.merge) two_merge<<<(unsigned)rows, NT>>>(ps, rs, npacks, pieces, 1e-5f);
               v.k<<<(unsigned)(rows * pieces), NT>>>((const float4*)x, wk, bk, (float4*)y, ps, rs, npacks, pieces,
                                                      1e-5f);
             }));
    if (getenv("TWO_ONLY")) return 0;
  }
  using K_t = void (*)(const float4*, const float4*, const float4*, float4*, float*, float*, long, long, int, int, float,
                       float4*, unsigned*);
  const long fit = (optin / 2 - 1024) / 16;
  for (int hints = 0; hints < 2; ++hints)
    for (int cs : {2, 4, 8})
      for (int whole : {0, 1}) {  // blocks a row: a power of two, or every slot of the GPU (a multiple of cs)
        long blocks = 2;
        while ((npacks + blocks - 1) / blocks > fit && blocks <= sms) blocks *= 2;
        if (whole) blocks = std::max(blocks, (long)(2 * sms / cs * cs));
        if (blocks < cs) continue;
        const int K = (int)(blocks / cs), share = (int)((npacks + blocks - 1) / blocks);
        if (share > fit) continue;
        K_t kern = hints ? pg<true> : pg<false>;
        const size_t smem = (size_t)share * 16;
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        cudaLaunchConfig_t cfg = {};
        cfg.blockDim = dim3(NT), cfg.dynamicSmemBytes = smem, cfg.gridDim = dim3(cs);
        cudaLaunchAttribute at[2];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = cs, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
        cfg.attrs = at, cfg.numAttrs = 1;
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg) != cudaSuccess) {
          cudaGetLastError();
          continue;
        }
        const int G = (int)std::min<long>(rows, clusters / K);
        char name[96];
        snprintf(name, sizeof name, "groups hints%d cs%d K%d G%d (%ld blocks, share %d)", hints, cs, K, G, (long)G * K * cs,
                 share);
        if (G < 1) {
          printf("%-40s does not fit (%d clusters resident)\n", name, clusters);
          continue;
        }
        cfg.gridDim = dim3(G * K * cs);
        at[1].id = cudaLaunchAttributeCooperative, at[1].val.cooperative = 1;
        cfg.numAttrs = K > 1 && !getenv("NOCOOP") ? 2 : 1;  // NOCOOP=1: no cooperative attribute (every block fits anyway)
        auto launch = [&] {
          CK(cudaMemsetAsync(cnt, 0, G * 4));
          CK(cudaLaunchKernelEx(&cfg, kern, (const float4*)x, wk, bk, (float4*)y, mean, rstd,
                                rows, npacks, share, K, 1e-5f, part, cnt));
        };
        launch();
        CK(cudaDeviceSynchronize());
        const float ms = time_ms(launch);
        // one more launch, its span inside the kernel (first block's start to last block's end) beside the events'
        const unsigned long long init[2] = {~0ull, 0ull};
        CK(cudaMemcpyToSymbol(g_span, init, sizeof init));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventRecord(e0));
        launch();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ev_ms = 0.f;
        CK(cudaEventElapsedTime(&ev_ms, e0, e1));
        unsigned long long span[2];
        CK(cudaMemcpyFromSymbol(span, g_span, sizeof span));
        printf("    one launch: events %.1f us, inside the kernel %.1f us\n", ev_ms * 1e3, (span[1] - span[0]) * 1e-3);
        report(name, ms);
      }
  return 0;
}
