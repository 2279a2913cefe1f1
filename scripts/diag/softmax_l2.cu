// softmax over giant rows: the op's launch (cuda_src/softmax.cu; v3 for these rows: each row held in the shared
// memory of its group's blocks) against a candidate that holds nothing on chip between its two passes and reads each
// row twice, the second time from L2. Each row is cut into P pieces, one a block, and G rows are in flight at once,
// one per group of P blocks (a persistent grid, every block resident). A block reads its piece of row r + G and folds
// it into the piece's (max, sum), publishes it, and only then waits for row r's (max, sum), which the last of row r's
// pieces to publish has merged from all of them a whole piece read earlier: the merge's wait, 15-16 % of a v3 block's
// cycles, falls behind a read. It then reads its piece of row r again (2 x G rows of x stay in L2 between the two
// reads: G x 2 x 1.5 MB at 393216 fp32 columns against the H200's 50 MB) and writes y. With HINT, the first read asks
// L2 to keep its lines (evict_last), the second to drop them (evict_first), and y is written streaming (.cs).
// Per line: kernel time (median of 15 after 3), fraction of a device copy of x's bytes timed in the same run, and the
// worst relative difference from the op's output (the two sum a row in another order: rounding only).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I cuda_src -I scripts/diag \
//     scripts/diag/softmax_l2.cu -o /tmp/sl2 && /tmp/sl2 <rows> <n> [bf16|fp32]
#include <cstring>
#include <string>

#include "diag_timing.cuh"
#include "softmax.cu"
using namespace tiered_ops;

// Block b is piece b % P of group b / P, which takes rows g, g + G, ...; a thread holds packs tid, tid + blockDim,
// ... of the piece (at most KP). `count`: 2 x rows zeroed counters (pieces published a row, then the row's merged
// flag); `part`: rows x P (max, sum); `fin`: a row's merged (max, sum).
template <typename T, int KP, bool HINT>
__global__ void __launch_bounds__(512) softmax_l2_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                                                         int64_t n, int G, int P, int share, unsigned* count,
                                                         float2* part, float2* fin) {
  constexpr int V = Pack<T>::N;
  __shared__ float red[32];
  __shared__ float2 row_stat;
  __shared__ int last;
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x, g = (int)blockIdx.x / P, p = (int)blockIdx.x % P;
  const int64_t npacks = n / V, p0 = (int64_t)p * share;
  const int cnt = (int)max((int64_t)0, min((int64_t)share, npacks - p0));
  unsigned* merged = count + rows;
  const uint64_t keep = HINT ? l2_policy(true) : 0, drop = HINT ? l2_policy(false) : 0;
  auto piece = [&](int64_t r) { return reinterpret_cast<const uint4*>(x + r * n) + p0; };
  auto publish = [&](int64_t r) {  // pass 1 over row r's piece: its (max, sum), merged by the row's last piece
    const uint4* src = piece(r);
    Pack<T> q[KP];
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int j = k * nt + tid;
      if (j < cnt) {
        const uint4 v = load16<HINT>(src + j, keep);
        memcpy(&q[k], &v, 16);
      }
    }
    float m = -INFINITY, s = 0.f;
#pragma unroll
    for (int k = 0; k < KP; ++k)
      if (k * nt + tid < cnt) fold_pack(q[k], m, s);
    const float mb = block_max(m, red);
    const float sb = block_sum(s * (m == -INFINITY ? 0.f : __expf(m - mb)), red);
    if (tid == 0) {
      __stcg(part + r * P + p, make_float2(mb, sb));
      __threadfence();
      last = atomicAdd(count + r, 1u) == (unsigned)P - 1;
    }
    __syncthreads();
    if (last) {
      __threadfence();
      float2 a = make_float2(-INFINITY, 0.f);
      for (int j = tid; j < P; j += nt) a = merge_stat(a, __ldcg(part + r * P + j));
      const float mm = block_max(a.x, red);
      const float ss = block_sum(a.y * (a.x == -INFINITY ? 0.f : __expf(a.x - mm)), red);
      if (tid == 0) {
        __stcg(fin + r, make_float2(mm, ss));
        __threadfence();
        atomicExch(merged + r, 1u);
      }
    }
  };
  auto write = [&](int64_t r) {  // pass 2: row r's piece again (from L2), normalized
    if (tid == 0) {
      while (load_acquire(merged + r) == 0) {
      }
      row_stat = __ldcg(fin + r);
    }
    __syncthreads();
    const float mr = row_stat.x, inv = 1.f / row_stat.y;
    const uint4* src = piece(r);
    uint4* dst = reinterpret_cast<uint4*>(y + r * n) + p0;
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int j = k * nt + tid;
      if (j < cnt) {
        const uint4 v = load16<HINT>(src + j, drop);
        Pack<T> a, o;
        memcpy(&a, &v, 16);
#pragma unroll
        for (int e = 0; e < V; ++e) o.v[e] = from_f<T>(__expf(to_f(a.v[e]) - mr) * inv);
        uint4 w;
        memcpy(&w, &o, 16);
        store16<HINT>(dst + j, w);
      }
    }
    __syncthreads();  // row_stat read by every thread before the next row's is written
  };
  int64_t r = g;
  if (r < rows) publish(r);
  for (; r < rows; r += G) {
    if (r + G < rows) publish(r + G);
    write(r);
  }
}

constexpr int kMaxPieces = 2048;  // pieces a row at most (the partial (max, sum) buffer's width)

template <typename T, int KP, bool HINT>
static void try_plan(const T* x, T* y, int64_t rows, int64_t n, int G, int threads, int sms, unsigned* count,
                     float2* part, float2* fin, float copy_ms, const T* ref, bool* bad) {
  constexpr int V = Pack<T>::N;
  int per_sm = 0;  // every block resident: a block that waits on a row's pieces needs the others running
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, softmax_l2_kernel<T, KP, HINT>, threads, 0));
  const int P = std::min(per_sm * sms / G, kMaxPieces);
  const int64_t npacks = n / V;
  const int share = (int)((npacks + P - 1) / P);
  if (P < 1 || (share + threads - 1) / threads > KP || (KP > 1 && (share + threads - 1) / threads <= KP / 2)) return;
  auto run = [&] {
    CK(cudaMemsetAsync(count, 0, 2 * rows * sizeof(unsigned)));
    softmax_l2_kernel<T, KP, HINT><<<(unsigned)(G * P), threads>>>(x, y, rows, n, G, P, share, count, part, fin);
  };
  const float ms = time_ms(run);
  CK(cudaGetLastError());
  const float w = worst_diff(y, ref, rows * n, 1e-30f);
  const bool ok = w <= (sizeof(T) == 4 ? 1e-5f : 1.6e-2f);
  *bad |= !ok;
  printf("  L2 two-pass %-5s G %2d x P %3d blocks of %3d (%2d packs a thread at most): %8.1f us, %.3f of copy; "
         "worst rel diff from the op %.1e%s\n",
         HINT ? "hint" : "plain", G, P, threads, KP, ms * 1e3f, copy_ms / ms, w, ok ? "" : " (DIFFERS)");
}

template <typename T, int KP>
static void plans(const T* x, T* y, int64_t rows, int64_t n, int threads, int sms, unsigned* count, float2* part,
                  float2* fin, float copy_ms, const T* ref, bool* bad) {
  for (int G : {1, 2, 4, 8, 16}) {
    if (G > rows) continue;
    try_plan<T, KP, false>(x, y, rows, n, G, threads, sms, count, part, fin, copy_ms, ref, bad);
    try_plan<T, KP, true>(x, y, rows, n, G, threads, sms, count, part, fin, copy_ms, ref, bad);
  }
}

template <typename T>
static int run(int64_t rows, int64_t n, DType dt, const char* name) {
  constexpr int V = Pack<T>::N;
  if (n % V) {
    printf("%lldx%lld %s: n is not a multiple of %d\n", (long long)rows, (long long)n, name, V);
    return 1;
  }
  const int64_t m = rows * n;
  T *x, *y, *ref;
  unsigned* count;
  float2 *part, *fin;
  void* ws = nullptr;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaMalloc(&x, m * sizeof(T))); CK(cudaMalloc(&y, m * sizeof(T))); CK(cudaMalloc(&ref, m * sizeof(T)));
  CK(cudaMalloc(&count, 2 * rows * sizeof(unsigned)));
  CK(cudaMalloc(&part, rows * kMaxPieces * sizeof(float2))); CK(cudaMalloc(&fin, rows * sizeof(float2)));
  const int64_t wsb = softmax_fwd_workspace(x, ref, rows, n, dt);
  if (wsb) CK(cudaMalloc(&ws, wsb));
  fill<<<1024, 256>>>(x, m, 1u, 16.f, 0.f);
  const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(y, x, m * sizeof(T), cudaMemcpyDeviceToDevice)); });
  const float op_ms = time_ms([&] {
    if (wsb) CK(cudaMemsetAsync(ws, 0, wsb));
    CK(softmax_fwd(x, ref, rows, n, dt, ws, 0));
  });
  printf("%lldx%lld %s: copy %.1f us; the op %.1f us, %.3f of copy (workspace %lld bytes, zeroed in its time)\n",
         (long long)rows, (long long)n, name, copy_ms * 1e3f, op_ms * 1e3f, copy_ms / op_ms, (long long)wsb);
  bool bad = false;
  for (int threads : {256, 512}) {
    plans<T, 1>(x, y, rows, n, threads, sms, count, part, fin, copy_ms, ref, &bad);
    plans<T, 2>(x, y, rows, n, threads, sms, count, part, fin, copy_ms, ref, &bad);
    plans<T, 4>(x, y, rows, n, threads, sms, count, part, fin, copy_ms, ref, &bad);
    plans<T, 8>(x, y, rows, n, threads, sms, count, part, fin, copy_ms, ref, &bad);
    plans<T, 16>(x, y, rows, n, threads, sms, count, part, fin, copy_ms, ref, &bad);
  }
  return bad ? 2 : 0;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    printf("usage: %s <rows> <n> [bf16|fp32]\n", argv[0]);
    return 1;
  }
  const int64_t rows = atoll(argv[1]), n = atoll(argv[2]);
  const bool bf16 = argc > 3 && std::string(argv[3]) == "bf16";
  return bf16 ? run<__nv_bfloat16>(rows, n, DType::BF16, "bf16") : run<float>(rows, n, DType::F32, "fp32");
}
