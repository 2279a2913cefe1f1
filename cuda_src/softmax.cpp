// The torch wrapper of softmax.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launchers (softmax.cu).
// y[r, :] = softmax(x[r, :]) for `rows` contiguous rows of `n` elements; `workspace`: the zeroed bytes
// softmax_fwd_workspace asks for these pointers and rows (none where it asks for 0).
int64_t softmax_fwd_workspace(const void* x, const void* y, int64_t rows, int64_t n, DType dtype);
cudaError_t softmax_fwd(const void* x, void* y, int64_t rows, int64_t n, DType dtype, void* workspace,
                        cudaStream_t stream);

// dx[r, :] = y * (dy - sum(dy * y)) over contiguous rows.
cudaError_t softmax_bwd(const void* dy, const void* y, void* dx, int64_t rows, int64_t n, DType dtype,
                        cudaStream_t stream);

namespace {

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim) {
  const char* op = "softmax_cuda";
  check_cuda(x, op, "x");
  const DType dt = dtype_of(x, op, "x");
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const c10::cuda::CUDAGuard guard(x.device());
  // Rows along `dim`: move it last and make the rows contiguous (a copy when it was not last; no view op when
  // it is last already, a per-call cost eager callers see).
  const bool last = x.dim() == 0 || dim == x.dim() - 1;
  const at::Tensor xc = x.dim() == 0 ? x.reshape({1}) : last ? x.contiguous() : x.movedim(dim, -1).contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t n = xc.dim() == 0 ? 1 : xc.size(-1);
  if (xc.numel() > 0) {
    const int64_t rows = xc.numel() / n, ws_bytes = softmax_fwd_workspace(xc.data_ptr(), y.data_ptr(), rows, n, dt);
    const at::Tensor ws = ws_bytes ? at::zeros({ws_bytes}, x.options().dtype(at::kByte)) : at::Tensor();
    check_launch(softmax_fwd(xc.data_ptr(), y.data_ptr(), rows, n, dt, ws_bytes ? ws.data_ptr() : nullptr,
                             stream()), op);
  }
  return x.dim() == 0 ? y.reshape({}) : last ? y : y.movedim(-1, dim);
}

at::Tensor softmax_bwd_cuda(const at::Tensor& dy, const at::Tensor& y, int64_t dim) {
  const char* op = "softmax_bwd_cuda";
  check_cuda(y, op, "y");
  const DType dt = dtype_of(y, op, "y");
  check_twin(dy, y, op, "dy", "y");
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
                             stream()), op);
  return last ? dx : dx.movedim(-1, dim);
}

}  // namespace

TIERED_OPS_CUDA_OP(softmax,
                  "softmax_cuda(Tensor x, int dim) -> Tensor",
                  "softmax_bwd_cuda(Tensor dy, Tensor y, int dim) -> Tensor");

}  // namespace tiered_ops
