// The torch wrapper of rms_norm.cu: argument checks, the launch, and the op's registration (binding.h).
#include "native_autograd.h"

namespace tiered_ops {

// Host launchers (rms_norm.cu).
// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w (w may be null) for contiguous rows. Hugging Face forms:
// w_offset multiplies by (w + w_offset) in fp32; cast rounds x * rsqrt(...) to the dtype before the weight. w_fp32: w is
// float32 over a bf16/fp16 x (y is then float32 under cast, else x's dtype).
cudaError_t rms_norm_fwd(const void* x, const void* w, void* y, int64_t rows, int64_t n, float eps, DType dtype,
                         cudaStream_t stream, float w_offset, bool cast, bool w_fp32);

// Blocks of rms_norm_bwd's persistent grid: those its dx kernel keeps resident on the current device, at most the rows.
int64_t rms_norm_bwd_blocks(int64_t rows, int64_t n, DType dtype, bool has_w, bool w_fp32, bool dy_fp32);

// rms_norm backward on `blocks` blocks: dx for every row; with w, dw_partial (blocks, n) fp32 partial sums of the
// weight gradient, reduced into dw (w's type) by a second launch. w_offset as in the forward; w_fp32: a float32 w
// over a bf16/fp16 x, with dy float32 when dy_fp32 (the forward's output under cast).
cudaError_t rms_norm_bwd(const void* dy, const void* x, const void* w, void* dx, float* dw_partial, void* dw,
                         int64_t rows, int64_t n, float eps, int64_t blocks, DType dtype, cudaStream_t stream,
                         float w_offset, bool w_fp32, bool dy_fp32);

namespace {

at::Tensor rms_norm_cuda(const at::Tensor& x, c10::IntArrayRef normalized_shape, const c10::optional<at::Tensor>& weight,
                         double eps, double weight_offset, bool cast_before_weight) {
  const char* op = "rms_norm_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  bool w32 = false;
  const at::Tensor wc = hf_norm_weight(weight, x, normalized_shape, weight_offset, cast_before_weight, op, &w32);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc, xc.options().dtype(hf_out_dtype(x, w32, cast_before_weight)));
  if (xc.numel() > 0)
    check_launch(rms_norm_fwd(xc.data_ptr(), ptr_or_null(wc), y.data_ptr(), xc.numel() / n, n, (float)eps,
                              dtype_of(x, op, "x"), stream(), (float)weight_offset, cast_before_weight, w32), op);
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                     c10::IntArrayRef normalized_shape,
                                                     const c10::optional<at::Tensor>& weight, double eps,
                                                     double weight_offset, bool cast_before_weight) {
  const char* op = "rms_norm_bwd_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  bool w32 = false;
  const at::Tensor wc = hf_norm_weight(weight, x, normalized_shape, weight_offset, cast_before_weight, op, &w32);
  const at::ScalarType y_dtype = hf_out_dtype(x, w32, cast_before_weight);
  check_norm_dy(dy, x, y_dtype, op);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  at::Tensor dx = at::empty_like(xc);
  const int64_t rows = n ? xc.numel() / n : 0;
  if (xc.numel() == 0)
    return {dx, wc.defined() ? at::zeros_like(wc) : x.new_empty({0})};
  const int64_t blocks =
      rms_norm_bwd_blocks(rows, n, dtype_of(x, op, "x"), wc.defined(), w32, y_dtype != x.scalar_type());
  at::Tensor partial, dw;
  if (wc.defined()) {
    partial = f32_empty(x, {blocks, n});
    dw = at::empty_like(wc);
  }
  check_launch(rms_norm_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(wc), dx.data_ptr(), f32_or_null(partial),
                            out_or_null(dw), rows, n, (float)eps, blocks, dtype_of(x, op, "x"),
                            stream(), (float)weight_offset, w32, y_dtype != x.scalar_type()),
               op);
  return {dx, wc.defined() ? dw : x.new_empty({0})};
}

// The training call's node: saves x and the weight (ops/rms_norm.py's setup_context); the backward recomputes
// rsqrt(mean(x^2) + eps) from x.
struct RmsNormState {
  static constexpr const char* kName = "RmsNormNode";
  static constexpr size_t kSaved = 2;  // x, weight
  std::vector<int64_t> normalized_shape;
  double eps = 0, weight_offset = 0;
  bool cast_before_weight = false;
  at::ScalarType y_dtype = at::kFloat;

  Grads backward(Grads& grads, std::array<at::Tensor, kSaved>& saved) const {
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    auto [dx, dw] = rms_norm_bwd_cuda(grad_or_zeros(grads[0], x, y_dtype), x, normalized_shape, saved_optional(w),
                                      eps, weight_offset, cast_before_weight);
    return {dx, w.defined() ? dw : at::Tensor()};
  }
};

at::Tensor rms_norm_train_cuda(const at::Tensor& x, std::vector<int64_t> normalized_shape,
                               const c10::optional<at::Tensor>& weight, double eps, double weight_offset,
                               bool cast_before_weight) {
  at::Tensor y;
  {
    const ForwardGuard below_autograd;
    y = rms_norm_cuda(x, normalized_shape, weight, eps, weight_offset, cast_before_weight);
  }
  const at::Tensor w = weight.value_or(at::Tensor());
  record_node("rms_norm_train_cuda",
              RmsNormState{std::move(normalized_shape), eps, weight_offset, cast_before_weight, y.scalar_type()},
              {y}, {{x, false}, {w, false}}, x, weight);
  return y;
}

}  // namespace

TIERED_OPS_CUDA_OP(rms_norm,
                  "rms_norm_cuda(Tensor x, int[] normalized_shape, Tensor? weight, float eps, float weight_offset=0., "
                  "bool cast_before_weight=False) -> Tensor",
                  "rms_norm_bwd_cuda(Tensor dy, Tensor x, int[] normalized_shape, Tensor? weight, float eps, "
                  "float weight_offset=0., bool cast_before_weight=False) -> (Tensor, Tensor)");

TIERED_OPS_CUDA_TRAIN(rms_norm);

}  // namespace tiered_ops
