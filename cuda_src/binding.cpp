// Torch binding of the tiered_ops CUDA kernels: the only file that includes torch headers.
// Schemas live in the `tiered_ops` namespace (fakes are registered from Python in cuda_ext.py),
// inputs are validated here with messages that name the argument, and every kernel is launched on
// the current stream with its launch error checked. The same functions are also exported as plain
// pybind11 functions: the contrast the graph-break metadata measures (a pybind11 function is opaque
// to torch.compile), and the eager fast path, used only where nothing traces the call.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "launchers.h"

namespace tiered_ops {
namespace {

// Shapes and integers are formatted here, never streamed: streaming an integer through std::ostream
// in this extension segfaulted under torch 2.11 + g++ 13 (the extension's own instantiation of
// ostream::_M_insert<long>), so every TORCH_CHECK below gets strings only.
std::string shape_str(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

DType dtype_of(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default: TORCH_CHECK(false, op, ": ", arg, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_cuda(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor, got device ", t.device());
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

// `t` is a CUDA tensor with x's dtype and device (an error naming both arguments otherwise).
void check_like(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg, const char* x_arg = "x") {
  check_cuda(t, op, arg);
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg, " must have the dtype of ", x_arg, " (",
              x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), op, ": ", arg, " must be on ", x.device(), " like ", x_arg, ", got ",
              t.device());
}

void check_same_shape(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg, const char* x_arg) {
  TORCH_CHECK(t.sizes().equals(x.sizes()), op, ": ", arg, " must have the shape of ", x_arg, " ",
              shape_str(x.sizes()), ", got ", shape_str(t.sizes()));
}

// A normalization's x, normalized_shape and optional affine parameter: the normalized size n.
int64_t check_norm(const at::Tensor& x, c10::IntArrayRef normalized_shape, const char* op) {
  check_cuda(x, op, "x");
  dtype_of(x, op, "x");
  const int64_t k = (int64_t)normalized_shape.size();
  TORCH_CHECK(k >= 1 && k <= x.dim() && x.sizes().slice(x.dim() - k).equals(normalized_shape), op,
              ": normalized_shape ", shape_str(normalized_shape), " must match the trailing dims of x, got x of shape ",
              shape_str(x.sizes()));
  int64_t n = 1;
  for (auto d : normalized_shape) n *= d;
  return n;
}

// The parameter `name` (weight or bias) contiguous, or an undefined tensor when absent.
at::Tensor norm_param(const c10::optional<at::Tensor>& t, const at::Tensor& x, c10::IntArrayRef normalized_shape,
                      const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  check_like(*t, x, op, name);
  TORCH_CHECK(t->sizes().equals(normalized_shape), op, ": ", name, " must have shape ", shape_str(normalized_shape),
              ", got ", shape_str(t->sizes()));
  return t->contiguous();
}

const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// Rows per group of the weight/bias gradient partial sums: about 4 blocks per SM over the (columns, groups) grid.
int64_t rows_per_group(int64_t rows, int64_t n) {
  const int64_t col_blocks = (n + 255) / 256;
  const int64_t want = 4 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t groups = (want + col_blocks - 1) / col_blocks;
  groups = groups < 1 ? 1 : (groups > rows ? rows : groups);
  return (rows + groups - 1) / groups;
}

// (groups, n) fp32 partials -> the parameter gradient in x's dtype and normalized_shape.
at::Tensor sum_partials(const at::Tensor& partial, const at::Tensor& x, c10::IntArrayRef normalized_shape) {
  return partial.sum(0).to(x.scalar_type()).view(normalized_shape);
}

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim) {
  check_cuda(x, "softmax_cuda", "x");
  const DType dt = dtype_of(x, "softmax_cuda", "x");
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const c10::cuda::CUDAGuard guard(x.device());
  // Rows along `dim`: move it last and make the rows contiguous (a copy when it was not last; no view op when
  // it is last already, a per-call cost eager callers see).
  const bool last = x.dim() == 0 || dim == x.dim() - 1;
  const at::Tensor xc = x.dim() == 0 ? x.reshape({1}) : last ? x.contiguous() : x.movedim(dim, -1).contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t n = xc.dim() == 0 ? 1 : xc.size(-1);
  if (xc.numel() > 0)
    check_launch(softmax_fwd(xc.data_ptr(), y.data_ptr(), xc.numel() / n, n, dt,
                             at::cuda::getCurrentCUDAStream()), "softmax_cuda");
  return x.dim() == 0 ? y.reshape({}) : last ? y : y.movedim(-1, dim);
}

at::Tensor softmax_bwd_cuda(const at::Tensor& dy, const at::Tensor& y, int64_t dim) {
  const char* op = "softmax_bwd_cuda";
  check_cuda(y, op, "y");
  const DType dt = dtype_of(y, op, "y");
  check_like(dy, y, op, "dy", "y");
  check_same_shape(dy, y, op, "dy", "y");
  if (y.dim() == 0) return at::zeros_like(y);  // softmax over one element is constant
  dim = c10::maybe_wrap_dim(dim, y.dim());
  const c10::cuda::CUDAGuard guard(y.device());
  const bool last = dim == y.dim() - 1;
  const at::Tensor yc = last ? y.contiguous() : y.movedim(dim, -1).contiguous();
  const at::Tensor dyc = last ? dy.contiguous() : dy.movedim(dim, -1).contiguous();
  at::Tensor dx = at::empty_like(yc);
  const int64_t n = yc.size(-1);
  if (yc.numel() > 0)
    check_launch(softmax_bwd(dyc.data_ptr(), yc.data_ptr(), dx.data_ptr(), yc.numel() / n, n, dt,
                             at::cuda::getCurrentCUDAStream()), op);
  return last ? dx : dx.movedim(-1, dim);
}

// The weight of a Hugging Face norm form (weight_offset or cast_before_weight): x's dtype, or float32 over a bf16/fp16
// x (then *w_fp32); the form's arguments checked. Outside those forms: norm_param.
at::Tensor hf_norm_weight(const c10::optional<at::Tensor>& t, const at::Tensor& x, c10::IntArrayRef normalized_shape,
                          double weight_offset, bool cast_before_weight, const char* op, bool* w_fp32) {
  *w_fp32 = false;
  TORCH_CHECK(!(weight_offset != 0 && cast_before_weight), op, ": weight_offset and cast_before_weight together: no "
              "such norm form");
  const bool has_w = t.has_value() && t->defined();
  TORCH_CHECK(weight_offset == 0 || has_w, op, ": weight_offset needs a weight (it multiplies by offset + weight)");
  if (!has_w || (weight_offset == 0 && !cast_before_weight) || t->scalar_type() == x.scalar_type())
    return norm_param(t, x, normalized_shape, op, "weight");
  check_cuda(*t, op, "weight");
  TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": weight must have the dtype of x (", x.scalar_type(),
              ") or float32, got ", t->scalar_type());
  TORCH_CHECK(t->device() == x.device(), op, ": weight must be on ", x.device(), " like x, got ", t->device());
  TORCH_CHECK(t->sizes().equals(normalized_shape), op, ": weight must have shape ", shape_str(normalized_shape),
              ", got ", shape_str(t->sizes()));
  *w_fp32 = true;
  return t->contiguous();
}

// The output's dtype: x's, or float32 where a float32 weight multiplies after the cast (promote(weight, x)).
at::ScalarType hf_out_dtype(const at::Tensor& x, bool w_fp32, bool cast_before_weight) {
  return w_fp32 && cast_before_weight ? at::kFloat : x.scalar_type();
}

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
                              dtype_of(x, op, "x"), at::cuda::getCurrentCUDAStream(), (float)weight_offset,
                              cast_before_weight, w32), op);
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
  const bool dy32 = hf_out_dtype(x, w32, cast_before_weight) != x.scalar_type();
  check_cuda(dy, op, "dy");
  TORCH_CHECK(dy.scalar_type() == hf_out_dtype(x, w32, cast_before_weight), op, ": dy must have the output's dtype (",
              hf_out_dtype(x, w32, cast_before_weight), "), got ", dy.scalar_type());
  TORCH_CHECK(dy.device() == x.device(), op, ": dy must be on ", x.device(), " like x, got ", dy.device());
  check_same_shape(dy, x, op, "dy", "x");
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
    rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    partial = at::empty({(rows + rows_per - 1) / rows_per, n}, x.options().dtype(at::kFloat));
  }
  check_launch(rms_norm_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(wc), dx.data_ptr(),
                            wc.defined() ? rstd.data_ptr<float>() : nullptr,
                            wc.defined() ? partial.data_ptr<float>() : nullptr, rows, n, (float)eps, rows_per,
                            dtype_of(x, op, "x"), at::cuda::getCurrentCUDAStream(), (float)weight_offset, w32, dy32),
               op);
  return {dx, wc.defined() ? sum_partials(partial, wc, normalized_shape) : x.new_empty({0})};
}

// ---- fused_add_rms_norm ----
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                                       c10::IntArrayRef normalized_shape,
                                                                       const c10::optional<at::Tensor>& weight,
                                                                       double eps, double weight_offset,
                                                                       bool cast_before_weight) {
  const char* op = "fused_add_rms_norm_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  check_cuda(residual, op, "residual");
  dtype_of(residual, op, "residual");
  check_like(residual, x, op, "residual");
  check_same_shape(residual, x, op, "residual", "x");
  bool w32 = false;
  const at::Tensor wc = hf_norm_weight(weight, x, normalized_shape, weight_offset, cast_before_weight, op, &w32);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  at::Tensor y = at::empty_like(xc, xc.options().dtype(hf_out_dtype(x, w32, cast_before_weight))),
             s = at::empty_like(xc);
  int64_t rows = 1;
  for (int64_t d = 0; d < x.dim() - (int64_t)normalized_shape.size(); ++d) rows *= x.size(d);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (xc.numel() > 0)
    check_launch(fused_add_rms_norm_fwd(xc.data_ptr(), rc.data_ptr(), ptr_or_null(wc), y.data_ptr(), s.data_ptr(),
                                        rstd.data_ptr<float>(), rows, n, (float)eps, dtype_of(x, op, "x"),
                                        at::cuda::getCurrentCUDAStream(), (float)weight_offset, cast_before_weight,
                                        w32), op);
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
  check_cuda(dy, op, "dy");
  TORCH_CHECK(dy.scalar_type() == y_dtype, op, ": dy must have the output's dtype (", y_dtype, "), got ",
              dy.scalar_type());
  TORCH_CHECK(dy.device() == new_residual.device(), op, ": dy must be on ", new_residual.device(),
              " like new_residual, got ", dy.device());
  check_same_shape(dy, new_residual, op, "dy", "new_residual");
  check_like(dres, new_residual, op, "dres", "new_residual");
  check_same_shape(dres, new_residual, op, "dres", "new_residual");
  int64_t rows = 1;
  for (int64_t d = 0; d < new_residual.dim() - (int64_t)normalized_shape.size(); ++d) rows *= new_residual.size(d);
  check_cuda(rstd, op, "rstd");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows && rstd.is_contiguous(), op,
              ": rstd must be a contiguous float32 tensor of ", std::to_string(rows), " row statistics");
  const c10::cuda::CUDAGuard guard(new_residual.device());
  const at::Tensor sc = new_residual.contiguous(), dyc = dy.contiguous(), dsc = dres.contiguous();
  at::Tensor dx = at::empty_like(sc);
  if (sc.numel() == 0)
    return {dx, wc.defined() ? at::zeros_like(wc) : new_residual.new_empty({0})};
  at::Tensor partial;
  int64_t rows_per = 1;
  if (wc.defined()) {
    rows_per = rows_per_group(rows, n);
    partial = at::empty({(rows + rows_per - 1) / rows_per, n}, new_residual.options().dtype(at::kFloat));
  }
  check_launch(fused_add_rms_norm_bwd(dyc.data_ptr(), dsc.data_ptr(), sc.data_ptr(), ptr_or_null(wc),
                                      rstd.data_ptr<float>(), dx.data_ptr(),
                                      wc.defined() ? partial.data_ptr<float>() : nullptr, rows, n, rows_per,
                                      dtype_of(new_residual, op, "new_residual"), at::cuda::getCurrentCUDAStream(),
                                      (float)weight_offset, w32, y_dtype != new_residual.scalar_type()),
               op);
  return {dx, wc.defined() ? sum_partials(partial, wc, normalized_shape) : new_residual.new_empty({0})};
}

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
  int64_t rows = 1;
  for (int64_t d = 0; d < x.dim() - (int64_t)normalized_shape.size(); ++d) rows *= x.size(d);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat)), rstd = at::empty_like(mean);
  if (xc.numel() > 0)
    check_launch(layer_norm_fwd(xc.data_ptr(), ptr_or_null(wc), ptr_or_null(bc), y.data_ptr(), mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), rows, n, (float)eps, dtype_of(x, op, "x"),
                                at::cuda::getCurrentCUDAStream()), op);
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(
    const at::Tensor& dy, const at::Tensor& x, c10::IntArrayRef normalized_shape,
    const c10::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd, bool has_bias) {
  const char* op = "layer_norm_bwd_cuda";
  const int64_t n = check_norm(x, normalized_shape, op);
  const at::Tensor wc = norm_param(weight, x, normalized_shape, op, "weight");
  check_like(dy, x, op, "dy");
  check_same_shape(dy, x, op, "dy", "x");
  const int64_t rows = n ? x.numel() / n : 0;
  const auto check_stat = [&](const at::Tensor& t, const char* name) {
    check_cuda(t, op, name);
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == rows && t.is_contiguous(), op, ": ", name,
                " must be a contiguous float32 tensor of ", std::to_string(rows), " row statistics");
  };
  check_stat(mean, "mean");
  check_stat(rstd, "rstd");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  at::Tensor dx = at::empty_like(xc);
  const bool want_w = wc.defined();
  if (xc.numel() == 0) {
    const at::Tensor z = x.new_zeros(normalized_shape);
    return {dx, want_w ? z : x.new_empty({0}), has_bias ? z.clone() : x.new_empty({0})};
  }
  const int64_t rows_per = rows_per_group(rows, n), groups = (rows + rows_per - 1) / rows_per;
  at::Tensor pw, pb;
  if (want_w) pw = at::empty({groups, n}, x.options().dtype(at::kFloat));
  if (has_bias) pb = at::empty({groups, n}, x.options().dtype(at::kFloat));
  check_launch(layer_norm_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(wc), mean.data_ptr<float>(),
                              rstd.data_ptr<float>(), dx.data_ptr(), want_w ? pw.data_ptr<float>() : nullptr,
                              has_bias ? pb.data_ptr<float>() : nullptr, rows, n, rows_per, dtype_of(x, op, "x"),
                              at::cuda::getCurrentCUDAStream()), op);
  return {dx, want_w ? sum_partials(pw, x, normalized_shape) : x.new_empty({0}),
          has_bias ? sum_partials(pb, x, normalized_shape) : x.new_empty({0})};
}

at::Tensor muladd_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  check_cuda(a, "muladd_cuda", "a");
  check_cuda(b, "muladd_cuda", "b");
  check_cuda(c, "muladd_cuda", "c");
  const DType dt = dtype_of(a, "muladd_cuda", "a");
  TORCH_CHECK(b.scalar_type() == a.scalar_type() && c.scalar_type() == a.scalar_type(),
              "muladd_cuda: a, b and c must share one dtype, got ", a.scalar_type(), ", ", b.scalar_type(), ", ",
              c.scalar_type());
  TORCH_CHECK(a.sizes().equals(b.sizes()) && a.sizes().equals(c.sizes()),
              "muladd_cuda: a, b and c must have the same shape, got ", shape_str(a.sizes()), ", ",
              shape_str(b.sizes()), ", ", shape_str(c.sizes()));
  TORCH_CHECK(b.device() == a.device() && c.device() == a.device(), "muladd_cuda: a, b and c must be on one device");
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), cc = c.contiguous();
  at::Tensor out = at::empty_like(ac);
  if (ac.numel() > 0)
    check_launch(muladd_fwd(ac.data_ptr(), bc.data_ptr(), cc.data_ptr(), out.data_ptr(), ac.numel(), dt,
                            at::cuda::getCurrentCUDAStream()), "muladd_cuda");
  return out;
}

std::tuple<at::Tensor, at::Tensor> muladd_bwd_cuda(const at::Tensor& g, const at::Tensor& a, const at::Tensor& b) {
  const char* op = "muladd_bwd_cuda";
  check_cuda(a, op, "a");
  const DType dt = dtype_of(a, op, "a");
  check_like(g, a, op, "grad", "a");
  check_like(b, a, op, "b", "a");
  check_same_shape(g, a, op, "grad", "a");
  check_same_shape(b, a, op, "b", "a");
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor gc = g.contiguous(), ac = a.contiguous(), bc = b.contiguous();
  at::Tensor da = at::empty_like(ac), db = at::empty_like(bc);
  if (ac.numel() > 0)
    check_launch(muladd_bwd(gc.data_ptr(), ac.data_ptr(), bc.data_ptr(), da.data_ptr(), db.data_ptr(), ac.numel(), dt,
                            at::cuda::getCurrentCUDAStream()), op);
  return {da, db};
}

// x and bias of gelu; the row length the bias repeats over.
int64_t check_gelu(const at::Tensor& x, const at::Tensor& bias, c10::string_view approximate, const char* op) {
  check_cuda(x, op, "x");
  dtype_of(x, op, "x");
  TORCH_CHECK(approximate == "none" || approximate == "tanh", op, ": approximate must be 'none' or 'tanh', got '",
              std::string(approximate), "'");
  const int64_t n = x.dim() ? x.size(-1) : 1;
  if (bias.defined()) {
    check_like(bias, x, op, "bias");
    TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == n, op, ": bias must have shape [x.shape[-1]], got ",
                shape_str(bias.sizes()), " for x of shape ", shape_str(x.sizes()));
  }
  return n;
}

at::Tensor gelu_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  const char* op = "gelu_cuda";
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const int64_t n = check_gelu(x, b, approximate, op);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (xc.numel() > 0)
    check_launch(gelu_fwd(xc.data_ptr(), ptr_or_null(b), y.data_ptr(), xc.numel(), n, approximate == "tanh",
                          dtype_of(x, op, "x"), at::cuda::getCurrentCUDAStream()), op);
  return y;
}

std::tuple<at::Tensor, at::Tensor> gelu_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                 const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  const char* op = "gelu_bwd_cuda";
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const int64_t n = check_gelu(x, b, approximate, op);
  check_like(dy, x, op, "dy");
  check_same_shape(dy, x, op, "dy", "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  at::Tensor dx = at::empty_like(xc);
  if (xc.numel() > 0)
    check_launch(gelu_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(b), dx.data_ptr(), xc.numel(), n,
                          approximate == "tanh", dtype_of(x, op, "x"), at::cuda::getCurrentCUDAStream()), op);
  if (!b.defined()) return {dx, x.new_empty({0})};
  return {dx, dx.reshape({-1, n}).sum(0, /*keepdim=*/false, at::kFloat).to(x.scalar_type())};
}

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
                                                      double label_smoothing) {
  const char* op = "cross_entropy_cuda";
  check_ce(logits, target, label_smoothing, op);
  const int red = ce_reduction(reduction, op);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor xc = ce_rows(logits), tc = target.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor loss = at::empty({rows}, xc.options().dtype(at::kFloat)), lse = at::empty_like(loss);
  if (rows > 0)
    check_launch(cross_entropy_fwd(xc.data_ptr(), tc.data_ptr<int64_t>(), loss.data_ptr<float>(), lse.data_ptr<float>(),
                                   rows, n, xc.stride(0), ignore_index, (float)label_smoothing,
                                   dtype_of(logits, op, "logits"), at::cuda::getCurrentCUDAStream()), op);
  if (red == 2) loss = loss.sum();
  if (red == 1) loss = loss.sum() / tc.ne(ignore_index).sum();  // 0 / 0 = NaN when every target is ignored
  return {loss.to(logits.scalar_type()), lse};
}

at::Tensor cross_entropy_bwd_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction,
                                  double label_smoothing) {
  const char* op = "cross_entropy_bwd_cuda";
  check_ce(logits, target, label_smoothing, op);
  const int red = ce_reduction(reduction, op);
  check_like(grad, logits, op, "grad", "logits");
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
  at::Tensor scale = grad.to(at::kFloat);
  if (red == 1) scale = scale / tc.ne(ignore_index).sum();
  scale = scale.reshape({-1}).contiguous();
  at::Tensor dx = at::empty({rows, n}, logits.options());
  if (rows > 0)
    check_launch(cross_entropy_bwd(xc.data_ptr(), tc.data_ptr<int64_t>(), lc.data_ptr<float>(), scale.data_ptr<float>(),
                                   red == 0 ? 1 : 0, dx.data_ptr(), rows, n, xc.stride(0), ignore_index,
                                   (float)label_smoothing, dtype_of(logits, op, "logits"),
                                   at::cuda::getCurrentCUDAStream()), op);
  return dx;
}

// values (or dout) [rows, D] float and offsets [S + 1] int64 on one CUDA device: S. The offsets' values are not read
// here (a sync): the kernels keep malformed offsets in bounds.
int64_t check_segments(const at::Tensor& values, const at::Tensor& offsets, const char* op, const char* values_arg) {
  check_cuda(values, op, values_arg);
  dtype_of(values, op, values_arg);
  TORCH_CHECK(values.dim() == 2, op, ": ", values_arg, " must be 2-D [rows, D], got shape ", shape_str(values.sizes()));
  check_cuda(offsets, op, "offsets");
  TORCH_CHECK(offsets.scalar_type() == at::kLong, op,
              ": offsets must be an int64 tensor of S + 1 boundaries, got dtype ", offsets.scalar_type());
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1, op,
              ": offsets must be 1-D with S + 1 >= 1 boundaries, got shape ", shape_str(offsets.sizes()));
  TORCH_CHECK(offsets.device() == values.device(), op, ": offsets must be on ", values.device(), " like ", values_arg,
              ", got ", offsets.device());
  return offsets.numel() - 1;
}

at::Tensor segment_sum_cuda(const at::Tensor& values, const at::Tensor& offsets) {
  const char* op = "segment_sum_cuda";
  const int64_t segments = check_segments(values, offsets, op, "values");
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor xc = values.contiguous(), oc = offsets.contiguous();
  const int64_t rows = xc.size(0), d = xc.size(1);
  at::Tensor out = at::empty({segments, d}, xc.options());
  if (segments == 0 || d == 0) return out;
  at::Tensor ws = at::empty({segment_sum_workspace(rows, d)}, xc.options().dtype(at::kFloat));
  check_launch(segment_sum_fwd(xc.data_ptr(), oc.data_ptr<int64_t>(), out.data_ptr(), ws.data_ptr<float>(), rows, d,
                               segments, dtype_of(values, op, "values"), at::cuda::getCurrentCUDAStream()), op);
  return out;
}

at::Tensor segment_sum_bwd_cuda(const at::Tensor& dout, const at::Tensor& offsets, int64_t rows) {
  const char* op = "segment_sum_bwd_cuda";
  const int64_t segments = check_segments(dout, offsets, op, "dout");
  TORCH_CHECK(dout.size(0) == segments, op, ": dout must have one row per segment (", std::to_string(segments),
              "), got shape ", shape_str(dout.sizes()));
  TORCH_CHECK(rows >= 0, op, ": rows must be >= 0, got ", std::to_string(rows));
  const c10::cuda::CUDAGuard guard(dout.device());
  const at::Tensor gc = dout.contiguous(), oc = offsets.contiguous();
  const int64_t d = gc.size(1);
  at::Tensor dx = at::empty({rows, d}, gc.options());
  if (segments == 0 || d == 0 || rows == 0) return dx;
  check_launch(segment_sum_bwd(gc.data_ptr(), oc.data_ptr<int64_t>(), dx.data_ptr(), rows, d, segments,
                               dtype_of(dout, op, "dout"), at::cuda::getCurrentCUDAStream()), op);
  return dx;
}

}  // namespace

#define TIERED_OPS_IMPLS(m)                            \
  m.impl("softmax_cuda", &softmax_cuda);               \
  m.impl("softmax_bwd_cuda", &softmax_bwd_cuda);       \
  m.impl("rms_norm_cuda", &rms_norm_cuda);             \
  m.impl("rms_norm_bwd_cuda", &rms_norm_bwd_cuda);     \
  m.impl("layer_norm_cuda", &layer_norm_cuda);         \
  m.impl("layer_norm_bwd_cuda", &layer_norm_bwd_cuda); \
  m.impl("muladd_cuda", &muladd_cuda);                 \
  m.impl("muladd_bwd_cuda", &muladd_bwd_cuda);         \
  m.impl("gelu_cuda", &gelu_cuda);                     \
  m.impl("gelu_bwd_cuda", &gelu_bwd_cuda);             \
  m.impl("cross_entropy_cuda", &cross_entropy_cuda); \
  m.impl("cross_entropy_bwd_cuda", &cross_entropy_bwd_cuda); \
  m.impl("fused_add_rms_norm_cuda", &fused_add_rms_norm_cuda); \
  m.impl("fused_add_rms_norm_bwd_cuda", &fused_add_rms_norm_bwd_cuda); \
  m.impl("segment_sum_cuda", &segment_sum_cuda); \
  m.impl("segment_sum_bwd_cuda", &segment_sum_bwd_cuda);

TORCH_LIBRARY(tiered_ops, m) {
  m.def("softmax_cuda(Tensor x, int dim) -> Tensor");
  m.def("softmax_bwd_cuda(Tensor dy, Tensor y, int dim) -> Tensor");
  m.def("rms_norm_cuda(Tensor x, int[] normalized_shape, Tensor? weight, float eps, float weight_offset=0., "
        "bool cast_before_weight=False) -> Tensor");
  m.def("rms_norm_bwd_cuda(Tensor dy, Tensor x, int[] normalized_shape, Tensor? weight, float eps, "
        "float weight_offset=0., bool cast_before_weight=False) -> (Tensor, Tensor)");
  m.def("layer_norm_cuda(Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd_cuda(Tensor dy, Tensor x, int[] normalized_shape, Tensor? weight, Tensor mean, Tensor rstd, "
        "bool has_bias) -> (Tensor, Tensor, Tensor)");
  m.def("muladd_cuda(Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("muladd_bwd_cuda(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)");
  m.def("gelu_cuda(Tensor x, Tensor? bias, str approximate) -> Tensor");
  m.def("gelu_bwd_cuda(Tensor dy, Tensor x, Tensor? bias, str approximate) -> (Tensor, Tensor)");
  m.def("cross_entropy_cuda(Tensor logits, Tensor target, int ignore_index, str reduction, float label_smoothing) "
        "-> (Tensor, Tensor)");
  m.def("cross_entropy_bwd_cuda(Tensor grad, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
        "str reduction, float label_smoothing) -> Tensor");
  m.def("fused_add_rms_norm_cuda(Tensor x, Tensor residual, int[] normalized_shape, Tensor? weight, float eps, "
        "float weight_offset=0., bool cast_before_weight=False) -> (Tensor, Tensor, Tensor)");
  m.def("fused_add_rms_norm_bwd_cuda(Tensor dy, Tensor dres, Tensor new_residual, int[] normalized_shape, "
        "Tensor? weight, Tensor rstd, float weight_offset=0., bool cast_before_weight=False) -> (Tensor, Tensor)");
  m.def("segment_sum_cuda(Tensor values, Tensor offsets) -> Tensor");
  m.def("segment_sum_bwd_cuda(Tensor dout, Tensor offsets, int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_ops, CUDA, m) { TIERED_OPS_IMPLS(m) }

// CPU tensors reach the same functions, whose first check names the argument that is not on CUDA
// (rather than the dispatcher's "could not run with arguments from the CPU backend").
TORCH_LIBRARY_IMPL(tiered_ops, CPU, m) { TIERED_OPS_IMPLS(m) }

}  // namespace tiered_ops

// The same C++ functions as pybind11 functions, outside the dispatcher: the graph-break contrast, and the eager
// fast path (tiered_ops/fastpath.py), which calls forward and backward without the dispatcher's per-call cost.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("softmax_cuda", &tiered_ops::softmax_cuda);
  m.def("softmax_bwd_cuda", &tiered_ops::softmax_bwd_cuda);
  m.def("rms_norm_cuda", &tiered_ops::rms_norm_cuda);
  m.def("rms_norm_bwd_cuda", &tiered_ops::rms_norm_bwd_cuda);
  m.def("layer_norm_cuda", &tiered_ops::layer_norm_cuda);
  m.def("layer_norm_bwd_cuda", &tiered_ops::layer_norm_bwd_cuda);
  m.def("muladd_cuda", &tiered_ops::muladd_cuda);
  m.def("muladd_bwd_cuda", &tiered_ops::muladd_bwd_cuda);
  m.def("gelu_cuda", &tiered_ops::gelu_cuda);
  m.def("gelu_bwd_cuda", &tiered_ops::gelu_bwd_cuda);
  m.def("cross_entropy_cuda", &tiered_ops::cross_entropy_cuda);
  m.def("cross_entropy_bwd_cuda", &tiered_ops::cross_entropy_bwd_cuda);
  m.def("fused_add_rms_norm_cuda", &tiered_ops::fused_add_rms_norm_cuda);
  m.def("segment_sum_cuda", &tiered_ops::segment_sum_cuda);
}
