// Host launchers of the tiered_ops CUDA kernels: raw pointers, sizes and a stream, no torch types.
// binding.cpp (the only file that includes torch) validates tensors and calls these; each returns
// the launch's cudaError_t so the binding can report it.
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>

namespace tiered_ops {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// y[r, :] = softmax(x[r, :]) for `rows` contiguous rows of `n` elements.
cudaError_t softmax_fwd(const void* x, void* y, int64_t rows, int64_t n, DType dtype, cudaStream_t stream);

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w (w may be null) for contiguous rows.
cudaError_t rms_norm_fwd(const void* x, const void* w, void* y, int64_t rows, int64_t n, float eps, DType dtype,
                         cudaStream_t stream);

// out = a * b + c over `numel` contiguous elements (fp32 arithmetic, one rounding).
cudaError_t muladd_fwd(const void* a, const void* b, const void* c, void* out, int64_t numel, DType dtype,
                       cudaStream_t stream);

}  // namespace tiered_ops
