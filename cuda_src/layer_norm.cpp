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

// The forward's launch into y (allocated here, returned) and the row statistics at mean and rstd (rows floats each).
at::Tensor layer_norm_forward(const at::Tensor& x, c10::IntArrayRef normalized_shape,
                              const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                              double eps, int64_t rows, float* mean, float* rstd, const char* op) {
  const int64_t n = check_norm(x, normalized_shape, op);
  const at::Tensor wc = norm_param(weight, x, normalized_shape, op, "weight");
  const at::Tensor bc = norm_param(bias, x, normalized_shape, op, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (xc.numel() == 0) return y;
  const DType dt = dtype_of(x, op, "x");
  const int64_t ws_bytes = layer_norm_fwd_workspace(rows, n, dt);
  const at::Tensor ws = ws_bytes ? at::empty({ws_bytes}, x.options().dtype(at::kByte)) : at::Tensor();
  check_launch(layer_norm_fwd(xc.data_ptr(), ptr_or_null(wc), ptr_or_null(bc), y.data_ptr(), mean, rstd, rows, n,
                              (float)eps, ws_bytes ? ws.data_ptr() : nullptr, dt, stream()),
               op);
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cuda(const at::Tensor& x, c10::IntArrayRef normalized_shape,
                                                               const c10::optional<at::Tensor>& weight,
                                                               const c10::optional<at::Tensor>& bias, double eps) {
  const char* op = "layer_norm_cuda";
  check_cuda(x, op, "x");
  const int64_t rows = norm_rows(x, normalized_shape);
  at::Tensor mean = f32_empty(x, {rows}), rstd = at::empty_like(mean);
  at::Tensor y = layer_norm_forward(x, normalized_shape, weight, bias, eps, rows, mean.data_ptr<float>(),
                                    rstd.data_ptr<float>(), op);
  return {y, mean, rstd};
}

// The backward's launch over rows of n from the row statistics at mean and rstd, with wc the weight (contiguous, or
// undefined): dx, and dw and db where asked (else empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                                   c10::IntArrayRef normalized_shape, int64_t rows,
                                                                   int64_t n, const at::Tensor& wc, const float* mean,
                                                                   const float* rstd, bool has_bias, const char* op) {
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  at::Tensor dx = at::empty_like(xc);
  const bool want_w = wc.defined();
  if (xc.numel() == 0) {
    const at::Tensor z = x.new_zeros(normalized_shape);
    return {dx, want_w ? z : x.new_empty({0}), has_bias ? z.clone() : x.new_empty({0})};
  }
  const int accs = (want_w ? 1 : 0) + (has_bias ? 1 : 0);
  const int64_t blocks = layer_norm_bwd_blocks(rows, n, dtype_of(x, op, "x"), accs);
  at::Tensor partials, dw, db;  // the weight's and the bias's (blocks, n) fp32 partial sums, in one allocation
  if (accs) partials = f32_empty(x, {accs, blocks, n});
  if (want_w) dw = x.new_empty(normalized_shape);
  if (has_bias) db = x.new_empty(normalized_shape);
  float* pw = want_w ? partials.data_ptr<float>() : nullptr;
  float* pb = has_bias ? partials.data_ptr<float>() + (want_w ? blocks * n : 0) : nullptr;
  check_launch(layer_norm_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(wc), mean, rstd, dx.data_ptr(), pw, pb,
                              out_or_null(dw), out_or_null(db), rows, n, blocks, dtype_of(x, op, "x"), stream()),
               op);
  return {dx, want_w ? dw : x.new_empty({0}), has_bias ? db : x.new_empty({0})};
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
  return layer_norm_backward(dy, x, normalized_shape, rows, n, wc, mean.data_ptr<float>(), rstd.data_ptr<float>(),
                             has_bias, op);
}

// The training call's node: saves x, the weight and the row statistics (one float32 tensor: the means, then the
// rstds), as ops/layer_norm.py's setup_context.
struct LayerNormState {
  static constexpr const char* kName = "LayerNormNode";
  static constexpr size_t kSaved = 3;  // x, weight, stats
  std::vector<int64_t> normalized_shape;
  int64_t rows = 0, n = 0;
  bool has_bias = false;

  Grads backward(Grads& grads, std::array<at::Tensor, kSaved>& saved) const {
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const float* mean = saved[2].data_ptr<float>();
    auto [dx, dw, db] = layer_norm_backward(grad_or_zeros(grads[0], x, x.scalar_type()), x, normalized_shape, rows, n,
                                            w.defined() ? w.contiguous() : w, mean, mean + rows, has_bias,
                                            "layer_norm_train_cuda");
    return {dx, w.defined() ? dw : at::Tensor(), has_bias ? db : at::Tensor()};
  }
};

at::Tensor layer_norm_train_cuda(const at::Tensor& x, std::vector<int64_t> normalized_shape,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                 double eps) {
  const char* op = "layer_norm_train_cuda";
  check_cuda(x, op, "x");
  const int64_t rows = norm_rows(x, normalized_shape);
  at::Tensor y, stats;
  {
    const ForwardGuard below_autograd;
    stats = f32_empty(x, {2, rows});
    float* mean = stats.data_ptr<float>();
    y = layer_norm_forward(x, normalized_shape, weight, bias, eps, rows, mean, mean + rows, op);
  }
  const int64_t n = rows ? x.numel() / rows : 0;
  const bool has_bias = bias.has_value() && bias->defined();
  record_node(op, LayerNormState{std::move(normalized_shape), rows, n, has_bias}, {y},
              {{x, false}, {weight.value_or(at::Tensor()), false}, {stats, false}}, x, weight, bias);
  return y;
}

}  // namespace

TIERED_OPS_CUDA_OP(layer_norm,
                  "layer_norm_cuda(Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps) "
                  "-> (Tensor, Tensor, Tensor)",
                  "layer_norm_bwd_cuda(Tensor dy, Tensor x, int[] normalized_shape, Tensor? weight, Tensor mean, "
                  "Tensor rstd, bool has_bias) -> (Tensor, Tensor, Tensor)");

TIERED_OPS_CUDA_TRAIN(layer_norm);

}  // namespace tiered_ops
