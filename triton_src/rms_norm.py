"""rms_norm, Triton tier: y = x * rsqrt(mean(x^2) + eps) * w over the trailing dims, fp32 math.

Bytes: 1 read + 1 write of x (+ w, cached) for rows up to MAX_FUSED elements; longer rows loop twice
(sum of squares, then scale): 2 reads + 1 write.
Limits: any row length; non-contiguous x is made contiguous first.
Versions: v1 — fused rows kernel + looped kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .common import check_float, row_settings

MAX_FUSED = 16384


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, y_ptr, n_rows, n_cols, eps, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
                   ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_looped(x_ptr, w_ptr, y_ptr, n_cols, eps, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        y = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float
                    ) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    check_float("rms_norm_triton", "x", x)
    k = len(normalized_shape)
    if not 1 <= k <= x.dim() or list(x.shape[x.dim() - k:]) != list(normalized_shape):
        raise ValueError(f"rms_norm_triton: normalized_shape {list(normalized_shape)} must match the trailing "
                         f"dims of x, got x of shape {list(x.shape)}")
    if weight is not None:
        if weight.dtype != x.dtype:
            raise TypeError(f"rms_norm_triton: weight must have the dtype of x ({x.dtype}), got {weight.dtype}")
        if list(weight.shape) != list(normalized_shape) or weight.device != x.device:
            raise ValueError(f"rms_norm_triton: weight must have shape {list(normalized_shape)} on {x.device}, "
                             f"got {list(weight.shape)} on {weight.device}")
        weight = weight.contiguous()
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = 1
    for d in normalized_shape:
        n *= d
    if xc.numel() == 0:
        return y
    rows = xc.numel() // n
    w = weight if weight is not None else xc  # dummy pointer, never read when HAS_W is False
    block, per, warps = row_settings(n, MAX_FUSED)
    if n <= MAX_FUSED:
        wrap_triton(_rms_norm_rows)[(triton.cdiv(rows, per),)](xc, w, y, rows, n, eps, HAS_W=weight is not None,
                                                                 BLOCK_N=block, ROWS=per, num_warps=warps)
    else:
        wrap_triton(_rms_norm_looped)[(rows,)](xc, w, y, n, eps, HAS_W=weight is not None, BLOCK_N=4096,
                                               num_warps=8)
    return y


rms_norm_triton = triton_op("tiered_ops::rms_norm_triton", rms_norm_launch, mutates_args={})
