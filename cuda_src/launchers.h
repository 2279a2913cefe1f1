// What the tiered_ops CUDA kernels and their torch wrappers share: the dtype code. Each op's host launchers (raw
// pointers, sizes and a stream, no torch types) are defined in cuda_src/<op>.cu and declared in its wrapper file
// cuda_src/<op>.cpp, the only caller; each returns the launch's cudaError_t so the wrapper can report it.
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>

namespace tiered_ops {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

}  // namespace tiered_ops
