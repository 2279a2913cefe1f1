// softmax over the last dim of contiguous rows: y = exp(x - max) / sum(exp(x - max)), fp32 math.
//
// Bytes: ideal 1 read + 1 write of the tensor. v1 reads each row twice (pass 1: online max and sum,
// pass 2: normalize and write); the second read hits L1/L2 for rows up to ~100 KB, beyond that it is a
// second DRAM read (1.5x the ideal traffic).
// Limits: any row length; v1 takes one block a row (few giant rows use few SMs: v3 spreads them).
// Versions: v1 — block per row, 16-byte loads when every row is 16-byte aligned.
// v2 — the row in registers (common.cuh, rows_config): 1 read + 1 write for rows of up to 32768
// elements that are a multiple of 16 bytes and aligned; several short rows per block, reduced with shuffles. v1 does the rest.
// v3 — rows too long for registers (Hopper, 16-byte aligned rows of a multiple of 16 bytes): a row's shares held in
// the shared memory of 2 to 2 x 132 blocks (two an SM), in clusters of 2, the clusters of a row merging their
// (max, sum) through a small zeroed workspace; a persistent grid copies each group's next row into the slots its
// current row's writes free, so reads and writes overlap: 1 read + 1 write for rows of up to ~29 MB (the plan's
// measurements: benchmarks/PERF_LOG.md). v1 does the rest, and any GPU without clusters.
// Backward: dx = y * (dy - sum(dy * y)); block per row, reads y and dy twice (the second time from L1/L2 for
// rows up to ~100 KB), writes dx once.
#include "common.cuh"

#include <cooperative_groups.h>

#include <algorithm>

namespace tiered_ops {

template <typename T, int V>
__global__ void softmax_v1_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    float m = -INFINITY, s = 0.f;  // this thread's running max and sum of exp(x - m)
    for_row<V>(n, [&](int64_t i) {
      float v[V];
      load_f<T, V>(xr, i, v);
      float mx = v[0];
      bool nan = v[0] != v[0];
#pragma unroll
      for (int j = 1; j < V; ++j) mx = fmaxf(mx, v[j]), nan |= v[j] != v[j];
      if (nan) s = NAN;  // fmaxf drops NaN; a NaN sum makes the whole row NaN, as in torch
      const float m_new = fmaxf(m, mx);
      if (m_new == -INFINITY) return;  // everything so far is -inf: nothing to add
      s *= __expf(m - m_new);
#pragma unroll
      for (int j = 0; j < V; ++j) s += __expf(v[j] - m_new);
      m = m_new;
    });
    const float m_row = block_max(m, smem);
    const float s_row = block_sum(s * (m == -INFINITY ? 0.f : __expf(m - m_row)), smem);
    const float inv = 1.f / s_row;
    for_row<V>(n, [&](int64_t i) {
      float v[V];
      load_f<T, V>(xr, i, v);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = __expf(v[j] - m_row) * inv;
      store_f<T, V>(yr, i, v);
    });
  });
}

template <typename T, int P>
__global__ void __launch_bounds__(1024, 1) softmax_v2_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int n, int tpr) {
  constexpr int V = Pack<T>::N;
  __shared__ float smem[32];
  for_reg_rows(rows, n, tpr, [&](const RegRow& row) {
    const int64_t r = row.r;
    Pack<T> q[P];  // raw: 4 registers a pack
    float m = -INFINITY;
    row.load<P, V>(x + r * n, q, [&](float v) { m = fmaxf(m, v); });
    m = group_max(m, tpr, smem);
    float s = 0.f;  // a NaN anywhere makes s NaN, so the whole row is NaN, as in torch
    row.each<P, V>([&](int p, int) {
#pragma unroll
      for (int j = 0; j < V; ++j) s += __expf(to_f(q[p].v[j]) - m);
    });
    const float inv = 1.f / group_sum(s, tpr, smem);
    row.each<P, V>([&](int p, int i) {
      float a[V];
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = __expf(to_f(q[p].v[j]) - m) * inv;
      store_f<T, V>(y, r * n + i, a);
    });
  });
}

// ---- v3: a row held across blocks, a persistent grid of row groups ----
constexpr int kGroupThreads = 512;
constexpr int kFoldLag = 4;  // copies a thread keeps in flight before it folds the oldest into its (max, sum)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A pack folded into a running (max, sum of exp(x - max)). fmaxf drops NaN, so a NaN makes the sum NaN: the whole
// row is NaN, as in torch.
template <typename T>
__device__ __forceinline__ void fold_pack(const Pack<T>& q, float& m, float& s) {
  constexpr int V = Pack<T>::N;
  float mx = to_f(q.v[0]);
  bool nan = false;
#pragma unroll
  for (int k = 0; k < V; ++k) mx = fmaxf(mx, to_f(q.v[k])), nan |= to_f(q.v[k]) != to_f(q.v[k]);
  if (nan) s = NAN;
  const float m_new = fmaxf(m, mx);
  if (m_new == -INFINITY) return;
  s *= __expf(m - m_new);
#pragma unroll
  for (int k = 0; k < V; ++k) s += __expf(to_f(q.v[k]) - m_new);
  m = m_new;
}

// Two (max, sum) pairs as one; a NaN sum stays NaN (NaN * 0).
__device__ __forceinline__ float2 merge_stat(float2 a, float2 b) {
  const float m = fmaxf(a.x, b.x);
  return make_float2(m, a.y * (a.x == -INFINITY ? 0.f : __expf(a.x - m)) +
                            b.y * (b.x == -INFINITY ? 0.f : __expf(b.x - m)));
}

// Row group g (of G = gridDim / (cs * K), each K clusters of cs blocks) takes rows g, g + G, ...; block k of the
// group's cluster q holds packs [(q * cs + k) * share, + share) of the row in shared memory, each thread its own packs
// (j = tid, tid + blockDim, ...), so its cp.async waits are all the ordering its slots need. As a thread writes row
// r's packs it copies row r + G's into the slots they free and folds them into its (max, sum) kFoldLag copies
// behind: reads and writes overlap, x is read once. A cluster merges its blocks' (max, sum) through distributed
// shared memory (by the iteration's parity, one barrier a row); K > 1 clusters merge through `ws` (zeroed: G counts,
// then two (max, sum) slots a cluster by parity). Every block of the grid is resident at once (a cooperative launch).
// A launch whose clusters are not the plan's `want_cs` blocks traps (the launch fails) instead of merging the wrong
// blocks' statistics: a profiler that replays a cooperative launch has dropped its clusters.
template <typename T>
__global__ void __launch_bounds__(kGroupThreads) softmax_v3_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                   int64_t rows, int64_t n, int share, int K,
                                                                   int want_cs, unsigned* ws) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int V = Pack<T>::N;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Pack<T>* buf = reinterpret_cast<Pack<T>*>(smem_raw);
  __shared__ float red[32];
  __shared__ float2 stat[2], row_stat;
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks(), rank = (int)cluster.block_rank(), tid = threadIdx.x, nt = blockDim.x;
  if (cs != want_cs) {
    if (blockIdx.x == 0 && tid == 0)
      printf("tiered_ops softmax: launched in clusters of %d blocks where its plan has %d; stopping the launch\n", cs,
             want_cs);
    __trap();
  }
  const int c = blockIdx.x / cs, g = c / K, q = c % K, G = gridDim.x / (cs * K);
  const int64_t npacks = n / V, p0 = (int64_t)(q * cs + rank) * share;
  const int cnt = (int)max((int64_t)0, min((int64_t)share, npacks - p0)), chunks = (cnt + nt - 1) / nt;
  unsigned* count = ws + g;
  float2* slots = reinterpret_cast<float2*>(ws + ((G + 1) & ~1)) + (int64_t)g * K * 2;
  float m = -INFINITY, s = 0.f;
  auto fold = [&](int cc) {
    const int j = cc * nt + tid;
    if (j < cnt) fold_pack(buf[j], m, s);
  };
  auto fold_rest = [&] {
    cp_async_wait<0>();
    for (int cc = max(0, chunks - kFoldLag); cc < chunks; ++cc) fold(cc);
  };
  int64_t r = g;
  if (r < rows) {  // the group's first row
    const Pack<T>* src = reinterpret_cast<const Pack<T>*>(x + r * n) + p0;
    for (int cc = 0; cc < chunks; ++cc) {
      const int j = cc * nt + tid;
      if (j < cnt) cp_async16(buf + j, src + j);
      cp_async_commit();
      if (cc >= kFoldLag) cp_async_wait<kFoldLag>(), fold(cc - kFoldLag);
    }
    fold_rest();
  }
  for (int it = 0; r < rows; r += G, ++it) {
    const float mb = block_max(m, red);
    const float sb = block_sum(s * (m == -INFINITY ? 0.f : __expf(m - mb)), red);
    if (tid == 0) stat[it & 1] = make_float2(mb, sb);
    cluster.sync();  // this iteration's stats written; the last iteration's, of the other parity, all read
    float2 rs = make_float2(-INFINITY, 0.f);
    for (int k = 0; k < cs; ++k) rs = merge_stat(rs, *cluster.map_shared_rank(&stat[it & 1], k));
    if (K > 1) {
      if (tid == 0) {
        float2* slot = slots + (it & 1);
        if (rank == 0) __stcg(slot + 2 * q, rs), __threadfence(), atomicAdd(count, 1u);
        while (load_acquire(count) < (unsigned)K * (unsigned)(it + 1)) {
        }
        rs = make_float2(-INFINITY, 0.f);
        for (int k = 0; k < K; ++k) rs = merge_stat(rs, __ldcg(slot + 2 * k));
        row_stat = rs;
      }
      __syncthreads();
      rs = row_stat;
    }
    const float mr = rs.x, inv = 1.f / rs.y;
    const bool more = r + G < rows;
    Pack<T>* dst = reinterpret_cast<Pack<T>*>(y + r * n) + p0;
    const Pack<T>* next = reinterpret_cast<const Pack<T>*>(x + (more ? r + G : r) * n) + p0;
    m = -INFINITY, s = 0.f;
    for (int cc = 0; cc < chunks; ++cc) {
      const int j = cc * nt + tid;
      if (j < cnt) {
        const Pack<T> v = buf[j];
        Pack<T> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_f<T>(__expf(to_f(v.v[k]) - mr) * inv);
        dst[j] = o;
        if (more) cp_async16(buf + j, next + j);  // the slot's pack is in registers: the next row's may land
      }
      cp_async_commit();
      if (more && cc >= kFoldLag) cp_async_wait<kFoldLag>(), fold(cc - kFoldLag);
    }
    if (more) fold_rest();
  }
  cluster.sync();  // no block exits while another of its cluster may still read its stat
#endif
}

struct DeviceFacts {
  int sms = 0, smem_optin = 0, major = 0;
};

static DeviceFacts device_facts() {
  static DeviceFacts facts[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return {};
  DeviceFacts& f = facts[dev];
  if (f.sms == 0) {  // a benign race: every thread computes the same facts
    DeviceFacts g;
    cudaDeviceGetAttribute(&g.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cudaDeviceGetAttribute(&g.major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, dev);
    f = g;
  }
  return f;
}

// v3's plan for rows of n elements of T (cs 0: v3 does not apply): clusters of cs = 2 blocks, K clusters a row, G row
// groups. Blocks a row: the fewest (a power of two) whose shares fit two blocks an SM (the loads of one overlap the
// other's merge), doubled while the rows leave SMs idle and a share keeps 4 packs a thread. Clusters of 2 merged
// through global memory ran faster on an H200 than clusters of 4 or 8 a row, or no clusters (benchmarks/PERF_LOG.md).
struct GroupPlan {
  int cs = 0, K = 0, G = 0, share = 0;
  size_t smem = 0;
  int64_t workspace() const { return K > 1 ? (int64_t)((G + 1) & ~1) * 4 + (int64_t)G * K * 2 * 8 : 0; }
};

static cudaLaunchConfig_t group_config(const GroupPlan& p, cudaLaunchAttribute* attr, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(p.G * p.K * p.cs)), cfg.blockDim = dim3(kGroupThreads);
  cfg.dynamicSmemBytes = p.smem, cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)p.cs, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeCooperative, attr[1].val.cooperative = 1;
  cfg.attrs = attr, cfg.numAttrs = p.K > 1 ? 2 : 1;  // every block resident at once where clusters wait on others
  return cfg;
}

// Clusters of this size and shared memory the GPU holds at once (0 where none): asked again only when the device or
// the shared memory changes (a benign race: the same answer either way).
template <typename T>
static int resident_clusters(const GroupPlan& p) {
  struct Known { size_t smem = 0; int clusters = 0; };
  static Known known[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  Known& k = known[dev];
  if (k.smem != p.smem) {
    auto kernel = softmax_v3_kernel<T>;
    GroupPlan one = p;
    one.G = 1, one.K = 1;
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg = group_config(one, attr, nullptr);
    int clusters = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess)
      clusters = 0;
    cudaGetLastError();  // a refused query leaves no error behind for the next launch to report
    k = Known{p.smem, clusters};
  }
  return k.clusters;
}

template <typename T>
static GroupPlan group_plan(int64_t rows, int64_t n, bool aligned) {
  constexpr int V = Pack<T>::N;
  GroupPlan p;
  const DeviceFacts f = device_facts();
  if (f.major < 9 || !aligned || n % V != 0) return p;
  const int64_t npacks = n / V, fit = (f.smem_optin / 2 - 1024) / 16;  // packs a block holds, two an SM
  int64_t blocks = 2;
  while ((npacks + blocks - 1) / blocks > fit && blocks <= f.sms) blocks *= 2;
  while (rows * blocks < f.sms && (npacks + 2 * blocks - 1) / (2 * blocks) >= 4 * kGroupThreads) blocks *= 2;
  p.cs = 2, p.K = (int)(blocks / 2), p.share = (int)((npacks + blocks - 1) / blocks), p.smem = (size_t)p.share * 16;
  if (p.share > fit) return GroupPlan{};  // longer rows than the GPU holds
  p.G = (int)std::min<int64_t>(rows, resident_clusters<T>(p) / p.K);
  return p.G > 0 ? p : GroupPlan{};
}

template <typename T>
static cudaError_t launch_softmax(const T* x, T* y, int64_t rows, int64_t n, void* workspace, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool aligned = aligned16(x) && aligned16(y);
  const RowsConfig c = rows_config(rows, n, V, aligned);
  if (c.packs) {
    TIERED_OPS_WITH_PACKS(c.packs, V, P,
                          softmax_v2_kernel<T, P><<<c.blocks, c.threads, 0, stream>>>(x, y, rows, (int)n, c.tpr));
    return cudaGetLastError();
  }
  const GroupPlan p = group_plan<T>(rows, n, aligned);
  if (p.cs && (workspace || !p.workspace())) {
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg = group_config(p, attr, stream);
    return cudaLaunchKernelEx(&cfg, softmax_v3_kernel<T>, x, y, rows, n, p.share, p.K, p.cs,
                              static_cast<unsigned*>(workspace));
  }
  const bool vec = n % V == 0 && aligned;
  return launch_block_rows(vec, V, softmax_v1_kernel<T, V>, softmax_v1_kernel<T, 1>, rows, n, stream, x, y, rows, n);
}

template <typename T>
static int64_t workspace_of(const void* x, const void* y, int64_t rows, int64_t n) {
  const bool aligned = aligned16(x) && aligned16(y);
  if (rows_config(rows, n, Pack<T>::N, aligned).packs) return 0;
  return group_plan<T>(rows, n, aligned).workspace();
}

int64_t softmax_fwd_workspace(const void* x, const void* y, int64_t rows, int64_t n, DType dtype) {
  if (rows == 0 || n == 0) return 0;
  switch (dtype) {
    case DType::F32: return workspace_of<float>(x, y, rows, n);
    case DType::F16: return workspace_of<__half>(x, y, rows, n);
    case DType::BF16: return workspace_of<__nv_bfloat16>(x, y, rows, n);
    default: return 0;
  }
}

cudaError_t softmax_fwd(const void* x, void* y, int64_t rows, int64_t n, DType dtype, void* workspace,
                        cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_softmax(static_cast<const T*>(x), static_cast<T*>(y), rows, n, workspace, stream));
  return cudaSuccess;
}

template <typename T, int V>
__global__ void softmax_bwd_v1_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                                      int64_t rows, int64_t n) {
  __shared__ float smem[32];
  for_block_rows(rows, [&](int64_t r) {
    const int64_t base = r * n;
    float s = 0.f;
    for_row<V>(n, [&](int64_t i) {
      float a[V], b[V];
      load_f<T, V>(y, base + i, a);
      load_f<T, V>(dy, base + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) s += a[j] * b[j];
    });
    s = block_sum(s, smem);
    for_row<V>(n, [&](int64_t i) {
      float a[V], b[V];
      load_f<T, V>(y, base + i, a);
      load_f<T, V>(dy, base + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = a[j] * (b[j] - s);
      store_f<T, V>(dx, base + i, a);
    });
  });
}

template <typename T>
static cudaError_t launch_softmax_bwd(const T* dy, const T* y, T* dx, int64_t rows, int64_t n, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool vec = n % V == 0 && aligned16(dy) && aligned16(y) && aligned16(dx);
  return launch_block_rows(vec, V, softmax_bwd_v1_kernel<T, V>, softmax_bwd_v1_kernel<T, 1>, rows, n, stream, dy, y,
                           dx, rows, n);
}

cudaError_t softmax_bwd(const void* dy, const void* y, void* dx, int64_t rows, int64_t n, DType dtype,
                        cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_softmax_bwd(static_cast<const T*>(dy), static_cast<const T*>(y),
                                                static_cast<T*>(dx), rows, n, stream));
  return cudaSuccess;
}

}  // namespace tiered_ops
