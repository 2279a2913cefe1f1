// Giant-row softmax plans side by side (fp32, standalone, no torch): a cluster of 8 a row over a grid of every row
// against persistent row groups of K clusters of cs blocks, merged through
// global memory, with a lag of D copies before a fold, a double-buffered variant (two rows a block), and a ring that
// copies the next row's first chunks into spare slots during the merge (pkr). Each line:
// kernel time (median of 15), fraction of a device-to-device copy of the same bytes timed in the same run, and the
// worst relative error of three rows against a float64 host reference. After the op's plan (clusters of 2, 8 a row),
// the share of its blocks' cycles in each phase (the first row's load, the merges, the waits inside them, the
// write-and-copy loops), from one more launch with clock64 laps on thread 0. NCU_PLAN=1: the op's plan alone, launched
// cooperative (as the op does) and not, for a profiler (with ONCE=1: each launched once).
//   nvcc -O3 -std=c++17 --extended-lambda -gencode=arch=compute_90a,code=sm_90a softmax_plans.cu -o sp && ./sp 512 393216
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "diag_timing.cuh"
namespace cg = cooperative_groups;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_g() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float block_max(float v, float* sm) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (!lane) sm[w] = v;
  __syncthreads();
  return warp_max(lane < nw ? sm[lane] : -INFINITY);
}
__device__ float block_sum(float v, float* sm) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (!lane) sm[w] = v;
  __syncthreads();
  return warp_sum(lane < nw ? sm[lane] : 0.f);
}
__device__ __forceinline__ void online(float4 q, float& m, float& s) {
  float mx = fmaxf(fmaxf(q.x, q.y), fmaxf(q.z, q.w));
  const bool nan = (q.x != q.x) | (q.y != q.y) | (q.z != q.z) | (q.w != q.w);
  if (nan) s = NAN;
  const float mn = fmaxf(m, mx);
  if (mn != -INFINITY) {
    s *= __expf(m - mn);
    s += __expf(q.x - mn) + __expf(q.y - mn) + __expf(q.z - mn) + __expf(q.w - mn);
    m = mn;
  }
}

// a cluster per row, a grid over every row
__global__ void __launch_bounds__(512) v3(const float4* __restrict__ x, float4* __restrict__ y, long rows, long npacks,
                                         int share) {
  constexpr int D = 8, NT = 512;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float4* buf = reinterpret_cast<float4*>(smem_raw);
  __shared__ float red[32];
  __shared__ float2 stat;
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = cluster.num_blocks(), rank = cluster.block_rank(), tid = threadIdx.x;
  const long p0 = (long)rank * share;
  const int cnt = (int)max(0L, min((long)share, npacks - p0)), chunks = (cnt + NT - 1) / NT;
  for (long r = blockIdx.x / cs; r < rows; r += gridDim.x / cs) {
    const float4* src = x + r * npacks + p0;
    auto issue = [&](int c) {
      const int j = c * NT + tid;
      if (c < chunks && j < cnt) cp_async16(buf + j, src + j);
      commit();
    };
    for (int c = 0; c < D; ++c) issue(c);
    float m = -INFINITY, s = 0.f;
    for (int c = 0; c < chunks; ++c) {
      wait_g<D - 1>();
      const int j = c * NT + tid;
      if (j < cnt) online(buf[j], m, s);
      issue(c + D);
    }
    wait_g<0>();
    const float mb = block_max(m, red), sb = block_sum(s * (m == -INFINITY ? 0.f : __expf(m - mb)), red);
    if (!tid) stat = make_float2(mb, sb);
    cluster.sync();
    float mr = -INFINITY, sr = 0.f;
    for (int k = 0; k < cs; ++k) mr = fmaxf(mr, cluster.map_shared_rank(&stat, k)->x);
    for (int k = 0; k < cs; ++k) {
      const float2 o = *cluster.map_shared_rank(&stat, k);
      sr += o.y * (o.x == -INFINITY ? 0.f : __expf(o.x - mr));
    }
    cluster.sync();
    const float inv = 1.f / sr;
    float4* dst = y + r * npacks + p0;
    for (int j = tid; j < cnt; j += NT) {
      const float4 q = buf[j];
      dst[j] = make_float4(__expf(q.x - mr) * inv, __expf(q.y - mr) * inv, __expf(q.z - mr) * inv, __expf(q.w - mr) * inv);
    }
  }
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One iteration's row (max, sum): the block's reduced, merged over its cluster through distributed shared memory (by
// parity) and, where K > 1, over the row's K clusters through global memory (a count a group, two slots by parity).
struct RowMerge {
  float2* stat;
  float2* rowstat;
  float* red;
  float2* part;
  unsigned* cnt;
  int K, g, q;
  long long* waited = nullptr;  // thread 0's cycles waiting on the row's other clusters, added here (PROF)
};
__device__ float2 merge_row(cg::cluster_group& cluster, const RowMerge& w, float m, float s, int it) {
  const int cs = cluster.num_blocks(), rank = cluster.block_rank(), tid = threadIdx.x;
  const float mb = block_max(m, w.red), sb = block_sum(s * (m == -INFINITY ? 0.f : __expf(m - mb)), w.red);
  if (!tid) w.stat[it & 1] = make_float2(mb, sb);
  cluster.sync();
  float mr = -INFINITY, sr = 0.f;
  for (int k = 0; k < cs; ++k) mr = fmaxf(mr, cluster.map_shared_rank(&w.stat[it & 1], k)->x);
  for (int k = 0; k < cs; ++k) {
    const float2 o = *cluster.map_shared_rank(&w.stat[it & 1], k);
    sr += o.y * (o.x == -INFINITY ? 0.f : __expf(o.x - mr));
  }
  if (w.K < 2) return make_float2(mr, sr);
  if (!tid) {
    float2* slot = w.part + (long)w.g * w.K * 2 + (it & 1);
    if (!rank) {
      __stcg(slot + 2 * w.q, make_float2(mr, sr));
      __threadfence();
      atomicAdd(w.cnt + w.g, 1u);
    }
    const long long c0 = clock64();
    while (ld_acquire(w.cnt + w.g) < (unsigned)w.K * (unsigned)(it + 1)) {
    }
    if (w.waited) *w.waited += clock64() - c0;
    float M = -INFINITY, S = 0.f;
    for (int k = 0; k < w.K; ++k) M = fmaxf(M, __ldcg(slot + 2 * k).x);
    for (int k = 0; k < w.K; ++k) {
      const float2 o = __ldcg(slot + 2 * k);
      S += o.y * (o.x == -INFINITY ? 0.f : __expf(o.x - M));
    }
    *w.rowstat = make_float2(M, S);
  }
  __syncthreads();
  return *w.rowstat;
}

// Where a block of the grid sits: its row group g, its cluster q of the group, its share's first pack p0 and length n.
struct Place {
  int g, q, n;
  long p0;
};
__device__ Place place_of(cg::cluster_group& cluster, int K, int share, long npacks) {
  const int cs = cluster.num_blocks(), c = blockIdx.x / cs;
  Place p;
  p.g = c / K, p.q = c % K, p.p0 = (long)(p.q * cs + (int)cluster.block_rank()) * share;
  p.n = (int)max(0L, min((long)share, npacks - p.p0));
  return p;
}

// Per block (PROF), thread 0's cycles: the group's first row loaded, the merges (block reductions and cluster barrier),
// the waits on the row's other clusters inside them, the write-and-copy loops, and the whole kernel.
enum { P_FIRST, P_MERGE, P_WAIT, P_WRITE, P_ALL, P_N };
__device__ long long g_prof[4096][P_N];

// persistent: G row groups, each K clusters of cs blocks; a block holds `share` packs of its group's row, the next row
// of the group loaded as the current one is stored; the K clusters' (max, sum) merged through global memory.
template <int D, int NT, bool ST, bool PROF = false>
__global__ void __launch_bounds__(NT) pk(const float4* __restrict__ x, float4* __restrict__ y, long rows,
                                            long npacks, int share, int K, int G, float2* part, unsigned* cnt) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float4* buf = reinterpret_cast<float4*>(smem_raw);
  __shared__ float red[32];
  __shared__ float2 stat[2], rowstat;
  cg::cluster_group cluster = cg::this_cluster();
  const Place pl = place_of(cluster, K, share, npacks);
  const int tid = threadIdx.x, g = pl.g, q = pl.q, n = pl.n;
  const long p0 = pl.p0;
  const int chunks = (n + NT - 1) / NT;
  float m = -INFINITY, s = 0.f;
  long long ph[P_N] = {}, c0 = clock64(), c1 = c0;
  auto lap = [&](int k) {  // PROF: the cycles since the last lap into phase k
    if (PROF) {
      const long long c = clock64();
      ph[k] += c - c1;
      c1 = c;
    }
  };
  auto fold = [&](int cc) {
    const int j = cc * NT + tid;
    if (j < n) online(buf[j], m, s);
  };
  long r = g;
  if (r < rows) {
    const float4* src = x + r * npacks + p0;
    for (int cc = 0; cc < chunks; ++cc) {
      const int j = cc * NT + tid;
      if (j < n) cp_async16(buf + j, src + j);
      commit();
      if (cc >= D) {
        wait_g<D>();
        fold(cc - D);
      }
    }
    wait_g<0>();
    for (int cc = max(0, chunks - D); cc < chunks; ++cc) fold(cc);
  }
  lap(P_FIRST);
  for (int it = 0; r < rows; r += G, ++it) {
    const float2 rs =
        merge_row(cluster, RowMerge{stat, &rowstat, red, part, cnt, K, g, q, PROF ? &ph[P_WAIT] : nullptr}, m, s, it);
    lap(P_MERGE);
    float mr = rs.x, sr = rs.y;
    const float inv = 1.f / sr;
    const long rn = r + G;
    const bool more = rn < rows;
    float4* dst = y + r * npacks + p0;
    const float4* nsrc = x + (more ? rn : r) * npacks + p0;
    m = -INFINITY, s = 0.f;
    for (int cc = 0; cc < chunks; ++cc) {
      const int j = cc * NT + tid;
      if (j < n) {
        const float4 v = buf[j];
        const float4 o = make_float4(__expf(v.x - mr) * inv, __expf(v.y - mr) * inv, __expf(v.z - mr) * inv,
                                     __expf(v.w - mr) * inv);
        if (ST) __stcs(dst + j, o); else dst[j] = o;
        if (more) cp_async16(buf + j, nsrc + j);
      }
      commit();
      if (more && cc >= D) {
        wait_g<D>();
        fold(cc - D);
      }
    }
    if (more) {
      wait_g<0>();
      for (int cc = max(0, chunks - D); cc < chunks; ++cc) fold(cc);
    }
    lap(P_WRITE);
  }
  cluster.sync();  // no block exits while a block of its cluster may still read its stat
  if (PROF && tid == 0 && blockIdx.x < 4096) {
    ph[P_ALL] = clock64() - c0;
    for (int k = 0; k < P_N; ++k) g_prof[blockIdx.x][k] = ph[k];
  }
}

// persistent row groups as pk, each thread's slots a ring of chunks + E chunks (of NT packs): the group's next row's
// first E chunks are copied into the E slots the current row leaves free before the current row's merge, so they are
// in flight while the block waits on its row's other clusters; then as in pk, each write frees a slot, which takes the
// next row's chunk E further on. A thread's slots stay its own (ring positions in whole chunks), so its cp.async
// waits are all the ordering they need.
template <int D, int NT, int E>
__global__ void __launch_bounds__(NT) pkr(const float4* __restrict__ x, float4* __restrict__ y, long rows,
                                           long npacks, int share, int K, int G, float2* part, unsigned* cnt) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float4* buf = reinterpret_cast<float4*>(smem_raw);
  __shared__ float red[32];
  __shared__ float2 stat[2], rowstat;
  cg::cluster_group cluster = cg::this_cluster();
  const Place pl = place_of(cluster, K, share, npacks);
  const int tid = threadIdx.x, g = pl.g, q = pl.q, n = pl.n;
  const long p0 = pl.p0;
  const int chunks = (share + NT - 1) / NT, Q = chunks + E;
  float m = -INFINITY, s = 0.f;
  // ring positions are kept in [0, Q): a sum of two of them wraps once (no division in the loops)
  auto wrap = [&](int p) { return p >= Q ? p - Q : p; };
  auto at = [&](int pos) { return buf + pos * NT + tid; };
  auto copy = [&](long row, int cc, int pos) {  // row's chunk cc into ring position pos, one group
    const int j = cc * NT + tid;
    if (row < rows && cc < chunks && j < n) cp_async16(at(pos), x + row * npacks + p0 + j);
    commit();
  };
  auto fold = [&](int cc, int base) {  // chunk cc of the row whose chunk 0 sits at base
    const int j = cc * NT + tid;
    if (cc >= 0 && cc < chunks && j < n) online(*at(wrap(base + cc)), m, s);
  };
  long r = g;
  int base = 0;  // the ring position of the current row's chunk 0
  if (r < rows) {
    for (int cc = 0; cc < chunks; ++cc) {
      copy(r, cc, cc);
      if (cc >= D) wait_g<D>(), fold(cc - D, 0);
    }
    wait_g<0>();
    for (int cc = max(0, chunks - D); cc < chunks; ++cc) fold(cc, 0);
  }
  for (int it = 0; r < rows; r += G, ++it) {
    const long rn = r + G;
    const int nbase = wrap(base + chunks);
    const bool more = rn < rows;
    for (int e = 0; e < E; ++e) copy(more ? rn : rows, e, wrap(nbase + e));  // in flight through the merge
    const float2 rs = merge_row(cluster, RowMerge{stat, &rowstat, red, part, cnt, K, g, q}, m, s, it);
    const float mr = rs.x, inv = 1.f / rs.y;
    float4* dst = y + r * npacks + p0;
    m = -INFINITY, s = 0.f;
    int pos = base;  // the current row's chunk cc, which the next row's chunk cc + E replaces
    for (int cc = 0; cc < chunks; ++cc, pos = wrap(pos + 1)) {
      const int j = cc * NT + tid;
      if (j < n) {
        const float4 v = *at(pos);
        dst[j] = make_float4(__expf(v.x - mr) * inv, __expf(v.y - mr) * inv, __expf(v.z - mr) * inv,
                             __expf(v.w - mr) * inv);
      }
      copy(more ? rn : rows, cc + E, pos);
      if (more) wait_g<D>(), fold(cc + E - D, nbase);
    }
    if (more) {
      wait_g<0>();
      for (int cc = max(0, chunks + E - D); cc < chunks; ++cc) fold(cc, nbase);
    }
    base = nbase;
  }
  cluster.sync();  // no block exits while a block of its cluster may still read its stat
}

// double-buffered: one block an SM holds two rows' shares; row r + G's loads are in flight while row r merges
template <int NT>
__global__ void __launch_bounds__(NT, 1) pk2(const float4* __restrict__ x, float4* __restrict__ y, long rows,
                                             long npacks, int share, int K, int G, float2* part, unsigned* cnt) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float4* buf0 = reinterpret_cast<float4*>(smem_raw);
  __shared__ float red[32];
  __shared__ float2 stat[2], rowstat;
  cg::cluster_group cluster = cg::this_cluster();
  const Place pl = place_of(cluster, K, share, npacks);
  const int tid = threadIdx.x, g = pl.g, q = pl.q, n = pl.n;
  const long p0 = pl.p0;
  float m = -INFINITY, s = 0.f;
  auto issue = [&](float4* b, long row) {
    if (row < rows) {
      const float4* src = x + row * npacks + p0;
      for (int j = tid; j < n; j += NT) cp_async16(b + j, src + j);
    }
    commit();
  };
  auto foldall = [&](const float4* b) {
    for (int j = tid; j < n; j += NT) online(b[j], m, s);
  };
  long r = g;
  issue(buf0, r);
  issue(buf0 + share, r + G);
  wait_g<1>();
  foldall(buf0);
  for (int it = 0; r < rows; r += G, ++it) {
    float4* cur = buf0 + (it & 1) * share;
    float4* oth = buf0 + ((it + 1) & 1) * share;
    const float2 rs = merge_row(cluster, RowMerge{stat, &rowstat, red, part, cnt, K, g, q}, m, s, it);
    float mr = rs.x, sr = rs.y;
    const float inv = 1.f / sr;
    const long r2 = r + 2 * G;
    float4* dst = y + r * npacks + p0;
    const float4* nsrc = x + (r2 < rows ? r2 : r) * npacks + p0;
    for (int j = tid; j < n; j += NT) {
      const float4 v = cur[j];
      dst[j] = make_float4(__expf(v.x - mr) * inv, __expf(v.y - mr) * inv, __expf(v.z - mr) * inv, __expf(v.w - mr) * inv);
      if (r2 < rows) cp_async16(cur + j, nsrc + j);
    }
    commit();
    m = -INFINITY, s = 0.f;
    if (r + G < rows) {
      wait_g<1>();
      foldall(oth);
    }
  }
  cluster.sync();  // no block exits while a block of its cluster may still read its stat
}



static double check(const float* dx, const float* dy, long rows, long n) {
  std::vector<float> hx(n), hy(n);
  double worst = 0;
  const long picks[] = {0, rows / 2, rows - 1};
  for (long r : picks) {
    CK(cudaMemcpy(hx.data(), dx + r * n, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hy.data(), dy + r * n, n * 4, cudaMemcpyDeviceToHost));
    double mx = -INFINITY, sum = 0;
    for (long i = 0; i < n; ++i) mx = std::max(mx, (double)hx[i]);
    for (long i = 0; i < n; ++i) sum += std::exp((double)hx[i] - mx);
    for (long i = 0; i < n; ++i) {
      const double ref = std::exp((double)hx[i] - mx) / sum;
      worst = std::max(worst, std::fabs(hy[i] - ref) / (std::fabs(ref) + 1e-30));
    }
  }
  return worst;
}

// A persistent row-group kernel's launch: clusters of cs blocks of nt threads, K clusters a row, as many row groups as
// the GPU holds at once (at most `rows`), cooperative where a row has several clusters. Returns the groups G (0: the
// plan does not fit, or the occupancy query was refused); cfg's attributes live in `at`.
template <typename Kern>
static int group_launch(Kern kern, int cs, int K, int nt, size_t smem, long rows, cudaLaunchConfig_t& cfg,
                        cudaLaunchAttribute (&at)[2]) {
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  if (cs > 8) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cfg = {};
  cfg.blockDim = dim3(nt), cfg.dynamicSmemBytes = smem, cfg.gridDim = dim3(cs);
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = cs, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
  at[1].id = cudaLaunchAttributeCooperative, at[1].val.cooperative = 1;
  cfg.attrs = at, cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const int G = (int)std::min<long>(rows, clusters / K);
  if (G < 1) return 0;
  cfg.gridDim = dim3(G * K * cs);
  cfg.numAttrs = K > 1 ? 2 : 1;
  return G;
}

int main(int argc, char** argv) {
  const long rows = atol(argv[1]), n = atol(argv[2]), npacks = n / 4;
  int dev = 0, sms = 0, optin = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  float *x, *y, *z;
  const size_t bytes = (size_t)rows * n * 4;
  CK(cudaMalloc(&x, bytes));
  CK(cudaMalloc(&y, bytes));
  CK(cudaMalloc(&z, bytes));
  fill<<<1024, 256>>>(x, rows * n, 1234u, 8.f, 0.f);
  float2* part;
  unsigned* cnt;
  CK(cudaMalloc(&part, 1 << 20));
  CK(cudaMalloc(&cnt, 1 << 16));
  const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(z, x, bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_gbps = 2.0 * bytes / copy_ms / 1e6;
  printf("%ld x %ld fp32: copy %.1f us, %.0f GB/s; %d SMs\n", rows, n, copy_ms * 1e3, copy_gbps, sms);
  auto report = [&](const char* name, float ms) {
    const double err = check(x, y, rows, n);
    printf("%-28s %9.1f us  %.3f of copy  err %.2e\n", name, ms * 1e3, copy_ms / ms, err);
    CK(cudaMemset(y, 0, bytes));
  };
  // NCU_PLAN=1: the op's plan alone (clusters of 2, 8 a row: pk), launched as the op launches it (cooperative) and
  // without the cooperative attribute (every block is resident either way: G is what the GPU holds at once), each
  // checked against the reference. A profiler that drops a cooperative launch's clusters shows as a wrong first row.
  if (getenv("NCU_PLAN")) {
    auto kern = pk<4, 512, false>;
    const int cs = 2, K = 8, share = (int)((npacks + cs * K - 1) / (cs * K));
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[2];
    const int G = group_launch(kern, cs, K, 512, (size_t)share * 16, rows, cfg, at);
    if (G < 1) return printf("the op's plan does not fit this GPU\n"), 1;
    for (int coop = 1; coop >= 0; --coop) {
      cfg.numAttrs = 1 + coop;
      auto launch = [&] {
        CK(cudaMemsetAsync(cnt, 0, G * 4));
        CK(cudaLaunchKernelEx(&cfg, kern, (const float4*)x, (float4*)y, rows, npacks, share, K, G, part, cnt));
      };
      char name[80];
      snprintf(name, sizeof name, "pk cs2 K8 G%d %s", G, coop ? "cooperative" : "not cooperative");
      report(name, time_ms(launch));
    }
    return 0;
  }
  // today's kernel: cluster of 8 (when the share fits)
  {
    const int cs = 8, share = (int)((npacks + cs - 1) / cs);
    const size_t smem = (size_t)share * 16;
    if ((int)smem <= optin - 1024) {
      CK(cudaFuncSetAttribute(v3, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3((unsigned)(rows * cs)), cfg.blockDim = dim3(512), cfg.dynamicSmemBytes = smem;
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeClusterDimension;
      at[0].val.clusterDim.x = cs, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
      cfg.attrs = at, cfg.numAttrs = 1;
      report("v3 cluster 8", time_ms([&] { CK(cudaLaunchKernelEx(&cfg, v3, (const float4*)x, (float4*)y, rows, npacks, share)); }));
    }
  }
  const int plans[][2] = {{2, 8}, {4, 4}, {1, 16}, {2, 16}};
  using K_t = void (*)(const float4*, float4*, long, long, int, int, int, float2*, unsigned*);
  struct V { K_t k; int d, nt, st; };
  // st: 0 pk, 2 pk2 (two shares a block), 3 and 4 pkr with 2 and 1 spare chunks
  const V vars[] = {{pk<4, 512, false>, 4, 512, 0}, {pk2<512>, 0, 512, 2}, {pk2<1024>, 0, 1024, 2}, {pk2<256>, 0, 256, 2},
                    {pkr<4, 512, 2>, 4, 512, 3}, {pkr<4, 512, 1>, 4, 512, 4}};
  for (auto& pl : plans) {
    const int cs = pl[0], K = pl[1];
    const int share = (int)((npacks + cs * K - 1) / (cs * K));
    for (const V& v : vars) {
      const int spare = v.st == 3 ? 2 : v.st == 4 ? 1 : 0;
      const size_t smem = spare ? (size_t)((share + v.nt - 1) / v.nt + spare) * v.nt * 16
                                : (size_t)share * 16 * (v.st == 2 ? 2 : 1);
      if ((int)smem > optin - 1024) continue;
      auto kern = v.k;
      cudaLaunchConfig_t cfg;
      cudaLaunchAttribute at[2];
      const int G = group_launch(kern, cs, K, v.nt, smem, rows, cfg, at);
      if (G < 1) continue;
      auto launch = [&] {
        if (K > 1) CK(cudaMemsetAsync(cnt, 0, G * 4));
        CK(cudaLaunchKernelEx(&cfg, kern, (const float4*)x, (float4*)y, rows, npacks, share, K, G, part, cnt));
      };
      CK(cudaMemsetAsync(cnt, 0, G * 4));
      cudaError_t e = cudaLaunchKernelEx(&cfg, kern, (const float4*)x, (float4*)y, rows, npacks, share, K, G, part, cnt);
      if (e != cudaSuccess) { printf("  cs%d K%d: %s\n", cs, K, cudaGetErrorString(e)); cudaGetLastError(); continue; }
      CK(cudaDeviceSynchronize());
      char name[80];
      snprintf(name, sizeof name, "%s D%d nt%d st%d cs%d K%d G%d (%d blocks)", spare ? "pkr" : "pk", v.d, v.nt, v.st, cs,
               K, G, G * K * cs);
      report(name, time_ms(launch));
      if (cs == 2 && K == 8 && v.k == vars[0].k) {  // the op's plan: where its blocks' time goes
        auto pkern = pk<4, 512, false, true>;
        CK(cudaFuncSetAttribute(pkern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CK(cudaMemsetAsync(cnt, 0, G * 4));
        CK(cudaLaunchKernelEx(&cfg, pkern, (const float4*)x, (float4*)y, rows, npacks, share, K, G, part, cnt));
        CK(cudaDeviceSynchronize());
        static long long h[4096][P_N];
        CK(cudaMemcpyFromSymbol(h, g_prof, sizeof h));
        const int nb = std::min(G * K * cs, 4096);
        double sum[P_N] = {};
        for (int b = 0; b < nb; ++b)
          for (int k = 0; k < P_N; ++k) sum[k] += (double)h[b][k];
        printf("  phases (thread 0 of each of %d blocks, share of its cycles): first row %.3f, merges %.3f (of which "
               "waiting on the row's other clusters %.3f), write and copy %.3f\n",
               nb, sum[P_FIRST] / sum[P_ALL], sum[P_MERGE] / sum[P_ALL], sum[P_WAIT] / sum[P_ALL],
               sum[P_WRITE] / sum[P_ALL]);
      }
    }
  }
  return 0;
}
