"""rms_norm, Triton tier: y = x * rsqrt(mean(x^2) + eps) * w over the trailing dims, fp32 math.

Backward, with r = rsqrt(mean(x^2) + eps) and g = dy * w: dx = r * (g - x * r^2 * mean(g * x)),
dw = sum over rows of dy * x * r. r is recomputed from x (the backward reads x anyway), so the forward
saves nothing but its inputs.
Bytes: forward 1 read + 1 write of x (+ w, cached) for rows up to MAX_FUSED_FWD elements; longer rows loop
twice (sum of squares, then scale): 2 reads + 1 write. Backward: read x, dy, write dx; with a weight,
x and dy are read once more by the dw kernel (v1: 5 passes where 3 would do).
Limits: any row length; non-contiguous x is made contiguous first.
Versions: v1 — fused rows kernel + looped kernel; backward rows/looped dx kernel + column dw kernel.
v2 — the forward keeps rows up to 32768 in registers (32 warps; v1 looped from 16384: 4096x32768 read twice).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .common import (
    MAX_FUSED_FWD,
    ParamGradsPlan,
    check_norm,
    check_same,
    norm_param_grads,
    plan_param_grads,
    row_settings,
)
from .launch import Step, param_key

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


@triton.jit
def _rms_norm_bwd_rows(dy_ptr, x_ptr, w_ptr, dx_ptr, rstd_ptr, n_rows, n_cols, eps, HAS_W: tl.constexpr,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        g = g * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    c = tl.sum(g * x, axis=1) * rstd * rstd / n_cols
    dx = rstd[:, None] * (g - x * c[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_looped(dy_ptr, x_ptr, w_ptr, dx_ptr, rstd_ptr, n_cols, eps, HAS_W: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    acc_ss = tl.zeros([BLOCK_N], tl.float32)
    acc_gx = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        acc_ss += x * x
        acc_gx += g * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc_ss, axis=0) / n_cols + eps)
    c = tl.sum(acc_gx, axis=0) * rstd * rstd / n_cols
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * n_cols + start + cols, (rstd * (g - x * c)).to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(rstd_ptr + row, rstd)


# One launch plan per direction (checks, kernel, grid, constexprs, int arguments) and one host function that launches
# from it: the registered ops (triton_op, wrap_triton) make the plan per call, the eager fast path (rms_norm_fast,
# the kept compiled kernels) once per (shapes, dtype, device).
class FwdPlan(NamedTuple):
    step: Step | None  # None: x is empty
    ints: tuple


class BwdPlan(NamedTuple):
    step: Step | None  # None: x is empty
    ints: tuple
    rows: int
    param_grads: ParamGradsPlan | None


def plan_fwd(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None) -> FwdPlan:
    n = check_norm("rms_norm_triton", x, normalized_shape, weight=weight)
    if x.numel() == 0:
        return FwdPlan(None, ())
    rows = x.numel() // n
    flags = dict(HAS_W=weight is not None)
    block, per, warps = row_settings(n, MAX_FUSED_FWD)
    if n <= MAX_FUSED_FWD:
        return FwdPlan(Step(_rms_norm_rows, (triton.cdiv(rows, per),), warps, **flags, BLOCK_N=block, ROWS=per),
                       (rows, n))
    return FwdPlan(Step(_rms_norm_looped, (rows,), 8, **flags, BLOCK_N=4096), (n,))


def plan_bwd(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None) -> BwdPlan:
    n = check_norm("rms_norm_bwd_triton", x, normalized_shape, weight=weight)
    check_same("rms_norm_bwd_triton", "dy", dy, x)
    if dy.shape != x.shape:
        raise ValueError(f"rms_norm_bwd_triton: dy must have the shape of x {list(x.shape)}, got {list(dy.shape)}")
    if x.numel() == 0:
        return BwdPlan(None, (), 0, None)
    rows = x.numel() // n
    flags = dict(HAS_W=weight is not None)
    pg = plan_param_grads(rows, n, x.device, has_mean=False, with_bias=False) if weight is not None else None
    block, per, warps = row_settings(n, MAX_FUSED)
    if n <= MAX_FUSED:
        return BwdPlan(Step(_rms_norm_bwd_rows, (triton.cdiv(rows, per),), warps, **flags, BLOCK_N=block, ROWS=per),
                       (rows, n), rows, pg)
    return BwdPlan(Step(_rms_norm_bwd_looped, (rows,), 8, **flags, BLOCK_N=4096), (n,), rows, pg)


def _fwd(plan: FwdPlan, direct: bool, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if plan.step is not None:  # weight: a dummy pointer (x), never read when HAS_W is False
        plan.step(direct, xc, xc if weight is None else weight.contiguous(), y, *plan.ints, eps)
    return y


def _bwd(plan: BwdPlan, direct: bool, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float
         ) -> tuple[torch.Tensor, torch.Tensor]:
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(xc)
    if plan.step is None:
        return dx, (torch.zeros_like(weight) if weight is not None else x.new_empty((0,)))
    w = weight.contiguous() if weight is not None else xc
    rstd = x.new_empty(plan.rows, dtype=torch.float32)
    plan.step(direct, dyc, xc, w, dx, rstd, *plan.ints, eps)
    if plan.param_grads is None:
        return dx, x.new_empty((0,))
    dw32, _ = norm_param_grads(plan.param_grads, direct, dyc, xc, None, rstd)
    return dx, dw32.view(weight.shape).to(weight.dtype)


def rms_norm_launch(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float
                    ) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    return _fwd(plan_fwd(x, normalized_shape, weight), False, x, weight, eps)


def rms_norm_bwd_launch(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of rms_norm; dw is an empty tensor when there is no weight."""
    return _bwd(plan_bwd(dy, x, normalized_shape, weight), False, dy, x, weight, eps)


rms_norm_triton = triton_op("tiered_ops::rms_norm_triton", rms_norm_launch, mutates_args={})
rms_norm_bwd_triton = triton_op("tiered_ops::rms_norm_bwd_triton", rms_norm_bwd_launch, mutates_args={})

_fwd_plans: dict[tuple, FwdPlan] = {}
_bwd_plans: dict[tuple, BwdPlan] = {}


def rms_norm_fast(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float
                  ) -> torch.Tensor:
    """rms_norm_launch for eager callers: the plan kept per key, the kernels launched directly."""
    key = (x.shape, x.dtype, x.get_device(), tuple(normalized_shape), param_key(weight))
    plan = _fwd_plans.get(key)
    if plan is None:
        plan = _fwd_plans[key] = plan_fwd(x, normalized_shape, weight)
    return _fwd(plan, True, x, weight, eps)


def rms_norm_bwd_fast(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_bwd_launch for eager callers."""
    key = (x.shape, x.dtype, x.get_device(), tuple(normalized_shape), param_key(weight), dy.shape, dy.dtype,
           dy.get_device())
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plans[key] = plan_bwd(dy, x, normalized_shape, weight)
    return _bwd(plan, True, dy, x, weight, eps)
