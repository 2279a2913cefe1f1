// The torch wrapper of swiglu.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launchers (swiglu.cu). act: 0 silu, 1 gelu (tanh form), 2 gelu (erf form).
// out = act(gate) * up over `numel` contiguous elements (fp32 arithmetic, one rounding).
cudaError_t swiglu_fwd(const void* gate, const void* up, void* out, int64_t numel, int act, DType dtype,
                       cudaStream_t stream);
// (dgate, dup) = (dy * up * act'(gate), dy * act(gate)) over `numel` contiguous elements.
cudaError_t swiglu_bwd(const void* dy, const void* gate, const void* up, void* dgate, void* dup, int64_t numel,
                       int act, DType dtype, cudaStream_t stream);

namespace {

// gate and up of swiglu; the activation's code.
int check_swiglu(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation, const char* op) {
  check_cuda(gate, op, "gate");
  dtype_of(gate, op, "gate");
  check_like(up, gate, op, "up", "gate");
  TORCH_CHECK(up.sizes().equals(gate.sizes()), op, ": gate and up must have the same shape (no broadcasting), got ",
              shape_str(gate.sizes()), " and ", shape_str(up.sizes()));
  if (activation == "silu") return 0;
  if (activation == "gelu_tanh") return 1;
  TORCH_CHECK(activation == "gelu", op, ": activation must be one of 'silu', 'gelu_tanh', 'gelu', got '",
              std::string(activation), "'");
  return 2;
}

at::Tensor swiglu_cuda(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  const char* op = "swiglu_cuda";
  const int act = check_swiglu(gate, up, activation, op);
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor gc = gate.contiguous(), uc = up.contiguous();
  at::Tensor out = at::empty_like(gc);
  if (gc.numel() > 0)
    check_launch(swiglu_fwd(gc.data_ptr(), uc.data_ptr(), out.data_ptr(), gc.numel(), act, dtype_of(gate, op, "gate"),
                            stream()), op);
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cuda(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                                                   c10::string_view activation) {
  const char* op = "swiglu_bwd_cuda";
  const int act = check_swiglu(gate, up, activation, op);
  check_twin(dy, gate, op, "dy", "gate");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor dyc = dy.contiguous(), gc = gate.contiguous(), uc = up.contiguous();
  at::Tensor dgate = at::empty_like(gc), dup = at::empty_like(uc);
  if (gc.numel() > 0)
    check_launch(swiglu_bwd(dyc.data_ptr(), gc.data_ptr(), uc.data_ptr(), dgate.data_ptr(), dup.data_ptr(), gc.numel(),
                            act, dtype_of(gate, op, "gate"), stream()), op);
  return {dgate, dup};
}

}  // namespace

TIERED_OPS_CUDA_OP(swiglu,
                  "swiglu_cuda(Tensor gate, Tensor up, str activation) -> Tensor",
                  "swiglu_bwd_cuda(Tensor dy, Tensor gate, Tensor up, str activation) -> (Tensor, Tensor)");

}  // namespace tiered_ops
