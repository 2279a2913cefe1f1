// The torch wrapper of qk_norm_rope.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launcher (qk_norm_rope.cu): forward (gq, gk null) or backward of q and k read through their strides.
cudaError_t qk_norm_rope_run(const void* q, const void* k, const void* gq, const void* gk, void* q_out, void* k_out,
                             const void* q_weight, const void* k_weight, float* q_partial, float* k_partial,
                             const void* cos, const void* sin, int64_t batch, int64_t q_heads, int64_t k_heads,
                             int64_t seq, int64_t head_dim, const int64_t* q_strides, const int64_t* k_strides,
                             int64_t cos_batch_stride, float eps, int64_t blocks, bool bwd, DType dtype,
                             cudaStream_t stream);

namespace {

constexpr const char* kFwd = "qk_norm_rope_cuda";
constexpr const char* kBwd = "qk_norm_rope_bwd_cuda";

void check_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
              const at::Tensor& wq, const at::Tensor& wk, const char* op) {
  check_cuda(q, op, "q");
  dtype_of(q, op, "q");
  check_like(k, q, op, "k", "q");
  check_like(cos, q, op, "cos", "q");
  check_like(sin, q, op, "sin", "q");
  check_like(wq, q, op, "q_weight", "q");
  check_like(wk, q, op, "k_weight", "q");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  k.size(3) == q.size(3),
              op, ": q and k must be 4-D with one batch, seq and head_dim, got ", shape_str(q.sizes()), " and ",
              shape_str(k.sizes()));
  const int64_t b = q.size(0), s = q.size(2), d = q.size(3);
  TORCH_CHECK(d % 2 == 0 && d <= 2048, op, ": head_dim must be even and at most 2048, got ", d);
  TORCH_CHECK(cos.dim() == 3 && (cos.size(0) == 1 || cos.size(0) == b) && cos.size(1) == s && cos.size(2) == d, op,
              ": cos must have shape [batch or 1, seq, head_dim] with batch ", b, ", seq ", s, ", head_dim ", d,
              ", got ", shape_str(cos.sizes()));
  check_same_shape(sin, cos, op, "sin", "cos");
  TORCH_CHECK(wq.dim() == 1 && wq.size(0) == d, op, ": q_weight must have shape [", d, "], got ",
              shape_str(wq.sizes()));
  TORCH_CHECK(wk.dim() == 1 && wk.size(0) == d, op, ": k_weight must have shape [", d, "], got ",
              shape_str(wk.sizes()));
}

std::vector<at::Tensor> run(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor* gq,
                            const at::Tensor* gk, const at::Tensor& cos_in, const at::Tensor& sin_in,
                            const at::Tensor& wq_in, const at::Tensor& wk_in, double eps, bool bwd, const char* op) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor wq = wq_in.contiguous(), wk = wk_in.contiguous();
  const at::Tensor gqc = bwd ? gq->contiguous() : at::Tensor(), gkc = bwd ? gk->contiguous() : at::Tensor();
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  const int64_t b = q.size(0), s = q.size(2), d = q.size(3);
  const int64_t rows = b * s * std::max(q.size(1), k.size(1));
  const int64_t blocks = std::min<int64_t>(rows, bwd ? sm_count() * 8 : 65535 * 16);
  at::Tensor pq, pk;
  if (bwd) {
    pq = f32_empty(q, {std::max<int64_t>(blocks, 1), d});
    pk = f32_empty(q, {std::max<int64_t>(blocks, 1), d});
  }
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  check_launch(qk_norm_rope_run(q.data_ptr(), k.data_ptr(), bwd ? gqc.data_ptr() : nullptr,
                                bwd ? gkc.data_ptr() : nullptr, q_out.data_ptr(), k_out.data_ptr(), wq.data_ptr(),
                                wk.data_ptr(), f32_or_null(pq), f32_or_null(pk), cos.data_ptr(), sin.data_ptr(), b,
                                q.size(1), k.size(1), s, d, qs, ks, cos.size(0) == 1 ? 0 : cos.stride(0), (float)eps,
                                blocks, bwd, dtype_of(q, op, "q"), stream()),
               op);
  if (!bwd) return {q_out, k_out};
  if (blocks == 0) return {q_out, k_out, at::zeros_like(wq), at::zeros_like(wk)};
  return {q_out, k_out, pq.sum(0).to(wq.scalar_type()), pk.sum(0).to(wk.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                     const at::Tensor& sin, const at::Tensor& q_weight,
                                                     const at::Tensor& k_weight, double eps) {
  check_qk(q, k, cos, sin, q_weight, k_weight, kFwd);
  const auto out = run(q, k, nullptr, nullptr, cos, sin, q_weight, k_weight, eps, false, kFwd);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_bwd_cuda(
    const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps) {
  check_qk(q, k, cos, sin, q_weight, k_weight, kBwd);
  check_twin(dq, q, kBwd, "dq", "q");
  check_twin(dk, k, kBwd, "dk", "k");
  const auto out = run(q, k, &dq, &dk, cos, sin, q_weight, k_weight, eps, true, kBwd);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TIERED_OPS_CUDA_OP(qk_norm_rope,
                  "qk_norm_rope_cuda(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor q_weight, Tensor k_weight, "
                  "float eps) -> (Tensor, Tensor)",
                  "qk_norm_rope_bwd_cuda(Tensor dq, Tensor dk, Tensor q, Tensor k, Tensor cos, Tensor sin, "
                  "Tensor q_weight, Tensor k_weight, float eps) -> (Tensor, Tensor, Tensor, Tensor)");

}  // namespace tiered_ops
