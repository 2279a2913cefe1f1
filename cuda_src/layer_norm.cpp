// The torch wrapper of layer_norm.cu: argument checks, the launch, and the op's registration (binding.h).
#include "native_autograd.h"

namespace tiered_ops {

// Host launchers (layer_norm.cu).
// Bytes of the forward's workspace for these rows (0: it needs none; rows split over blocks need one).
int64_t layer_norm_fwd_workspace(int64_t rows, int64_t n, DType dtype);

// layer_norm forward: y = (x - mean) * rstd * w + b (w, b may be null), with per-row fp32 mean and rstd out;
// workspace: layer_norm_fwd_workspace's bytes, on the device.
cudaError_t layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                           int64_t rows, int64_t n, float eps, void* workspace, DType dtype, cudaStream_t stream);

// Blocks of layer_norm_bwd's persistent grid: those its dx kernel keeps resident on the current device, at most the
// rows.
int64_t layer_norm_bwd_blocks(int64_t rows, int64_t n, DType dtype, int accs);

// layer_norm backward from the saved statistics on `blocks` blocks: dx; dw_partial / db_partial ((blocks, n) fp32,
// may be null) reduced into dw / db (x's dtype) by a second launch, as for rms_norm_bwd.
cudaError_t layer_norm_bwd(const void* dy, const void* x, const void* w, const float* mean, const float* rstd,
                           void* dx, float* dw_partial, float* db_partial, void* dw, void* db, int64_t rows, int64_t n,
                           int64_t blocks, DType dtype, cudaStream_t stream);

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cuda(const at::Tensor& x, c10::IntArrayRef normalized_shape,
                                                               const c10::optional<at::Tensor>& weight,
                                                               const c10::optional<at::Tensor>& bias, double eps) {
  const char* op = "layer_norm_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  const at::Tensor wc = norm_param(weight, x, normalized_shape, op, "weight");
  const at::Tensor bc = norm_param(bias, x, normalized_shape, op, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = norm_rows(x, normalized_shape);
  at::Tensor mean = f32_empty(x, {rows}), rstd = at::empty_like(mean);
  const DType dt = dtype_of(x, op, "x");
  const int64_t ws_bytes = xc.numel() > 0 ? layer_norm_fwd_workspace(rows, n, dt) : 0;
  const at::Tensor ws = ws_bytes ? at::empty({ws_bytes}, x.options().dtype(at::kByte)) : at::Tensor();
  if (xc.numel() > 0)
    check_launch(layer_norm_fwd(xc.data_ptr(), ptr_or_null(wc), ptr_or_null(bc), y.data_ptr(), mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), rows, n, (float)eps, ws_bytes ? ws.data_ptr() : nullptr, dt,
                                stream()), op);
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(
    const at::Tensor& dy, const at::Tensor& x, c10::IntArrayRef normalized_shape,
    const c10::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd, bool has_bias) {
  const char* op = "layer_norm_bwd_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  const at::Tensor wc = norm_param(weight, x, normalized_shape, op, "weight");
  check_twin(dy, x, op, "dy");
  const int64_t rows = n ? x.numel() / n : 0;
  check_stat(mean, rows, op, "mean");
  check_stat(rstd, rows, op, "rstd");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  at::Tensor dx = at::empty_like(xc);
  const bool want_w = wc.defined();
  if (xc.numel() == 0) {
    const at::Tensor z = x.new_zeros(normalized_shape);
    return {dx, want_w ? z : x.new_empty({0}), has_bias ? z.clone() : x.new_empty({0})};
  }
  const int64_t blocks = layer_norm_bwd_blocks(rows, n, dtype_of(x, op, "x"), (want_w ? 1 : 0) + (has_bias ? 1 : 0));
  at::Tensor pw, pb, dw, db;
  if (want_w) {
    pw = f32_empty(x, {blocks, n});
    dw = x.new_empty(normalized_shape);
  }
  if (has_bias) {
    pb = f32_empty(x, {blocks, n});
    db = x.new_empty(normalized_shape);
  }
  check_launch(layer_norm_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(wc), mean.data_ptr<float>(),
                              rstd.data_ptr<float>(), dx.data_ptr(), f32_or_null(pw), f32_or_null(pb),
                              out_or_null(dw), out_or_null(db), rows, n, blocks, dtype_of(x, op, "x"), stream()),
               op);
  return {dx, want_w ? dw : x.new_empty({0}), has_bias ? db : x.new_empty({0})};
}

// The training call's autograd node: saves x, the weight and the row statistics (marked non-differentiable), as
// ops/layer_norm.py's setup_context.
struct LayerNormNode : torch::autograd::Function<LayerNormNode> {
  static Grads forward(AutogradCtx* ctx, const at::Tensor& x, std::vector<int64_t> normalized_shape,
                       const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps) {
    auto [y, mean, rstd] = layer_norm_cuda(x, normalized_shape, weight, bias, eps);
    ctx->set_materialize_grads(false);
    ctx->mark_non_differentiable({mean, rstd});
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["normalized_shape"] = normalized_shape;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return {y, mean, rstd};
  }

  static Grads backward(AutogradCtx* ctx, Grads grads) {
    const Grads saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [dx, dw, db] = layer_norm_bwd_cuda(grad_or_zeros(grads[0], x, x.scalar_type()), x,
                                            ctx->saved_data["normalized_shape"].toIntVector(), saved_optional(w),
                                            saved[2], saved[3], has_bias);
    return {dx, at::Tensor(), w.defined() ? dw : at::Tensor(), has_bias ? db : at::Tensor(), at::Tensor()};
  }
};

std::vector<at::Tensor> layer_norm_train_cuda(const at::Tensor& x, std::vector<int64_t> normalized_shape,
                                              const c10::optional<at::Tensor>& weight,
                                              const c10::optional<at::Tensor>& bias, double eps) {
  return LayerNormNode::apply(x, std::move(normalized_shape), weight, bias, eps);
}

}  // namespace

TIERED_OPS_CUDA_OP(layer_norm,
                  "layer_norm_cuda(Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps) "
                  "-> (Tensor, Tensor, Tensor)",
                  "layer_norm_bwd_cuda(Tensor dy, Tensor x, int[] normalized_shape, Tensor? weight, Tensor mean, "
                  "Tensor rstd, bool has_bias) -> (Tensor, Tensor, Tensor)");

TIERED_OPS_CUDA_TRAIN(layer_norm);

}  // namespace tiered_ops
