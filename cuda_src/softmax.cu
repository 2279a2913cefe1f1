// softmax over the last dim of contiguous rows: y = exp(x - max) / sum(exp(x - max)), fp32 math.
//
// Bytes: ideal 1 read + 1 write of the tensor. v1 reads each row twice (pass 1: online max and sum,
// pass 2: normalize and write); the second read hits L1/L2 for rows up to ~100 KB, beyond that it is a
// second DRAM read (1.5x the ideal traffic).
// Limits: any row length (the block loops over the row); one block per row, so few-row giant rows
// use few SMs (a split-row version is the next one to add).
// Versions: v1 — block per row, 16-byte loads when every row is 16-byte aligned.
// v2 — the row in registers (common.cuh, rows_config): 1 read + 1 write for rows of up to 32768
// elements that are a multiple of 16 bytes and aligned; several short rows per block, reduced with shuffles. v1 does the rest.
// v3 — rows too long for registers (Hopper, 16-byte aligned rows of a multiple of 16 bytes): a thread-block cluster
// of 2 to 8 blocks per row, each block holding its share of the row in shared memory (cp.async, eight chunks in
// flight), the blocks' (max, sum) combined through distributed shared memory: 1 read + 1 write for rows of up to
// 8 x ~220 KB; rows up to 16 x ~220 KB take a cluster of 16 (non-portable) where the GPU places one. 16 is not taken
// where 8 fits: on an H100 a 393216-float row over 16 blocks of 96 KB ran at 0.81 of copy (0.58 holding two rows'
// shares, persistent) against 0.87 over 8 of 192 KB. v1 does the rest, and any GPU without clusters.
// Backward: dx = y * (dy - sum(dy * y)); block per row, reads y and dy twice (the second time from L1/L2 for
// rows up to ~100 KB), writes dx once.
#include "common.cuh"

#include <cooperative_groups.h>

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

// ---- v3: a cluster per row ----
constexpr int kClusterThreads = 512;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Row r of the grid's clusters; each block of the cluster (rank k) holds packs [k * share, (k + 1) * share) of it.
// Each thread copies, reads and writes only its own packs (j = tid, tid + blockDim, ...), so its cp.async waits
// are all the ordering pass 1 needs; the cluster barriers order the blocks' (max, sum) exchange.
template <typename T>
__global__ void __launch_bounds__(kClusterThreads) softmax_v3_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                     int64_t rows, int64_t n, int share) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int V = Pack<T>::N;
  constexpr int kChunksInFlight = 8;  // cp.async chunks of blockDim packs each thread keeps outstanding
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Pack<T>* buf = reinterpret_cast<Pack<T>*>(smem_raw);
  __shared__ float red[32];
  __shared__ float2 stat;  // this block's (max, sum of exp(x - max)), read by the cluster's blocks
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t npacks = n / V, p0 = (int64_t)rank * share;
  const int cnt = (int)max((int64_t)0, min((int64_t)share, npacks - p0));
  const int chunks = (cnt + nt - 1) / nt;
  for (int64_t r = blockIdx.x / cs; r < rows; r += gridDim.x / cs) {
    const Pack<T>* src = reinterpret_cast<const Pack<T>*>(x + r * n) + p0;
    auto issue = [&](int c) {
      const int j = c * nt + tid;
      if (c < chunks && j < cnt) cp_async16(buf + j, src + j);
      cp_async_commit();  // an empty group where there is nothing to copy: the wait counts stay uniform
    };
#pragma unroll
    for (int c = 0; c < kChunksInFlight; ++c) issue(c);
    float m = -INFINITY, s = 0.f;  // this thread's running max and sum of exp(x - m)
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<kChunksInFlight - 1>();  // chunk c (this thread's copy of it) has landed
      const int j = c * nt + tid;
      if (j < cnt) {
        const Pack<T> q = buf[j];
        float mx = to_f(q.v[0]);
        bool nan = false;
#pragma unroll
        for (int k = 0; k < V; ++k) mx = fmaxf(mx, to_f(q.v[k])), nan |= to_f(q.v[k]) != to_f(q.v[k]);
        if (nan) s = NAN;  // fmaxf drops NaN; a NaN sum makes the whole row NaN, as in torch
        const float m_new = fmaxf(m, mx);
        if (m_new != -INFINITY) {
          s *= __expf(m - m_new);
#pragma unroll
          for (int k = 0; k < V; ++k) s += __expf(to_f(q.v[k]) - m_new);
          m = m_new;
        }
      }
      issue(c + kChunksInFlight);
    }
    cp_async_wait<0>();
    const float mb = block_max(m, red);
    const float sb = block_sum(s * (m == -INFINITY ? 0.f : __expf(m - mb)), red);
    if (tid == 0) stat = make_float2(mb, sb);
    cluster.sync();  // every block's stat is written and visible to the cluster
    float mr = -INFINITY;
    for (int k = 0; k < cs; ++k) mr = fmaxf(mr, cluster.map_shared_rank(&stat, k)->x);
    float sr = 0.f;
    for (int k = 0; k < cs; ++k) {
      const float2 o = *cluster.map_shared_rank(&stat, k);
      sr += o.y * (o.x == -INFINITY ? 0.f : __expf(o.x - mr));
    }
    cluster.sync();  // every block has read the stats: they may be written again, or the block may exit
    const float inv = 1.f / sr;
    Pack<T>* dst = reinterpret_cast<Pack<T>*>(y + r * n) + p0;
    for (int j = tid; j < cnt; j += nt) {
      const Pack<T> q = buf[j];
      Pack<T> o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = from_f<T>(__expf(to_f(q.v[k]) - mr) * inv);
      dst[j] = o;
    }
  }
#endif
}

// The cluster plan of rows of n elements of T: its size (0: v3 does not apply) and the packs per block.
struct ClusterPlan {
  int size = 0, share = 0;
  size_t smem = 0;
};

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

// The smallest cluster (of at most `most` blocks) whose blocks' shares fit two blocks an SM (loads of one overlap the
// other's math), else one an SM; the largest where the rows are too few to fill the GPU otherwise.
static ClusterPlan cluster_plan(int64_t rows, int64_t n, int V, bool aligned, int most) {
  ClusterPlan p;
  const DeviceFacts f = device_facts();
  if (f.major < 9 || !aligned || n % V != 0) return p;
  const int64_t npacks = n / V, reserve = 1024;  // static shared memory and the runtime's share
  const int64_t two = (f.smem_optin / 2 - reserve) / 16, one = (f.smem_optin - reserve) / 16;  // packs a block holds
  for (const int64_t fit : {two, one}) {
    for (int cs = 2; cs <= most && !p.size; cs *= 2)
      if ((npacks + cs - 1) / cs <= fit) p.size = cs;
    if (p.size) break;
  }
  if (!p.size) return p;
  if (rows * p.size < f.sms && (npacks + most - 1) / most >= kClusterThreads) p.size = most;
  p.share = (int)((npacks + p.size - 1) / p.size);
  p.smem = (size_t)p.share * 16;
  return p;
}

// The kernel's attributes for this plan: its dynamic shared memory, and a cluster over 8 blocks (non-portable) allowed.
template <typename T>
static cudaError_t set_attributes(const ClusterPlan& p) {
  auto kernel = softmax_v3_kernel<T>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem);
  if (e == cudaSuccess && p.size > 8) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return e;
}

template <typename T>
static cudaError_t launch_softmax_v3(const T* x, T* y, int64_t rows, int64_t n, const ClusterPlan& p,
                                     cudaStream_t stream) {
  auto kernel = softmax_v3_kernel<T>;
  cudaError_t e = set_attributes<T>(p);
  if (e != cudaSuccess) return e;
  const int64_t blocks = rows * p.size;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(blocks < 0x7fffffff ? blocks : 0x7fffffff / p.size * p.size));
  cfg.blockDim = dim3(kClusterThreads);
  cfg.dynamicSmemBytes = p.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)p.size, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr, cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, x, y, rows, n, p.share);
}

// Whether clusters of this plan can be resident at all (a GPU partition too small for them cannot): asked again
// only when the device or the plan changes.
template <typename T>
static bool cluster_fits(const ClusterPlan& p) {
  struct Known { int size = 0; size_t smem = 0; bool fits = false; };
  // per device, portable and non-portable sizes apart: the last plan of each asked about (a benign race: the same
  // answer either way)
  static Known known[64][2];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  Known& k = known[dev][p.size > 8];
  if (k.size != p.size || k.smem != p.smem) {
    auto kernel = softmax_v3_kernel<T>;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(p.size), cfg.blockDim = dim3(kClusterThreads), cfg.dynamicSmemBytes = p.smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)p.size, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr, cfg.numAttrs = 1;
    int clusters = 0;
    const bool ok = set_attributes<T>(p) == cudaSuccess &&
                    cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
    cudaGetLastError();  // a refused query leaves no error behind for the next launch to report
    k = Known{p.size, p.smem, ok};
  }
  return k.fits;
}

template <typename T>
static cudaError_t launch_softmax(const T* x, T* y, int64_t rows, int64_t n, cudaStream_t stream) {
  constexpr int V = Pack<T>::N;
  const bool aligned = aligned16(x) && aligned16(y);
  const RowsConfig c = rows_config(rows, n, V, aligned);
  if (c.packs) {
    TIERED_OPS_WITH_PACKS(c.packs, V, P,
                          softmax_v2_kernel<T, P><<<c.blocks, c.threads, 0, stream>>>(x, y, rows, (int)n, c.tpr));
    return cudaGetLastError();
  }
  for (const int most : {8, 16}) {  // 16 only where 8 does not fit, and where this GPU places such clusters at all
    const ClusterPlan p = cluster_plan(rows, n, V, aligned, most);
    if (p.size && cluster_fits<T>(p)) return launch_softmax_v3(x, y, rows, n, p, stream);
  }
  const bool vec = n % V == 0 && aligned16(x) && aligned16(y);
  return launch_block_rows(vec, V, softmax_v1_kernel<T, V>, softmax_v1_kernel<T, 1>, rows, n, stream, x, y, rows, n);
}

cudaError_t softmax_fwd(const void* x, void* y, int64_t rows, int64_t n, DType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  TIERED_OPS_DISPATCH(dtype, T,
                      return launch_softmax(static_cast<const T*>(x), static_cast<T*>(y), rows, n, stream));
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
