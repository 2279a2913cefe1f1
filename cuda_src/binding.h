// The torch side of the tiered_ops CUDA kernels, shared by every op's wrapper file (cuda_src/<op>.cpp).
//
// An op's wrapper file holds its host launchers' declarations (defined in <op>.cu, which includes no torch), the
// functions <op>_cuda and <op>_bwd_cuda, and one TIERED_OPS_CUDA_OP line: its schemas and the registration of both
// functions as the op's CUDA and CPU kernels and as pybind11 functions. Nothing else names the op, so adding an op or
// an argument to one is an edit of that op's files only (and only they enter the op's source hash).
//
// A wrapper follows one recipe: check the arguments (errors name the argument), guard the device, make the inputs
// contiguous, allocate the outputs, launch on the current stream and check the launch. The helpers below are that
// recipe's parts.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <tuple>

#include "launchers.h"

namespace tiered_ops {

// Shapes and integers are formatted here, never streamed: streaming an integer through std::ostream
// in this extension segfaulted under torch 2.11 + g++ 13 (the extension's own instantiation of
// ostream::_M_insert<long>), so every TORCH_CHECK gets strings only.
inline std::string shape_str(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

inline DType dtype_of(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default: TORCH_CHECK(false, op, ": ", arg, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline void check_cuda(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor, got device ", t.device());
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

// The stream every kernel is launched on.
inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// `t` is a CUDA tensor with x's dtype and device (an error naming both arguments otherwise).
inline void check_like(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg,
                       const char* x_arg = "x") {
  check_cuda(t, op, arg);
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg, " must have the dtype of ", x_arg, " (",
              x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), op, ": ", arg, " must be on ", x.device(), " like ", x_arg, ", got ",
              t.device());
}

inline void check_same_shape(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg,
                             const char* x_arg) {
  TORCH_CHECK(t.sizes().equals(x.sizes()), op, ": ", arg, " must have the shape of ", x_arg, " ",
              shape_str(x.sizes()), ", got ", shape_str(t.sizes()));
}

// check_like and check_same_shape: `t` is x's twin (a gradient, a second operand).
inline void check_twin(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg,
                       const char* x_arg = "x") {
  check_like(t, x, op, arg, x_arg);
  check_same_shape(t, x, op, arg, x_arg);
}

// `t` is a contiguous float32 CUDA tensor of `rows` per-row statistics (saved by a forward for its backward).
inline void check_stat(const at::Tensor& t, int64_t rows, const char* op, const char* arg) {
  check_cuda(t, op, arg);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == rows && t.is_contiguous(), op, ": ", arg,
              " must be a contiguous float32 tensor of ", std::to_string(rows), " row statistics");
}

// A normalization's x, normalized_shape and optional affine parameter: the normalized size n.
inline int64_t check_norm(const at::Tensor& x, c10::IntArrayRef normalized_shape, const char* op) {
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

// The rows of a normalization: the product of x's dims before the trailing normalized_shape (1 for none).
inline int64_t norm_rows(const at::Tensor& x, c10::IntArrayRef normalized_shape) {
  int64_t rows = 1;
  for (int64_t d = 0; d < x.dim() - (int64_t)normalized_shape.size(); ++d) rows *= x.size(d);
  return rows;
}

// The parameter `name` (weight or bias) contiguous, or an undefined tensor when absent.
inline at::Tensor norm_param(const c10::optional<at::Tensor>& t, const at::Tensor& x,
                             c10::IntArrayRef normalized_shape, const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  check_like(*t, x, op, name);
  TORCH_CHECK(t->sizes().equals(normalized_shape), op, ": ", name, " must have shape ", shape_str(normalized_shape),
              ", got ", shape_str(t->sizes()));
  return t->contiguous();
}

// The weight of a Hugging Face norm form (weight_offset or cast_before_weight): x's dtype, or float32 over a bf16/fp16
// x (then *w_fp32); the form's arguments checked. Outside those forms: norm_param.
inline at::Tensor hf_norm_weight(const c10::optional<at::Tensor>& t, const at::Tensor& x,
                                 c10::IntArrayRef normalized_shape, double weight_offset, bool cast_before_weight,
                                 const char* op, bool* w_fp32) {
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

// A norm form's output dtype: x's, or float32 where a float32 weight multiplies after the cast (promote(weight, x)).
inline at::ScalarType hf_out_dtype(const at::Tensor& x, bool w_fp32, bool cast_before_weight) {
  return w_fp32 && cast_before_weight ? at::kFloat : x.scalar_type();
}

// dy, the gradient of a norm form's output: a CUDA tensor of the output's dtype, on x's device, of x's shape.
inline void check_norm_dy(const at::Tensor& dy, const at::Tensor& x, at::ScalarType y_dtype, const char* op,
                          const char* x_arg = "x") {
  check_cuda(dy, op, "dy");
  TORCH_CHECK(dy.scalar_type() == y_dtype, op, ": dy must have the output's dtype (", y_dtype, "), got ",
              dy.scalar_type());
  TORCH_CHECK(dy.device() == x.device(), op, ": dy must be on ", x.device(), " like ", x_arg, ", got ", dy.device());
  check_same_shape(dy, x, op, "dy", x_arg);
}

inline const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
inline void* out_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
inline float* f32_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// An uninitialized float32 tensor of `sizes` on x's device: row statistics, partial sums, workspaces.
inline at::Tensor f32_empty(const at::Tensor& x, c10::IntArrayRef sizes) {
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

// The current device's multiprocessor count (read once per device).
inline int64_t sm_count() {
  static std::atomic<int> counts[64] = {};
  const int dev = c10::cuda::current_device();
  int sms = dev < 64 ? counts[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    TORCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess,
                "tiered_ops: cannot read the multiprocessor count of device ", std::to_string(dev));
    if (dev < 64) counts[dev].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Blocks of a normalization backward's persistent grid over `rows` rows of n elements (cuda_src/norm_grads.cuh): enough
// blocks of the threads such a row takes (8-element packs) to fill every SM's 2048 thread slots once (at most 32 a
// SM), never more than the rows; the (blocks, n) fp32 partials of its weight/bias gradient.
inline int64_t norm_bwd_blocks(int64_t rows, int64_t n) {
  int64_t t = 32;
  while (t < (n + 7) / 8 && t < 1024) t *= 2;
  const int64_t per_sm = 2048 / t < 32 ? 2048 / t : 32;
  const int64_t want = sm_count() * per_sm;
  return rows < want ? rows : want;
}

// The pybind11 exports of the registered ops, collected while the extension loads (static initializers of the op
// files) and added to the module by binding.cpp's PYBIND11_MODULE, which runs after them.
using PybindExport = void (*)(pybind11::module_&);
std::vector<std::pair<const char*, PybindExport>>& pybind_exports();

struct PybindExportEntry {
  PybindExportEntry(const char* op, PybindExport add) { pybind_exports().emplace_back(op, add); }
};

constexpr bool starts_with(const char* s, const char* prefix) {
  return *prefix == '\0' || (*s == *prefix && starts_with(s + 1, prefix + 1));
}

}  // namespace tiered_ops

// One op's registration, after its functions OP_cuda and OP_bwd_cuda: both schemas (checked at compile time to name
// the op, and by the dispatcher at load time against the functions' C++ signatures), both functions as the op's CUDA
// kernels and as its CPU kernels (a CPU tensor reaches the wrapper, whose first check names the argument that is not
// on CUDA, rather than the dispatcher's "could not run with arguments from the CPU backend"), and both as pybind11
// functions: the graph-break contrast and the eager fast path (tiered_ops/fastpath.py), which calls forward and
// backward without the dispatcher. Fakes and autograd are registered from Python (tiered_ops/tiers.py).
#define TIERED_OPS_CUDA_OP(OP, FWD_SCHEMA, BWD_SCHEMA)                                                             \
  static_assert(::tiered_ops::starts_with(FWD_SCHEMA, #OP "_cuda("), "the forward schema must define " #OP "_cuda"); \
  static_assert(::tiered_ops::starts_with(BWD_SCHEMA, #OP "_bwd_cuda("),                                            \
                "the backward schema must define " #OP "_bwd_cuda");                                                \
  TORCH_LIBRARY_FRAGMENT(tiered_ops, m) {                                                                           \
    m.def(FWD_SCHEMA);                                                                                              \
    m.def(BWD_SCHEMA);                                                                                              \
  }                                                                                                                 \
  TORCH_LIBRARY_IMPL(tiered_ops, CUDA, m) {                                                                         \
    m.impl(#OP "_cuda", TORCH_FN(OP##_cuda));                                                                       \
    m.impl(#OP "_bwd_cuda", TORCH_FN(OP##_bwd_cuda));                                                               \
  }                                                                                                                 \
  TORCH_LIBRARY_IMPL(tiered_ops, CPU, m) {                                                                          \
    m.impl(#OP "_cuda", TORCH_FN(OP##_cuda));                                                                       \
    m.impl(#OP "_bwd_cuda", TORCH_FN(OP##_bwd_cuda));                                                               \
  }                                                                                                                 \
  static const ::tiered_ops::PybindExportEntry OP##_pybind_export(#OP, [](pybind11::module_& m) {                   \
    m.def(#OP "_cuda", &OP##_cuda);                                                                                 \
    m.def(#OP "_bwd_cuda", &OP##_bwd_cuda);                                                                         \
  })
