// The torch wrapper of segment_sum.cu: argument checks, the launch, and the op's registration (binding.h).
#include "binding.h"

namespace tiered_ops {

// Host launchers (segment_sum.cu).
// out[s, :] = sum of values[offsets[s]:offsets[s + 1], :] for `segments` segments of contiguous [rows, d] values,
// fp32 sums; ws: segment_sum_workspace(rows, d) fp32 scratch (the partials of segments split over row ranges, then one
// int64 per range: the long segment starting in it).
// offsets (int64, segments + 1) are not read on the host: malformed ones give unspecified sums, never a fault.
int64_t segment_sum_workspace(int64_t rows, int64_t d);
cudaError_t segment_sum_fwd(const void* values, const int64_t* offsets, void* out, float* ws, int64_t rows, int64_t d,
                            int64_t segments, DType dtype, cudaStream_t stream);
// dvalues[e, :] = dout[segment of e, :] for contiguous [segments, d] dout and [rows, d] dvalues.
cudaError_t segment_sum_bwd(const void* dout, const int64_t* offsets, void* dvalues, int64_t rows, int64_t d,
                            int64_t segments, DType dtype, cudaStream_t stream);

namespace {

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
  at::Tensor ws = f32_empty(xc, {segment_sum_workspace(rows, d)});
  check_launch(segment_sum_fwd(xc.data_ptr(), oc.data_ptr<int64_t>(), out.data_ptr(), ws.data_ptr<float>(), rows, d,
                               segments, dtype_of(values, op, "values"), stream()), op);
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
                               dtype_of(dout, op, "dout"), stream()), op);
  return dx;
}

}  // namespace

TIERED_OPS_CUDA_OP(segment_sum,
                  "segment_sum_cuda(Tensor values, Tensor offsets) -> Tensor",
                  "segment_sum_bwd_cuda(Tensor dout, Tensor offsets, int rows) -> Tensor");

}  // namespace tiered_ops
