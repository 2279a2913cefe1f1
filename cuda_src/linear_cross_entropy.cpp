// The torch wrapper of linear_cross_entropy.cu: argument checks, the chunk loop (cuBLAS GEMMs through ATen around
// cross_entropy's forward and reduction kernels and this op's dlogits kernel), and the op's registration.
#include "binding.h"

namespace tiered_ops {

// Host launchers of cross_entropy.cu (declared in cross_entropy.cpp too; one definition there).
cudaError_t cross_entropy_fwd(const void* x, const int64_t* target, float* loss, float* lse, int64_t rows, int64_t n,
                              int64_t stride, int64_t ignore_index, float smoothing, DType dtype, cudaStream_t stream);
cudaError_t cross_entropy_reduce(const void* num, DType num_dtype, bool sum_rows, const int64_t* target, void* out,
                                 DType out_dtype, int64_t rows, int64_t ignore_index, bool mean, cudaStream_t stream);

// Host launcher of linear_cross_entropy.cu: dlogits [rows, n] in `dtype` from contiguous float32 logits.
cudaError_t linear_cross_entropy_dlogits(const float* x, const int64_t* target, const float* lse, const float* g,
                                         int64_t g_stride, void* dx, int64_t dx_stride, int64_t rows, int64_t n,
                                         int64_t ignore_index, float smoothing, DType dtype, cudaStream_t stream);

namespace {

// 0 none, 1 mean, 2 sum.
int lce_reduction(c10::string_view reduction, const char* op) {
  if (reduction == "none") return 0;
  if (reduction == "mean") return 1;
  if (reduction == "sum") return 2;
  TORCH_CHECK(false, op, ": reduction must be 'mean', 'sum' or 'none', got '", std::string(reduction), "'");
  return -1;
}

// hidden [N, H], weight [V, H] (V >= 1), bias [V] or none, all one float dtype on one CUDA device; int64 target [N].
void check_lce(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
               const c10::optional<at::Tensor>& bias, double label_smoothing, int64_t chunk, const char* op) {
  check_cuda(hidden, op, "hidden");
  dtype_of(hidden, op, "hidden");
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must have shape [N, H], got ", shape_str(hidden.sizes()));
  check_like(weight, hidden, op, "weight", "hidden");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= 1 && weight.size(1) == hidden.size(1), op,
              ": weight must have shape [V, H] = [V, ", std::to_string(hidden.size(1)), "] with V >= 1, got ",
              shape_str(weight.sizes()));
  if (bias.has_value() && bias->defined()) {
    check_like(*bias, hidden, op, "bias", "hidden");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must have shape [V] = [",
                std::to_string(weight.size(0)), "], got ", shape_str(bias->sizes()));
  }
  check_cuda(target, op, "target");
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must have dtype int64 (class indices), got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == hidden.device(), op, ": target must be on ", hidden.device(), " like hidden, got ",
              target.device());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == hidden.size(0), op, ": target must have shape [N] = [",
              std::to_string(hidden.size(0)), "], got ", shape_str(target.sizes()));
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ",
              std::to_string(label_smoothing));
  TORCH_CHECK(chunk >= 1, op, ": chunk must be >= 1, got ", std::to_string(chunk));
}

// a @ b in float32: cuBLAS accumulates in float32 and writes float32 (from bfloat16/float16 too).
at::Tensor mm32(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == at::kFloat ? at::mm(a, b) : at::mm(a, b, at::kFloat);
}

// One chunk's float32 logits [rows, V], contiguous.
at::Tensor lce_logits(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& bias) {
  at::Tensor out = mm32(h, weight.t());
  if (bias.defined()) out.add_(bias.to(at::kFloat));
  return out;
}

at::Tensor bias_or_undefined(const c10::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
}

// One chunk's share of the gradients from its dlogits: dhidden's rows written, the float32 dweight (and dbias)
// accumulators added to; a half dweight product in `parts` slices of the vocabulary (each [V / parts, H]).
void lce_chunk_grads(const at::Tensor& dlogits, const at::Tensor& h, const at::Tensor& weight, at::Tensor dh_rows,
                     at::Tensor& dw, at::Tensor& db, int64_t parts = 1) {
  at::mm_out(dh_rows, dlogits, weight);
  if (dlogits.scalar_type() == at::kFloat) {
    dw.addmm_(dlogits.t(), h);  // into the accumulator: no [V, H] product
  } else {
    // slices of a multiple of 8 columns: each starts 16-byte aligned (half elements) for cuBLAS
    const int64_t v = dlogits.size(1), step = (v + 8 * parts - 1) / (8 * parts) * 8;
    for (int64_t a = 0; a < v; a += step) {  // a float32 product of half inputs, then added
      const int64_t len = std::min(step, v - a);
      dw.narrow(0, a, len).add_(mm32(dlogits.narrow(1, a, len).t(), h));
    }
  }
  if (db.numel() > 0) db.add_(dlogits.sum(0, false, at::kFloat));
}

// The forward's dweight product of half inputs is made in this many slices of the vocabulary.
constexpr int64_t kDwParts = 8;

// Where the forward's dlogits of a chunk go: over its float32 logits (in place in float32; in a half dtype over the
// first half of each row's bytes, row stride 2 V), so that the chunk holds one buffer, not two. A chunk of its own
// where V % 8 != 0 (a row of the view would not start 16-byte aligned for cuBLAS).
at::Tensor lce_dlogits_over(const at::Tensor& logits, at::ScalarType dtype) {
  if (dtype == at::kFloat) return logits;
  if (logits.size(1) % 8 != 0) return at::empty(logits.sizes(), logits.options().dtype(dtype));
  return logits.view(dtype).narrow(1, 0, logits.size(1));
}

// (loss, lse, dhidden, dweight, dbias). With `grads` (a scalar loss only) the gradients of an output gradient of 1
// are made from each chunk's logits at hand: dhidden [N, H] in hidden's dtype, dweight float32 [V, H], dbias float32
// [V] or [0] (the backward scales them); else the three are empty and the backward recomputes the logits.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, const c10::optional<at::Tensor>& bias,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, c10::optional<at::ScalarType> dtype,
    int64_t chunk, bool grads) {
  const char* op = "linear_cross_entropy_cuda";
  check_lce(hidden, weight, target, bias, label_smoothing, chunk, op);
  const at::ScalarType out = dtype.value_or(hidden.scalar_type());
  TORCH_CHECK(out == at::kFloat || out == hidden.scalar_type(), op,
              ": dtype must be None, float32 or hidden's dtype (", hidden.scalar_type(), "), got ", out);
  const int red = lce_reduction(reduction, op);
  TORCH_CHECK(!grads || red != 0, op, ": grads needs a scalar loss (reduction 'mean' or 'sum'), got 'none'");
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor tc = target.contiguous(), b = bias_or_undefined(bias);
  const int64_t n = hidden.size(0), v = weight.size(0);
  at::Tensor loss = f32_empty(hidden, {n}), lse = at::empty_like(loss);
  at::Tensor dh = at::empty({0}, hidden.options()), dw = at::empty({0}, hidden.options());
  at::Tensor db = at::empty({0}, hidden.options()), scale;
  if (grads) {
    dh = at::empty({n, hidden.size(1)}, hidden.options());
    dw = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    db = at::zeros({b.defined() ? v : 0}, weight.options().dtype(at::kFloat));
    scale = at::ones({1}, hidden.options().dtype(at::kFloat));
    if (red == 1) {  // 1 over the count of targets not ignored, on the device
      at::Tensor one = scale;
      scale = f32_empty(hidden, {1});
      check_launch(cross_entropy_reduce(one.data_ptr(), DType::F32, false, tc.data_ptr<int64_t>(), scale.data_ptr(),
                                        DType::F32, n, ignore_index, true, stream()),
                   op);
    }
  }
  const DType dt = dtype_of(hidden, op, "hidden");
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t rows = std::min(chunk, n - start);
    const at::Tensor h = hidden.narrow(0, start, rows);
    at::Tensor logits = lce_logits(h, weight, b);
    check_launch(cross_entropy_fwd(logits.data_ptr(), tc.data_ptr<int64_t>() + start, loss.data_ptr<float>() + start,
                                   lse.data_ptr<float>() + start, rows, v, v, ignore_index, (float)label_smoothing,
                                   DType::F32, stream()),
                 op);
    if (!grads) continue;
    // the logits become dlogits over themselves (lce_dlogits_over), the GEMMs' input; dweight's product of half
    // inputs in slices of the vocabulary: the chunk's buffer and one slice alive, never a [V, H] product
    at::Tensor dlogits = lce_dlogits_over(logits, hidden.scalar_type());
    check_launch(linear_cross_entropy_dlogits(logits.data_ptr<float>(), tc.data_ptr<int64_t>() + start,
                                              lse.data_ptr<float>() + start, scale.data_ptr<float>(), 0,
                                              dlogits.data_ptr(), dlogits.stride(0), rows, v, ignore_index,
                                              (float)label_smoothing, dt, stream()),
                 op);
    logits.reset();  // freed before the GEMMs where dlogits is its own chunk
    lce_chunk_grads(dlogits, h, weight, dh.narrow(0, start, rows), dw, db, kDwParts);
  }
  if (red == 0) return {loss.to(out), lse, dh, dw, db};
  at::Tensor total = at::empty({}, hidden.options().dtype(out));
  check_launch(cross_entropy_reduce(loss.data_ptr(), DType::F32, true, tc.data_ptr<int64_t>(), total.data_ptr(),
                                    dtype_of(total, op, "dtype"), n, ignore_index, red == 1, stream()),
               op);
  return {total, lse, dh, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const c10::optional<at::Tensor>& bias, const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, int64_t chunk) {
  const char* op = "linear_cross_entropy_bwd_cuda";
  check_lce(hidden, weight, target, bias, label_smoothing, chunk, op);
  const int red = lce_reduction(reduction, op);
  const int64_t n = hidden.size(0), v = weight.size(0);
  check_cuda(grad, op, "grad");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == hidden.scalar_type(), op,
              ": grad must be float32 or hidden's dtype (", hidden.scalar_type(), "), got ", grad.scalar_type());
  TORCH_CHECK(grad.device() == hidden.device(), op, ": grad must be on ", hidden.device(), " like hidden, got ",
              grad.device());
  TORCH_CHECK(red == 0 ? (grad.dim() == 1 && grad.size(0) == n) : grad.dim() == 0, op, ": grad must have shape ",
              red == 0 ? "[N]" : "[] (a scalar)", " for reduction '", std::string(reduction), "', got ",
              shape_str(grad.sizes()));
  check_cuda(lse, op, "lse");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 1 && lse.size(0) == n, op,
              ": lse must be a float32 tensor of shape [N] = [", std::to_string(n), "], got ", shape_str(lse.sizes()));
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor tc = target.contiguous(), lc = lse.contiguous(), b = bias_or_undefined(bias);
  at::Tensor dh = at::empty({n, hidden.size(1)}, hidden.options());
  at::Tensor dw = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
  at::Tensor db = at::zeros({b.defined() ? v : 0}, weight.options().dtype(at::kFloat));
  if (n > 0) {
    at::Tensor scale;
    if (red == 1) {  // the output gradient over the count of rows not ignored, in one launch
      scale = f32_empty(hidden, {1});
      check_launch(cross_entropy_reduce(grad.data_ptr(), dtype_of(grad, op, "grad"), false, tc.data_ptr<int64_t>(),
                                        scale.data_ptr(), DType::F32, n, ignore_index, true, stream()),
                   op);
    } else {
      scale = grad.to(at::kFloat).reshape({-1}).contiguous();
    }
    const int64_t g_stride = red == 0 ? 1 : 0;
    const DType dt = dtype_of(hidden, op, "hidden");
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t rows = std::min(chunk, n - start);
      const at::Tensor h = hidden.narrow(0, start, rows);
      at::Tensor logits = lce_logits(h, weight, b);
      at::Tensor dlogits = dt == DType::F32 ? logits : at::empty({rows, v}, hidden.options());
      check_launch(linear_cross_entropy_dlogits(logits.data_ptr<float>(), tc.data_ptr<int64_t>() + start,
                                                lc.data_ptr<float>() + start,
                                                scale.data_ptr<float>() + g_stride * start, g_stride,
                                                dlogits.data_ptr(), v, rows, v, ignore_index, (float)label_smoothing,
                                                dt, stream()),
                   op);
      logits.reset();  // the chunk's float32 logits are freed before the GEMMs (kept as dlogits in float32)
      lce_chunk_grads(dlogits, h, weight, dh.narrow(0, start, rows), dw, db);
    }
  }
  return {dh, dw.to(weight.scalar_type()), db.to(weight.scalar_type())};
}

}  // namespace

TIERED_OPS_CUDA_OP(linear_cross_entropy,
                  "linear_cross_entropy_cuda(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
                  "int ignore_index, str reduction, float label_smoothing, ScalarType? dtype, int chunk, bool grads) "
                  "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
                  "linear_cross_entropy_bwd_cuda(Tensor grad, Tensor hidden, Tensor weight, Tensor target, "
                  "Tensor? bias, Tensor lse, int ignore_index, str reduction, float label_smoothing, int chunk) "
                  "-> (Tensor, Tensor, Tensor)");

}  // namespace tiered_ops
