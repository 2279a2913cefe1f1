// The torch wrapper of gelu.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launchers (gelu.cu).
// y = gelu(x + bias[i % n]) (bias may be null), erf or tanh form; dx = dy * gelu'(x + bias).
cudaError_t gelu_fwd(const void* x, const void* bias, void* y, int64_t numel, int64_t n, bool tanh_approx,
                     DType dtype, cudaStream_t stream);
cudaError_t gelu_bwd(const void* dy, const void* x, const void* bias, void* dx, int64_t numel, int64_t n,
                     bool tanh_approx, DType dtype, cudaStream_t stream);

namespace {

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
                          dtype_of(x, op, "x"), stream()), op);
  return y;
}

std::tuple<at::Tensor, at::Tensor> gelu_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                 const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  const char* op = "gelu_bwd_cuda";
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const int64_t n = check_gelu(x, b, approximate, op);
  check_twin(dy, x, op, "dy");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  at::Tensor dx = at::empty_like(xc);
  if (xc.numel() > 0)
    check_launch(gelu_bwd(dyc.data_ptr(), xc.data_ptr(), ptr_or_null(b), dx.data_ptr(), xc.numel(), n,
                          approximate == "tanh", dtype_of(x, op, "x"), stream()), op);
  if (!b.defined()) return {dx, x.new_empty({0})};
  return {dx, dx.reshape({-1, n}).sum(0, /*keepdim=*/false, at::kFloat).to(x.scalar_type())};
}

}  // namespace

TIERED_OPS_CUDA_OP(gelu,
                  "gelu_cuda(Tensor x, Tensor? bias, str approximate) -> Tensor",
                  "gelu_bwd_cuda(Tensor dy, Tensor x, Tensor? bias, str approximate) -> (Tensor, Tensor)");

}  // namespace tiered_ops
