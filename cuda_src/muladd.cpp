// The torch wrapper of muladd.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launchers (muladd.cu).
// out = a * b + c over `numel` contiguous elements (fp32 arithmetic, one rounding).
cudaError_t muladd_fwd(const void* a, const void* b, const void* c, void* out, int64_t numel, DType dtype,
                       cudaStream_t stream);

// (da, db) = (g * b, g * a) over `numel` contiguous elements.
cudaError_t muladd_bwd(const void* g, const void* a, const void* b, void* da, void* db, int64_t numel, DType dtype,
                       cudaStream_t stream);

namespace {

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
                            stream()), "muladd_cuda");
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
                            stream()), op);
  return {da, db};
}

}  // namespace

TIERED_OPS_CUDA_OP(muladd,
                  "muladd_cuda(Tensor a, Tensor b, Tensor c) -> Tensor",
                  "muladd_bwd_cuda(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)");

}  // namespace tiered_ops
