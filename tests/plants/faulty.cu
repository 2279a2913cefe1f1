// Planted faulty CUDA kernels for the isolation tests (tests/plants): never part of tiered_ops.
// oob_double writes 4 TiB past its output (an illegal address that poisons the CUDA context);
// spin_double waits on a flag nobody sets (a kernel that never ends). Launchers take raw pointers so this
// file compiles with plain nvcc; the torch binding is binding.cpp.
#include <cstdint>
#include <cuda_runtime.h>

__global__ void oob_double_kernel(float* out, const float* x, int64_t n) {
    int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i < n) out[i + (static_cast<int64_t>(1) << 40)] = 2.0f * x[i];
}

__global__ void spin_double_kernel(float* out, const float* x, int64_t n, const volatile int* flag) {
    while (*flag == 0) {
    }
    int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i < n) out[i] = 2.0f * x[i];
}

void launch_oob_double(float* out, const float* x, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    oob_double_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(out, x, n);
}

void launch_spin_double(float* out, const float* x, int64_t n, const int* flag, cudaStream_t stream) {
    if (n == 0) return;
    spin_double_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(out, x, n, flag);
}
