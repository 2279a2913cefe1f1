"""softmax, Triton tier: y = exp(x - max) / sum(exp(x - max)) along one dim, fp32 math; backward
dx = y * (dy - sum(dy * y)).

Bytes: forward 1 read + 1 write for rows up to MAX_FUSED_FWD elements (the row stays in registers); longer rows
loop twice over the row (online max/sum, then normalize): 2 reads + 1 write. Backward: 2 reads (y, dy) +
1 write; longer rows read y and dy twice.
Limits: any row length (the looped kernel); the dim is moved last and made contiguous first (a copy
when it was not last). Rows of one program: ROWS short rows per program to fill the block.
Versions: v1 — fused rows kernel + looped kernel. v2 — the forward keeps rows up to 32768 in registers (32 warps;
v1 looped from 16384: 4096x32768 read twice). The looped kernel keeps a NaN of a lane whose max is still -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import MAX_FUSED_FWD, _online_lse_step, _rows_tile, check_float, check_same, row_settings
from .launch import Plans, Step, register_ops

MAX_FUSED = 16384  # longest row the backward keeps in registers


@triton.jit
def _softmax_rows(x_ptr, y_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs, mask = _rows_tile(rows, cols, n_rows, n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    mx = tl.max(x, axis=1)
    # an all -inf row (the input's, or a row past n_rows) is NaN, as -inf - -inf makes it, without computing that
    mx = tl.where(mx == -float("inf"), float("nan"), mx)
    e = tl.exp(x - mx[:, None])
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
    # per-lane: saw a NaN (the GPU's max drops it, and a lane whose max is still -inf adds nothing to its sum, so a
    # NaN there would be lost)
    nan = tl.zeros([BLOCK_N], tl.int32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m, s = _online_lse_step(m, s, x)
        nan |= (x != x).to(tl.int32)
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m != -float("inf"), s * tl.exp(m - tl.where(m_row == -float("inf"), 0.0, m_row)), 0.0),
                   axis=0)
    s_row = tl.where(tl.max(nan, axis=0) > 0, float("nan"), s_row)  # a NaN anywhere makes the row NaN, as in torch
    m_row = tl.where(m_row == -float("inf"), float("nan"), m_row)  # an all -inf row is NaN (-inf - -inf)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_row + start + cols, (tl.exp(x - m_row) / s_row).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_rows(dy_ptr, y_ptr, dx_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs, mask = _rows_tile(rows, cols, n_rows, n_cols)
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


# One launch plan per direction (kernel, grid, constexprs, int arguments) and one host function that launches from
# it: the registered ops (triton_op, wrap_triton) make the plan per call, the eager fast path (softmax_fast, the kept
# compiled kernel) once per (shape, dtype, device, dim).
class Plan(NamedTuple):
    step: Step | None  # None: nothing to launch (an empty tensor)
    ints: tuple
    last: bool  # dim is already the last dim (no movedim)


def _plan(shape: torch.Size, dim: int, bwd: bool) -> Plan:
    if len(shape) == 0:
        return _plan(torch.Size((1,)), -1, bwd)  # a 0-dim tensor: one row of one element
    d = dim + len(shape) if dim < 0 else dim
    if not 0 <= d < len(shape):
        raise IndexError(f"softmax_triton: dim {dim} out of range for x of {len(shape)} dims")
    # The block size is a compile-time constant derived from n: under dynamic shapes (opcheck's
    # aot_dispatch_dynamic, torch.compile(dynamic=True)) specialize on n; rows stay symbolic.
    n = int(shape[d])
    numel = 1
    for s in shape:
        numel *= s
    last = d == len(shape) - 1
    if numel == 0:
        return Plan(None, (), last)
    rows = numel // n
    fused = MAX_FUSED if bwd else MAX_FUSED_FWD
    block, per, warps = row_settings(n, fused)
    if n <= fused:
        kernel = _softmax_bwd_rows if bwd else _softmax_rows
        return Plan(Step(kernel, (triton.cdiv(rows, per),), warps, BLOCK_N=block, ROWS=per), (rows, n), last)
    kernel = _softmax_bwd_looped if bwd else _softmax_looped
    return Plan(Step(kernel, (rows,), 8, BLOCK_N=4096), (n,), last)


def plan_fwd(x: torch.Tensor, dim: int) -> Plan:
    check_float("softmax_triton", "x", x)
    return _plan(x.shape, dim, False)


def plan_bwd(dy: torch.Tensor, y: torch.Tensor, dim: int) -> Plan:
    check_float("softmax_bwd_triton", "y", y)
    check_same("softmax_bwd_triton", "dy", dy, y, "y")
    if dy.shape != y.shape:
        raise ValueError(f"softmax_bwd_triton: dy must have the shape of y {list(y.shape)}, got {list(dy.shape)}")
    return _plan(y.shape, dim, True)


def _fwd(plan: Plan, direct: bool, x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.dim() == 0:
        xr = x.reshape(1)
    else:
        xr = x.contiguous() if plan.last else x.movedim(dim, -1).contiguous()
    y = torch.empty_like(xr)
    if plan.step is not None:
        plan.step(direct, xr, y, *plan.ints)
    if x.dim() == 0:
        return y.reshape(())
    return y if plan.last else y.movedim(-1, dim)


def _bwd(plan: Plan, direct: bool, dy: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    if y.dim() == 0:
        return torch.zeros_like(y)  # d/dx of softmax over one element is 0
    if plan.last:
        yr, dyr = y.contiguous(), dy.contiguous()
    else:
        yr, dyr = y.movedim(dim, -1).contiguous(), dy.movedim(dim, -1).contiguous()
    dx = torch.empty_like(yr)
    if plan.step is not None:
        plan.step(direct, dyr, yr, dx, *plan.ints)
    return dx if plan.last else dx.movedim(-1, dim)


def softmax_launch(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    return _fwd(plan_fwd(x, dim), False, x, dim)


def softmax_bwd_launch(dy: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """dx of softmax from the output y and its gradient dy (both shaped like x)."""
    return _bwd(plan_bwd(dy, y, dim), False, dy, y, dim)


softmax_triton, softmax_bwd_triton = register_ops("softmax", softmax_launch, softmax_bwd_launch)

_fwd_plans, _bwd_plans = Plans(plan_fwd), Plans(plan_bwd)


def softmax_fast(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax_launch for eager callers: the plan kept per key, the kernel launched directly."""
    key = (x.shape, x.dtype, x.get_device(), dim)
    plan = _fwd_plans.get(key) or _fwd_plans.new(key, x, dim)
    return _fwd(plan, True, x, dim)


def softmax_bwd_fast(dy: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax_bwd_launch for eager callers."""
    key = (y.shape, y.dtype, y.get_device(), dim, dy.shape, dy.dtype, dy.get_device())
    plan = _bwd_plans.get(key) or _bwd_plans.new(key, dy, y, dim)
    return _bwd(plan, True, dy, y, dim)
