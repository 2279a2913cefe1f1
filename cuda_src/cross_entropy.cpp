// The torch wrapper of cross_entropy.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launchers (cross_entropy.cu).
// cross_entropy forward over rows of logits (row stride `stride`, last dim contiguous) with int64 targets: float32
// loss[r] (0 for an ignored row, NaN for a target outside [0, n)) and lse[r] = log sum exp of the row.
cudaError_t cross_entropy_fwd(const void* x, const int64_t* target, float* loss, float* lse, int64_t rows, int64_t n,
                              int64_t stride, int64_t ignore_index, float smoothing, DType dtype, cudaStream_t stream);

// One value of out_dtype at `out`: the sum of num[:rows] (sum_rows; the forward's float32 losses) or num[0] (the
// backward's output gradient), with `mean` over the count of targets not ignore_index (NaN for 0 / 0). Any rows, 0
// included.
cudaError_t cross_entropy_reduce(const void* num, DType num_dtype, bool sum_rows, const int64_t* target, void* out,
                                 DType out_dtype, int64_t rows, int64_t ignore_index, bool mean, cudaStream_t stream);

// cross_entropy backward: contiguous dx[r, :] = (exp(x - lse[r]) - s / n - (1 - s) [j == t]) * g[r * g_stride],
// zeros for an ignored row (g_stride 0: one scale for every row).
cudaError_t cross_entropy_bwd(const void* x, const int64_t* target, const float* lse, const float* g, int64_t g_stride,
                              void* dx, int64_t rows, int64_t n, int64_t stride, int64_t ignore_index, float smoothing,
                              DType dtype, cudaStream_t stream);

namespace {

// cross_entropy's reduction: 0 none, 1 mean, 2 sum.
int ce_reduction(c10::string_view reduction, const char* op) {
  if (reduction == "none") return 0;
  if (reduction == "mean") return 1;
  if (reduction == "sum") return 2;
  TORCH_CHECK(false, op, ": reduction must be 'mean', 'sum' or 'none', got '", std::string(reduction), "'");
  return -1;
}

// logits [N, V] (a float dtype, on CUDA) and int64 target [N] on its device; label_smoothing in [0, 1].
void check_ce(const at::Tensor& logits, const at::Tensor& target, double label_smoothing, const char* op) {
  check_cuda(logits, op, "logits");
  dtype_of(logits, op, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, op, ": logits must have shape [N, V] with V >= 1, got ",
              shape_str(logits.sizes()));
  check_cuda(target, op, "target");
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must have dtype int64 (class indices), got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits.device(), op, ": target must be on ", logits.device(), " like logits, got ",
              target.device());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, ": target must have shape [N] = [",
              std::to_string(logits.size(0)), "] for logits of shape ", shape_str(logits.sizes()), ", got ",
              shape_str(target.sizes()));
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ",
              std::to_string(label_smoothing));
}

// Rows whose last dim is contiguous are read in place (with their row stride); others are copied first.
at::Tensor ce_rows(const at::Tensor& logits) { return logits.stride(1) == 1 ? logits : logits.contiguous(); }

std::tuple<at::Tensor, at::Tensor> cross_entropy_cuda(const at::Tensor& logits, const at::Tensor& target,
                                                      int64_t ignore_index, c10::string_view reduction,
                                                      double label_smoothing,
                                                      c10::optional<at::ScalarType> dtype) {
  const char* op = "cross_entropy_cuda";
  check_ce(logits, target, label_smoothing, op);
  const at::ScalarType out = dtype.value_or(logits.scalar_type());
  TORCH_CHECK(out == at::kFloat || out == logits.scalar_type(), op,
              ": dtype must be None, float32 or the logits' dtype (", logits.scalar_type(), "), got ", out);
  const int red = ce_reduction(reduction, op);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor xc = ce_rows(logits), tc = target.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor loss = f32_empty(xc, {rows}), lse = at::empty_like(loss);
  if (rows > 0)
    check_launch(cross_entropy_fwd(xc.data_ptr(), tc.data_ptr<int64_t>(), loss.data_ptr<float>(), lse.data_ptr<float>(),
                                   rows, n, xc.stride(0), ignore_index, (float)label_smoothing,
                                   dtype_of(logits, op, "logits"), stream()), op);
  if (red == 0) return {loss.to(out), lse};
  at::Tensor total = at::empty({}, logits.options().dtype(out));
  check_launch(cross_entropy_reduce(loss.data_ptr(), DType::F32, true, tc.data_ptr<int64_t>(), total.data_ptr(),
                                    dtype_of(total, op, "dtype"), rows, ignore_index, red == 1, stream()),
               op);
  return {total, lse};
}

at::Tensor cross_entropy_bwd_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction,
                                  double label_smoothing) {
  const char* op = "cross_entropy_bwd_cuda";
  check_ce(logits, target, label_smoothing, op);
  const int red = ce_reduction(reduction, op);
  check_cuda(grad, op, "grad");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == logits.scalar_type(), op,
              ": grad must be float32 or the logits' dtype (", logits.scalar_type(), "), got ", grad.scalar_type());
  TORCH_CHECK(grad.device() == logits.device(), op, ": grad must be on ", logits.device(), " like logits, got ",
              grad.device());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(red == 0 ? (grad.dim() == 1 && grad.size(0) == rows) : grad.dim() == 0, op, ": grad must have shape ",
              red == 0 ? "[N]" : "[] (a scalar)", " for reduction '", std::string(reduction), "', got ",
              shape_str(grad.sizes()));
  check_cuda(lse, op, "lse");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 1 && lse.size(0) == rows, op,
              ": lse must be a float32 tensor of shape [N] = [", std::to_string(rows), "], got ",
              shape_str(lse.sizes()));
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor xc = ce_rows(logits), tc = target.contiguous(), lc = lse.contiguous();
  at::Tensor dx = at::empty({rows, n}, logits.options());
  if (rows == 0) return dx;
  at::Tensor scale;
  if (red == 1) {  // the output gradient over the count of rows not ignored, in one launch
    scale = f32_empty(logits, {1});
    check_launch(cross_entropy_reduce(grad.data_ptr(), dtype_of(grad, op, "grad"), false, tc.data_ptr<int64_t>(),
                                      scale.data_ptr(), DType::F32, rows, ignore_index, true, stream()),
                 op);
  } else {
    scale = grad.to(at::kFloat).reshape({-1}).contiguous();
  }
  check_launch(cross_entropy_bwd(xc.data_ptr(), tc.data_ptr<int64_t>(), lc.data_ptr<float>(), scale.data_ptr<float>(),
                                   red == 0 ? 1 : 0, dx.data_ptr(), rows, n, xc.stride(0), ignore_index,
                                   (float)label_smoothing, dtype_of(logits, op, "logits"),
                                   stream()), op);
  return dx;
}

}  // namespace

TIERED_OPS_CUDA_OP(cross_entropy,
                  "cross_entropy_cuda(Tensor logits, Tensor target, int ignore_index, str reduction, float label_smoothing, "
                  "ScalarType? dtype) -> (Tensor, Tensor)",
                  "cross_entropy_bwd_cuda(Tensor grad, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
                  "str reduction, float label_smoothing) -> Tensor");

}  // namespace tiered_ops
