// Torch binding of the tiered_ops CUDA kernels: the only file that includes torch headers.
// Schemas live in the `tiered_ops` namespace (fakes are registered from Python in cuda_ext.py),
// inputs are validated here with messages that name the argument, and every kernel is launched on
// the current stream with its launch error checked. The same functions are also exported as plain
// pybind11 functions, only as the contrast the graph-break metadata measures (a pybind11 function
// is opaque to torch.compile); tiered_ops never selects them.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <string>

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

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim) {
  check_cuda(x, "softmax_cuda", "x");
  const DType dt = dtype_of(x, "softmax_cuda", "x");
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const c10::cuda::CUDAGuard guard(x.device());
  // Rows along `dim`: move it last and make the rows contiguous (a copy when it was not last).
  const at::Tensor xc = x.dim() == 0 ? x.reshape({1}) : x.movedim(dim, -1).contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t n = xc.dim() == 0 ? 1 : xc.size(-1);
  if (xc.numel() > 0)
    check_launch(softmax_fwd(xc.data_ptr(), y.data_ptr(), xc.numel() / n, n, dt,
                             at::cuda::getCurrentCUDAStream()), "softmax_cuda");
  return x.dim() == 0 ? y.reshape({}) : y.movedim(-1, dim);
}

at::Tensor rms_norm_cuda(const at::Tensor& x, c10::IntArrayRef normalized_shape, const c10::optional<at::Tensor>& weight,
                         double eps) {
  check_cuda(x, "rms_norm_cuda", "x");
  const DType dt = dtype_of(x, "rms_norm_cuda", "x");
  const int64_t k = (int64_t)normalized_shape.size();
  TORCH_CHECK(k >= 1 && k <= x.dim() && x.sizes().slice(x.dim() - k).equals(normalized_shape),
              "rms_norm_cuda: normalized_shape ", shape_str(normalized_shape),
              " must match the trailing dims of x, got x of shape ", shape_str(x.sizes()));
  const void* wp = nullptr;
  at::Tensor wc;
  if (weight.has_value() && weight->defined()) {
    check_cuda(*weight, "rms_norm_cuda", "weight");
    TORCH_CHECK(weight->scalar_type() == x.scalar_type(), "rms_norm_cuda: weight must have the dtype of x (",
                x.scalar_type(), "), got ", weight->scalar_type());
    TORCH_CHECK(weight->sizes().equals(normalized_shape), "rms_norm_cuda: weight must have shape ",
                shape_str(normalized_shape), ", got ", shape_str(weight->sizes()));
    TORCH_CHECK(weight->device() == x.device(), "rms_norm_cuda: weight must be on ", x.device(), ", got ",
                weight->device());
    wc = weight->contiguous();
    wp = wc.data_ptr();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  int64_t n = 1;
  for (auto d : normalized_shape) n *= d;
  if (xc.numel() > 0)
    check_launch(rms_norm_fwd(xc.data_ptr(), wp, y.data_ptr(), xc.numel() / n, n, (float)eps, dt,
                              at::cuda::getCurrentCUDAStream()), "rms_norm_cuda");
  return y;
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

}  // namespace

TORCH_LIBRARY(tiered_ops, m) {
  m.def("softmax_cuda(Tensor x, int dim) -> Tensor");
  m.def("rms_norm_cuda(Tensor x, int[] normalized_shape, Tensor? weight, float eps) -> Tensor");
  m.def("muladd_cuda(Tensor a, Tensor b, Tensor c) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_ops, CUDA, m) {
  m.impl("softmax_cuda", &softmax_cuda);
  m.impl("rms_norm_cuda", &rms_norm_cuda);
  m.impl("muladd_cuda", &muladd_cuda);
}

// CPU tensors reach the same functions, whose first check names the argument that is not on CUDA
// (rather than the dispatcher's "could not run with arguments from the CPU backend").
TORCH_LIBRARY_IMPL(tiered_ops, CPU, m) {
  m.impl("softmax_cuda", &softmax_cuda);
  m.impl("rms_norm_cuda", &rms_norm_cuda);
  m.impl("muladd_cuda", &muladd_cuda);
}

}  // namespace tiered_ops

// The contrast: the same C++ functions as pybind11 functions, outside the dispatcher.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("softmax_cuda", &tiered_ops::softmax_cuda);
  m.def("rms_norm_cuda", &tiered_ops::rms_norm_cuda);
  m.def("muladd_cuda", &tiered_ops::muladd_cuda);
}
