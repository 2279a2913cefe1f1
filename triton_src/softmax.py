"""softmax, Triton tier: y = exp(x - max) / sum(exp(x - max)) along one dim, fp32 math; backward
dx = y * (dy - sum(dy * y)).

Bytes: forward 1 read + 1 write for rows up to MAX_FUSED_FWD elements (the row stays in registers); longer rows
loop twice over the row (online max/sum, then normalize): 2 reads + 1 write. Backward: 2 reads (y, dy) +
1 write; longer rows read y and dy twice.
Limits: any row length (the looped kernel); the dim is moved last and made contiguous first (a copy
when it was not last). Rows of one program: ROWS short rows per program to fill the block.
Versions: v1 — fused rows kernel + looped kernel. v2 — the forward keeps rows up to 32768 in registers (32 warps;
v1 looped from 16384: 4096x32768 read twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .common import MAX_FUSED_FWD, check_float, check_same, row_settings
from .launch import bound

MAX_FUSED = 16384  # longest row the backward keeps in registers


@triton.jit
def _softmax_rows(x_ptr, y_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_looped(x_ptr, y_ptr, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], -float("inf"), tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK_N], tl.float32)  # per-lane sum of exp(x - m)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        keep = m_new != -float("inf")  # lanes that saw only -inf add nothing (avoids -inf - -inf)
        s = tl.where(keep, s * tl.exp(m - m_new) + tl.exp(x - m_new), s)
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m != -float("inf"), s * tl.exp(m - m_row), 0.0), axis=0)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + start + cols, (tl.exp(x - m_row) / s_row).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_rows(dy_ptr, y_ptr, dx_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_looped(dy_ptr, y_ptr, dx_ptr, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        y = tl.load(y_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        acc += y * tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(acc, axis=0)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        y = tl.load(y_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * n_cols + start + cols, (y * (dy - s)).to(dx_ptr.dtype.element_ty), mask=mask)


def softmax_rows(x: torch.Tensor, y: torch.Tensor, rows: int, n: int) -> None:
    """Launch on contiguous (rows, n) x into y."""
    block, per, warps = row_settings(n, MAX_FUSED_FWD)
    if n <= MAX_FUSED_FWD:
        wrap_triton(_softmax_rows)[(triton.cdiv(rows, per),)](x, y, rows, n, BLOCK_N=block, ROWS=per,
                                                                num_warps=warps)
    else:
        wrap_triton(_softmax_looped)[(rows,)](x, y, n, BLOCK_N=4096, num_warps=8)


def softmax_launch(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    check_float("softmax_triton", "x", x)
    xr = x.reshape(1) if x.dim() == 0 else x.movedim(dim, -1).contiguous()
    y = torch.empty_like(xr)
    # The block size is a compile-time constant derived from n: under dynamic shapes (opcheck's
    # aot_dispatch_dynamic, torch.compile(dynamic=True)) specialize on n; rows stay symbolic.
    n = int(xr.shape[-1])
    if xr.numel():
        softmax_rows(xr, y, xr.numel() // n, n)
    return y.reshape(()) if x.dim() == 0 else y.movedim(-1, dim)


def softmax_bwd_launch(dy: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """dx of softmax from the output y and its gradient dy (both shaped like x)."""
    check_float("softmax_bwd_triton", "y", y)
    check_same("softmax_bwd_triton", "dy", dy, y, "y")
    if dy.shape != y.shape:
        raise ValueError(f"softmax_bwd_triton: dy must have the shape of y {list(y.shape)}, got {list(dy.shape)}")
    if y.dim() == 0:
        return torch.zeros_like(y)  # d/dx of softmax over one element is 0
    yr, dyr = y.movedim(dim, -1).contiguous(), dy.movedim(dim, -1).contiguous()
    dx = torch.empty_like(yr)
    n = int(yr.shape[-1])
    if yr.numel():
        rows = yr.numel() // n
        block, per, warps = row_settings(n, MAX_FUSED)
        if n <= MAX_FUSED:
            wrap_triton(_softmax_bwd_rows)[(triton.cdiv(rows, per),)](dyr, yr, dx, rows, n, BLOCK_N=block, ROWS=per,
                                                                        num_warps=warps)
        else:
            wrap_triton(_softmax_bwd_looped)[(rows,)](dyr, yr, dx, n, BLOCK_N=4096, num_warps=8)
    return dx.movedim(-1, dim)


softmax_triton = triton_op("tiered_ops::softmax_triton", softmax_launch, mutates_args={})
softmax_bwd_triton = triton_op("tiered_ops::softmax_bwd_triton", softmax_bwd_launch, mutates_args={})


# The eager fast path: the same launches as softmax_launch / softmax_bwd_launch through DirectKernel, the settings of
# each (shape, dtype, device, dim) worked out once. Only when not traced: torch.compile traces the ops above.
_fwd_plans: dict[tuple, tuple] = {}
_bwd_plans: dict[tuple, tuple] = {}


def _rows_plan(shape: torch.Size, dim: int, bwd: bool) -> tuple:
    """(launch, int args, last): last when dim is already the last dim (no movedim); launch None: nothing to do."""
    if len(shape) == 0:
        return None, (), True
    d = dim + len(shape) if dim < 0 else dim
    if not 0 <= d < len(shape):
        raise IndexError(f"softmax_triton: dim {dim} out of range for x of {len(shape)} dims")
    n = int(shape[d])
    numel = 1
    for s in shape:
        numel *= s
    last = d == len(shape) - 1
    if numel == 0:
        return None, (), last
    rows = numel // n
    fused = MAX_FUSED if bwd else MAX_FUSED_FWD
    block, per, warps = row_settings(n, fused)
    if n <= fused:
        kernel = _softmax_bwd_rows if bwd else _softmax_rows
        return bound(kernel, (triton.cdiv(rows, per), 1, 1), warps, BLOCK_N=block, ROWS=per), (rows, n), last
    kernel = _softmax_bwd_looped if bwd else _softmax_looped
    return bound(kernel, (rows, 1, 1), 8, BLOCK_N=4096), (n,), last


def softmax_fast(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax_launch, launched directly (the same kernels and settings)."""
    key = (x.shape, x.dtype, x.get_device(), dim)
    plan = _fwd_plans.get(key)
    if plan is None:
        check_float("softmax_triton", "x", x)
        plan = _fwd_plans[key] = _rows_plan(x.shape, dim, False)
    launch, ints, last = plan
    if launch is None and last and x.dim() == 0:
        return softmax_launch(x, dim)
    xr = x.contiguous() if last else x.movedim(dim, -1).contiguous()
    y = torch.empty_like(xr)
    if launch is not None:
        launch(xr, y, *ints)
    return y if last else y.movedim(-1, dim)


def softmax_bwd_fast(dy: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax_bwd_launch, launched directly."""
    key = (y.shape, y.dtype, y.get_device(), dim, dy.shape, dy.dtype, dy.get_device())
    plan = _bwd_plans.get(key)
    if plan is None:
        check_float("softmax_bwd_triton", "y", y)
        check_same("softmax_bwd_triton", "dy", dy, y, "y")
        if dy.shape != y.shape:
            raise ValueError(f"softmax_bwd_triton: dy must have the shape of y {list(y.shape)}, got {list(dy.shape)}")
        plan = _bwd_plans[key] = _rows_plan(y.shape, dim, True)
    launch, ints, last = plan
    if launch is None and last and y.dim() == 0:
        return torch.zeros_like(y)
    if last:
        yr, dyr = y.contiguous(), dy.contiguous()
    else:
        yr, dyr = y.movedim(dim, -1).contiguous(), dy.movedim(dim, -1).contiguous()
    dx = torch.empty_like(yr)
    if launch is not None:
        launch(dyr, yr, dx, *ints)
    return dx if last else dx.movedim(-1, dim)
