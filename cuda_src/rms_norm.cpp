// The torch wrapper of rms_norm.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launchers (rms_norm.cu).
// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w (w may be null) for contiguous rows.
cudaError_t rms_norm_fwd(const void* x, const void* w, void* y, int64_t rows, int64_t n, float eps, DType dtype,
                         cudaStream_t stream);

// rms_norm backward: dx for every row; with w, also rstd per row and dw_partial (ceil(rows / rows_per), n) fp32
// partial sums of the weight gradient (the caller sums them).
cudaError_t rms_norm_bwd(const void* dy, const void* x, const void* w, void* dx, float* rstd, float* dw_partial,
                         int64_t rows, int64_t n, float eps, int64_t rows_per, DType dtype, cudaStream_t stream);

namespace {

at::Tensor rms_norm_cuda(const at::Tensor& x, c10::IntArrayRef normalized_shape, const c10::optional<at::Tensor>& weight,
                         double eps) {
  const char* op = "rms_norm_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  const at::Tensor wc = norm_param(weight, x, normalized_shape, op, "weight");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (xc.numel() > 0)
    check_launch(rms_norm_fwd(xc.data_ptr(), ptr_or_null(wc), y.data_ptr(), xc.numel() / n, n, (float)eps,
                              dtype_of(x, op, "x"), stream()), op);
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                     c10::IntArrayRef normalized_shape,
                                                     const c10::optional<at::Tensor>& weight, double eps) {
  const char* op = "rms_norm_bwd_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  const at::Tensor wc = norm_param(weight, x, normalized_shape, op, "weight");
  check_twin(dy, x, op, "dy");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  at::Tensor dx = at::empty_like(xc);
  const int64_t rows = n ? xc.numel() / n : 0;
  if (xc.numel() == 0)
    return {dx, wc.defined() ? at::zeros_like(wc) : x.new_empty({0})};
  at::Tensor rstd, partial;
  int64_t rows_per = 1;
  if (wc.defined()) {
    rows_per = rows_per_group(rows, n);
    rstd = f32_empty(x, {rows});
    partial = f32_empty(x, {(rows + rows_per - 1) / rows_per, n});
  }
  check_launch(rms_norm_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(wc), dx.data_ptr(),
                            f32_or_null(rstd), f32_or_null(partial), rows, n, (float)eps, rows_per,
                            dtype_of(x, op, "x"), stream()), op);
  return {dx, wc.defined() ? sum_partials(partial, x, normalized_shape) : x.new_empty({0})};
}

}  // namespace

TIERED_OPS_CUDA_OP(rms_norm,
                  "rms_norm_cuda(Tensor x, int[] normalized_shape, Tensor? weight, float eps) -> Tensor",
                  "rms_norm_bwd_cuda(Tensor dy, Tensor x, int[] normalized_shape, Tensor? weight, float eps) "
                  "-> (Tensor, Tensor)");

}  // namespace tiered_ops
