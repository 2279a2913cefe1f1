// The torch wrapper of fused_add_rms_norm.cu: argument checks, the launch, and the op's registration (binding.h).
#include "native_autograd.h"

namespace tiered_ops {

// Host launchers (fused_add_rms_norm.cu).
// fused_add_rms_norm forward: s = x + residual (rounded once to the dtype), y = s * rsqrt(mean(s^2) + eps) * w
// (w may be null), with the per-row fp32 rstd out. Hugging Face forms on y: w_offset multiplies by (w + w_offset) in
// fp32; cast rounds s * rstd to the dtype before the weight. w_fp32: w is float32 over a bf16/fp16 x (y is then
// float32 under cast, else x's dtype).
cudaError_t fused_add_rms_norm_fwd(const void* x, const void* residual, const void* w, void* y, void* s, float* rstd,
                                   int64_t rows, int64_t n, float eps, DType dtype, cudaStream_t stream,
                                   float w_offset, bool cast, bool w_fp32);

// Blocks of fused_add_rms_norm_bwd's persistent grid: those its dx kernel keeps resident on the current device, at most
// the rows.
int64_t fused_add_rms_norm_bwd_blocks(int64_t rows, int64_t n, DType dtype, bool has_w, bool w_fp32,
                                      bool dy_fp32);

// fused_add_rms_norm backward from s and the saved rstd on `blocks` blocks: dx = ds + rms_norm's dx of dy at s; with
// w, dw_partial and dw as for rms_norm_bwd. w_offset as in the forward; w_fp32: a float32 w over a bf16/fp16 s, with
// dy float32 when dy_fp32.
cudaError_t fused_add_rms_norm_bwd(const void* dy, const void* ds, const void* s, const void* w, const float* rstd,
                                   void* dx, float* dw_partial, void* dw, int64_t rows, int64_t n, int64_t blocks,
                                   DType dtype, cudaStream_t stream, float w_offset, bool w_fp32, bool dy_fp32);


namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                                       c10::IntArrayRef normalized_shape,
                                                                       const c10::optional<at::Tensor>& weight,
                                                                       double eps, double weight_offset,
                                                                       bool cast_before_weight) {
  const char* op = "fused_add_rms_norm_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  check_cuda(residual, op, "residual");
  dtype_of(residual, op, "residual");
  check_twin(residual, x, op, "residual");
  bool w32 = false;
  const at::Tensor wc = hf_norm_weight(weight, x, normalized_shape, weight_offset, cast_before_weight, op, &w32);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  at::Tensor y = at::empty_like(xc, xc.options().dtype(hf_out_dtype(x, w32, cast_before_weight))),
             s = at::empty_like(xc);
  const int64_t rows = norm_rows(x, normalized_shape);
  at::Tensor rstd = f32_empty(x, {rows});
  if (xc.numel() > 0)
    check_launch(fused_add_rms_norm_fwd(xc.data_ptr(), rc.data_ptr(), ptr_or_null(wc), y.data_ptr(), s.data_ptr(),
                                        rstd.data_ptr<float>(), rows, n, (float)eps, dtype_of(x, op, "x"), stream(),
                                        (float)weight_offset, cast_before_weight, w32),
                 op);
  return {y, s, rstd};
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_bwd_cuda(const at::Tensor& dy, const at::Tensor& dres,
                                                               const at::Tensor& new_residual,
                                                               c10::IntArrayRef normalized_shape,
                                                               const c10::optional<at::Tensor>& weight,
                                                               const at::Tensor& rstd, double weight_offset,
                                                               bool cast_before_weight) {
  const char* op = "fused_add_rms_norm_bwd_cuda";
  check_cuda(new_residual, op, "new_residual");
  dtype_of(new_residual, op, "new_residual");
  const int64_t n = check_norm(new_residual, normalized_shape, op);
  bool w32 = false;
  const at::Tensor wc = hf_norm_weight(weight, new_residual, normalized_shape, weight_offset, cast_before_weight, op,
                                       &w32);
  const at::ScalarType y_dtype = hf_out_dtype(new_residual, w32, cast_before_weight);
  check_norm_dy(dy, new_residual, y_dtype, op, "new_residual");
  check_twin(dres, new_residual, op, "dres", "new_residual");
  const int64_t rows = norm_rows(new_residual, normalized_shape);
  check_stat(rstd, rows, op, "rstd");
  const c10::cuda::CUDAGuard guard(new_residual.device());
  const at::Tensor sc = new_residual.contiguous(), dyc = dy.contiguous(), dsc = dres.contiguous();
  at::Tensor dx = at::empty_like(sc);
  if (sc.numel() == 0)
    return {dx, wc.defined() ? at::zeros_like(wc) : new_residual.new_empty({0})};
  const int64_t blocks = fused_add_rms_norm_bwd_blocks(rows, n, dtype_of(new_residual, op, "new_residual"),
                                                       wc.defined(), w32, y_dtype != new_residual.scalar_type());
  at::Tensor partial, dw;
  if (wc.defined()) {
    partial = f32_empty(new_residual, {blocks, n});
    dw = at::empty_like(wc);
  }
  check_launch(fused_add_rms_norm_bwd(dyc.data_ptr(), dsc.data_ptr(), sc.data_ptr(), ptr_or_null(wc),
                                      rstd.data_ptr<float>(), dx.data_ptr(), f32_or_null(partial),
                                      out_or_null(dw), rows, n, blocks,
                                      dtype_of(new_residual, op, "new_residual"), stream(), (float)weight_offset, w32,
                                      y_dtype != new_residual.scalar_type()),
               op);
  return {dx, wc.defined() ? dw : new_residual.new_empty({0})};
}

// The training call's node: saves x + residual (the op's second output), the weight and rstd, as
// ops/fused_add_rms_norm.py's setup_context; x and residual get the same gradient tensor, as autograd of the sum gives.
struct FusedAddRmsNormState {
  static constexpr const char* kName = "FusedAddRmsNormNode";
  static constexpr size_t kSaved = 3;  // new_residual, weight, rstd
  std::vector<int64_t> normalized_shape;
  double weight_offset = 0;
  bool cast_before_weight = false;
  at::ScalarType y_dtype = at::kFloat;

  Grads backward(Grads& grads, std::array<at::Tensor, kSaved>& saved) const {
    const at::Tensor& s = saved[0];
    const at::Tensor& w = saved[1];
    auto [dx, dw] = fused_add_rms_norm_bwd_cuda(grad_or_zeros(grads[0], s, y_dtype),
                                                grad_or_zeros(grads[1], s, s.scalar_type()), s, normalized_shape,
                                                saved_optional(w), saved[2], weight_offset, cast_before_weight);
    return {dx, dx, w.defined() ? dw : at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_train_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                                 std::vector<int64_t> normalized_shape,
                                                                 const c10::optional<at::Tensor>& weight, double eps,
                                                                 double weight_offset, bool cast_before_weight) {
  at::Tensor y, s, rstd;
  {
    const ForwardGuard below_autograd;
    std::tie(y, s, rstd) = fused_add_rms_norm_cuda(x, residual, normalized_shape, weight, eps, weight_offset,
                                                   cast_before_weight);
  }
  const at::ScalarType y_dtype = y.scalar_type();
  record_node("fused_add_rms_norm_train_cuda",
              FusedAddRmsNormState{std::move(normalized_shape), weight_offset, cast_before_weight, y_dtype}, {y, s},
              {{s, true}, {weight.value_or(at::Tensor()), false}, {rstd, false}}, x, residual, weight);
  return {y, s};
}

}  // namespace

TIERED_OPS_CUDA_OP(fused_add_rms_norm,
                  "fused_add_rms_norm_cuda(Tensor x, Tensor residual, int[] normalized_shape, Tensor? weight, "
                  "float eps, float weight_offset=0., bool cast_before_weight=False) -> (Tensor, Tensor, Tensor)",
                  "fused_add_rms_norm_bwd_cuda(Tensor dy, Tensor dres, Tensor new_residual, int[] normalized_shape, "
                  "Tensor? weight, Tensor rstd, float weight_offset=0., bool cast_before_weight=False) "
                  "-> (Tensor, Tensor)");

TIERED_OPS_CUDA_TRAIN(fused_add_rms_norm);

}  // namespace tiered_ops
