// Host launchers of the tiered_ops CUDA kernels: raw pointers, sizes and a stream, no torch types.
// binding.cpp (the only file that includes torch) validates tensors and calls these; each returns
// the launch's cudaError_t so the binding can report it.
#pragma once
#include <cuda_runtime_api.h>
#include <cstdint>

namespace tiered_ops {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// y[r, :] = softmax(x[r, :]) for `rows` contiguous rows of `n` elements.
cudaError_t softmax_fwd(const void* x, void* y, int64_t rows, int64_t n, DType dtype, cudaStream_t stream);

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w (w may be null) for contiguous rows. Hugging Face forms:
// w_offset multiplies by (w + w_offset) in fp32; cast rounds x * rsqrt(...) to the dtype before the weight. w_fp32: w is
// float32 over a bf16/fp16 x (y is then float32 under cast, else x's dtype).
cudaError_t rms_norm_fwd(const void* x, const void* w, void* y, int64_t rows, int64_t n, float eps, DType dtype,
                         cudaStream_t stream, float w_offset = 0.f, bool cast = false, bool w_fp32 = false);

// out = a * b + c over `numel` contiguous elements (fp32 arithmetic, one rounding).
cudaError_t muladd_fwd(const void* a, const void* b, const void* c, void* out, int64_t numel, DType dtype,
                       cudaStream_t stream);

// dx[r, :] = y * (dy - sum(dy * y)) over contiguous rows.
cudaError_t softmax_bwd(const void* dy, const void* y, void* dx, int64_t rows, int64_t n, DType dtype,
                        cudaStream_t stream);

// rms_norm backward: dx for every row; with w, also rstd per row and dw_partial (ceil(rows / rows_per), n) fp32
// partial sums of the weight gradient (the caller sums them). w_offset as in the forward; w_fp32: a float32 w over a
// bf16/fp16 x, with dy float32 when dy_fp32 (the forward's output under cast).
cudaError_t rms_norm_bwd(const void* dy, const void* x, const void* w, void* dx, float* rstd, float* dw_partial,
                         int64_t rows, int64_t n, float eps, int64_t rows_per, DType dtype, cudaStream_t stream,
                         float w_offset = 0.f, bool w_fp32 = false, bool dy_fp32 = false);

// fused_add_rms_norm forward: s = x + residual (rounded once to the dtype), y = s * rsqrt(mean(s^2) + eps) * w
// (w may be null), with the per-row fp32 rstd out.
// Hugging Face forms and w_fp32 as for rms_norm_fwd, on y.
cudaError_t fused_add_rms_norm_fwd(const void* x, const void* residual, const void* w, void* y, void* s, float* rstd,
                                   int64_t rows, int64_t n, float eps, DType dtype, cudaStream_t stream,
                                   float w_offset = 0.f, bool cast = false, bool w_fp32 = false);

// fused_add_rms_norm backward from s and the saved rstd: dx = ds + rms_norm's dx of dy at s; with w, dw_partial as for
// rms_norm_bwd (w_offset, w_fp32, dy_fp32 as there).
cudaError_t fused_add_rms_norm_bwd(const void* dy, const void* ds, const void* s, const void* w, const float* rstd,
                                   void* dx, float* dw_partial, int64_t rows, int64_t n, int64_t rows_per, DType dtype,
                                   cudaStream_t stream, float w_offset = 0.f, bool w_fp32 = false,
                                   bool dy_fp32 = false);

// layer_norm forward: y = (x - mean) * rstd * w + b (w, b may be null), with per-row fp32 mean and rstd out.
cudaError_t layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                           int64_t rows, int64_t n, float eps, DType dtype, cudaStream_t stream);

// layer_norm backward from the saved statistics: dx; dw_partial / db_partial (may be null) as for rms_norm_bwd.
cudaError_t layer_norm_bwd(const void* dy, const void* x, const void* w, const float* mean, const float* rstd,
                           void* dx, float* dw_partial, float* db_partial, int64_t rows, int64_t n, int64_t rows_per,
                           DType dtype, cudaStream_t stream);

// (da, db) = (g * b, g * a) over `numel` contiguous elements.
cudaError_t muladd_bwd(const void* g, const void* a, const void* b, void* da, void* db, int64_t numel, DType dtype,
                       cudaStream_t stream);

// y = gelu(x + bias[i % n]) (bias may be null), erf or tanh form; dx = dy * gelu'(x + bias).
cudaError_t gelu_fwd(const void* x, const void* bias, void* y, int64_t numel, int64_t n, bool tanh_approx,
                     DType dtype, cudaStream_t stream);
cudaError_t gelu_bwd(const void* dy, const void* x, const void* bias, void* dx, int64_t numel, int64_t n,
                     bool tanh_approx, DType dtype, cudaStream_t stream);

// cross_entropy forward over rows of logits (row stride `stride`, last dim contiguous) with int64 targets: float32
// loss[r] (0 for an ignored row, NaN for a target outside [0, n)) and lse[r] = log sum exp of the row.
cudaError_t cross_entropy_fwd(const void* x, const int64_t* target, float* loss, float* lse, int64_t rows, int64_t n,
                              int64_t stride, int64_t ignore_index, float smoothing, DType dtype, cudaStream_t stream);

// cross_entropy backward: contiguous dx[r, :] = (exp(x - lse[r]) - s / n - (1 - s) [j == t]) * g[r * g_stride],
// zeros for an ignored row (g_stride 0: one scale for every row).
cudaError_t cross_entropy_bwd(const void* x, const int64_t* target, const float* lse, const float* g, int64_t g_stride,
                              void* dx, int64_t rows, int64_t n, int64_t stride, int64_t ignore_index, float smoothing,
                              DType dtype, cudaStream_t stream);

// out[s, :] = sum of values[offsets[s]:offsets[s + 1], :] for `segments` segments of contiguous [rows, d] values,
// fp32 sums; ws: segment_sum_workspace(rows, d) fp32 scratch (the partials of segments split over row ranges).
// offsets (int64, segments + 1) are not read on the host: malformed ones give unspecified sums, never a fault.
int64_t segment_sum_workspace(int64_t rows, int64_t d);
cudaError_t segment_sum_fwd(const void* values, const int64_t* offsets, void* out, float* ws, int64_t rows, int64_t d,
                            int64_t segments, DType dtype, cudaStream_t stream);
// dvalues[e, :] = dout[segment of e, :] for contiguous [segments, d] dout and [rows, d] dvalues.
cudaError_t segment_sum_bwd(const void* dout, const int64_t* offsets, void* dvalues, int64_t rows, int64_t d,
                            int64_t segments, DType dtype, cudaStream_t stream);

}  // namespace tiered_ops
