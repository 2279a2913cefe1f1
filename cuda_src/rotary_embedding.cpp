// The torch wrapper of rotary_embedding.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launcher (rotary_embedding.cu): q_embed, k_embed (or with bwd the gradients of q and k) of the rows of q and k
// read through their strides, written contiguous.
cudaError_t rotary_embedding_run(const void* q, const void* k, void* q_out, void* k_out, const void* cos,
                                 const void* sin, int64_t batch, int64_t q_heads, int64_t k_heads, int64_t seq,
                                 int64_t head_dim, int64_t rotary_dim, const int64_t* q_strides,
                                 const int64_t* k_strides, int64_t cos_batch_stride, bool bwd, DType dtype,
                                 cudaStream_t stream);

namespace {

std::tuple<at::Tensor, at::Tensor> rope_run(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos_in,
                                            const at::Tensor& sin_in, bool bwd, const char* op, const char* qn,
                                            const char* kn) {
  check_cuda(q_in, op, qn);
  const DType dtype = dtype_of(q_in, op, qn);
  check_like(k_in, q_in, op, kn, qn);
  check_like(cos_in, q_in, op, "cos", qn);
  check_like(sin_in, q_in, op, "sin", qn);
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && k_in.size(0) == q_in.size(0) && k_in.size(2) == q_in.size(2) &&
                  k_in.size(3) == q_in.size(3),
              op, ": ", qn, " and ", kn, " must be 4-D with one batch, seq and head_dim, got ", shape_str(q_in.sizes()),
              " and ", shape_str(k_in.sizes()));
  const int64_t b = q_in.size(0), s = q_in.size(2), d = q_in.size(3);
  TORCH_CHECK(cos_in.dim() == 3 && (cos_in.size(0) == 1 || cos_in.size(0) == b) && cos_in.size(1) == s &&
                  cos_in.size(2) % 2 == 0 && cos_in.size(2) > 0 && cos_in.size(2) <= d,
              op, ": cos must have shape [batch or 1, seq, rotary_dim] with batch ", b, ", seq ", s,
              " and an even rotary_dim in 2..head_dim ", d, ", got ", shape_str(cos_in.sizes()));
  check_same_shape(sin_in, cos_in, op, "sin", "cos");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  check_launch(rotary_embedding_run(q.data_ptr(), k.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), b, q.size(1), k.size(1), s, d, cos.size(2), qs, ks,
                                    cos.size(0) == 1 ? 0 : cos.stride(0), bwd, dtype, stream()),
               op);
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& cos, const at::Tensor& sin) {
  return rope_run(q, k, cos, sin, false, "rotary_embedding_cuda", "q", "k");
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_bwd_cuda(const at::Tensor& dq, const at::Tensor& dk,
                                                             const at::Tensor& cos, const at::Tensor& sin) {
  return rope_run(dq, dk, cos, sin, true, "rotary_embedding_bwd_cuda", "dq", "dk");
}

}  // namespace

TIERED_OPS_CUDA_OP(rotary_embedding,
                  "rotary_embedding_cuda(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
                  "rotary_embedding_bwd_cuda(Tensor dq, Tensor dk, Tensor cos, Tensor sin) -> (Tensor, Tensor)");

}  // namespace tiered_ops
