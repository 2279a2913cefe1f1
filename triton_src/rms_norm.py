"""rms_norm, Triton tier: y = x * rsqrt(mean(x^2) + eps) * w over the trailing dims, fp32 math.

Backward, with r = rsqrt(mean(x^2) + eps) and g = dy * w: dx = r * (g - x * r^2 * mean(g * x)),
dw = sum over rows of dy * x * r. r is recomputed from x (the backward reads x anyway), so the forward
saves nothing but its inputs.
Bytes: forward 1 read + 1 write of x (+ w, cached) for rows up to MAX_FUSED_FWD elements; longer rows loop
twice (sum of squares, then scale): 2 reads + 1 write. Backward: read x, dy, write dx; with a weight,
x and dy are read once more by the dw kernel (v1: 5 passes where 3 would do).
Limits: any row length; non-contiguous x is made contiguous first.
Hugging Face forms (constexpr flags of the same kernels, one launch): OFFSET multiplies by (w + w_offset) formed in
fp32 (Gemma); CAST rounds x * r to x's dtype before the weight multiplies it, y in promote(w, x) (Llama). Both take
r = rsqrt(mean(x^2) + eps), the instruction torch.rsqrt is, and a float32 w over bf16/fp16 x. The backward is the
same formula with w + w_offset (through the cast, as autograd passes a gradient through .to()).
Versions: v1 — fused rows kernel + looped kernel; backward rows/looped dx kernel + column dw kernel.
v2 — the forward keeps rows up to 32768 in registers (32 warps; v1 looped from 16384: 4096x32768 read twice).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (
    MAX_FUSED_FWD,
    ParamGradsPlan,
    _dy_times_w,
    _rows_tile,
    check_float,
    check_norm,
    norm_param_grads,
    plan_param_grads,
    row_settings,
)
from .launch import Plans, Step, param_key, register_ops

MAX_FUSED = 16384


@triton.jit
def _rstd(ss, n_cols, eps, HF: tl.constexpr):
    # HF: rsqrt(mean + eps), as the Hugging Face modules compute it with torch.rsqrt
    if HF:
        r = tl.math.rsqrt(ss / n_cols + eps)
    else:
        r = 1.0 / tl.sqrt(ss / n_cols + eps)
    return r


@triton.jit
def _apply_weight(y, w, w_offset, x_dtype: tl.constexpr, OFFSET: tl.constexpr, CAST: tl.constexpr):
    # y = x * r in fp32 and w loaded in fp32: y * (w + w_offset), or the weight after y's rounding to x's dtype
    if CAST:
        y = y.to(x_dtype).to(tl.float32)
    if OFFSET:
        w = w + w_offset
    return y * w


def check_form(op: str, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
               weight_offset: float, cast_before_weight: bool) -> int:
    """check_norm, where a Hugging Face form's weight may also be float32 over bf16/fp16 x; the normalized size."""
    if weight_offset and (cast_before_weight or weight is None):
        raise ValueError(f"{op}: weight_offset={weight_offset} needs a weight and excludes cast_before_weight")
    if not (weight_offset or cast_before_weight) or weight is None or weight.dtype == x.dtype:
        return check_norm(op, x, normalized_shape, weight=weight)
    n = check_norm(op, x, normalized_shape)
    check_float(op, "weight", weight)
    if weight.dtype != torch.float32:
        raise TypeError(f"{op}: weight must have the dtype of x ({x.dtype}) or float32, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight must be on {x.device} like x, got {weight.device}")
    if list(weight.shape) != list(normalized_shape):
        raise ValueError(f"{op}: weight must have shape {list(normalized_shape)}, got {list(weight.shape)}")
    return n


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None, cast_before_weight: bool) -> torch.dtype:
    """y's dtype: x's, or promote(weight, x) where the weight multiplies after the cast."""
    return torch.promote_types(weight.dtype, x.dtype) if cast_before_weight and weight is not None else x.dtype


def check_dy(op: str, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, cast_before_weight: bool,
             x_name: str = "x") -> None:
    """dy has the forward output's dtype, x's device and x's shape."""
    want = out_dtype(x, weight, cast_before_weight)
    if dy.dtype != want:
        raise TypeError(f"{op}: dy must have the output's dtype {want}, got {dy.dtype}")
    if dy.device != x.device:
        raise ValueError(f"{op}: dy must be on {x.device} like {x_name}, got {dy.device}")
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy must have the shape of {x_name} {list(x.shape)}, got {list(dy.shape)}")


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, y_ptr, n_rows, n_cols, eps, w_offset, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
                   ROWS: tl.constexpr, OFFSET: tl.constexpr = False, CAST: tl.constexpr = False):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs, mask = _rows_tile(rows, cols, n_rows, n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = _rstd(tl.sum(x * x, axis=1), n_cols, eps, OFFSET or CAST)
    y = x * rstd[:, None]
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        y = _apply_weight(y, w, w_offset, x_ptr.dtype.element_ty, OFFSET, CAST)
    elif CAST:
        y = y.to(x_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_looped(x_ptr, w_ptr, y_ptr, n_cols, eps, w_offset, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
                     OFFSET: tl.constexpr = False, CAST: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
        acc += x * x
    rstd = _rstd(tl.sum(acc, axis=0), n_cols, eps, OFFSET or CAST)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        y = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32) * rstd
        if HAS_W:
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = _apply_weight(y, w, w_offset, x_ptr.dtype.element_ty, OFFSET, CAST)
        elif CAST:
            y = y.to(x_ptr.dtype.element_ty)
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_rows(dy_ptr, x_ptr, w_ptr, dx_ptr, rstd_ptr, n_rows, n_cols, eps, w_offset, HAS_W: tl.constexpr,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, OFFSET: tl.constexpr = False,
                       HF: tl.constexpr = False):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs, mask = _rows_tile(rows, cols, n_rows, n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        if OFFSET:
            w = w + w_offset
        g = g * w
    rstd = _rstd(tl.sum(x * x, axis=1), n_cols, eps, HF)
    c = tl.sum(g * x, axis=1) * rstd * rstd / n_cols
    dx = rstd[:, None] * (g - x * c[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_looped(dy_ptr, x_ptr, w_ptr, dx_ptr, rstd_ptr, n_cols, eps, w_offset, HAS_W: tl.constexpr,
                         BLOCK_N: tl.constexpr, OFFSET: tl.constexpr = False, HF: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    acc_ss = tl.zeros([BLOCK_N], tl.float32)
    acc_gx = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        g = _dy_times_w(dy_ptr + row * n_cols, w_ptr, start + cols, mask, w_offset, HAS_W, OFFSET)
        acc_ss += x * x
        acc_gx += g * x
    rstd = _rstd(tl.sum(acc_ss, axis=0), n_cols, eps, HF)
    c = tl.sum(acc_gx, axis=0) * rstd * rstd / n_cols
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        g = _dy_times_w(dy_ptr + row * n_cols, w_ptr, start + cols, mask, w_offset, HAS_W, OFFSET)
        tl.store(dx_ptr + row * n_cols + start + cols, (rstd * (g - x * c)).to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(rstd_ptr + row, rstd)


# One launch plan per direction (checks, kernel, grid, constexprs, int arguments) and one host function that launches
# from it: the registered ops (triton_op, wrap_triton) make the plan per call, the eager fast path (rms_norm_fast,
# the kept compiled kernels) once per (shapes, dtype, device). fused_add_rms_norm's plans are these too.
class FwdPlan(NamedTuple):
    step: Step | None  # None: x is empty
    ints: tuple
    rows: int
    out: torch.dtype  # y's dtype


class BwdPlan(NamedTuple):
    step: Step | None  # None: x is empty
    ints: tuple
    rows: int
    param_grads: ParamGradsPlan | None  # the column kernel's dw (with a weight)
    persistent: bool = False  # fused_add_rms_norm's rows kernel (a persistent grid, dw in registers)
    dw_shape: tuple | None = None  # that kernel's (programs, n) fp32 dw partials (with a weight)


def leading_rows(x: torch.Tensor, normalized_shape: list[int]) -> int:
    """Rows of x over the trailing dims normalized_shape (also where those hold no elements)."""
    return math.prod(x.shape[: x.dim() - len(normalized_shape)])


def fwd_plan(rows_kernel: triton.JITFunction, looped_kernel: triton.JITFunction, x: torch.Tensor, n: int,
             rows: int, weight: torch.Tensor | None, weight_offset: float, cast_before_weight: bool) -> FwdPlan:
    """The forward of the rms_norm kernels' form (int arguments (rows, n) or (n,)): rows up to MAX_FUSED_FWD in
    registers, several short rows a program, longer rows looped in blocks of 4096."""
    dt = out_dtype(x, weight, cast_before_weight)
    if x.numel() == 0:
        return FwdPlan(None, (), rows, dt)
    flags = dict(HAS_W=weight is not None, OFFSET=bool(weight_offset), CAST=bool(cast_before_weight))
    block, per, warps = row_settings(n, MAX_FUSED_FWD)
    if n <= MAX_FUSED_FWD:
        return FwdPlan(Step(rows_kernel, (triton.cdiv(rows, per),), warps, **flags, BLOCK_N=block, ROWS=per),
                       (rows, n), rows, dt)
    return FwdPlan(Step(looped_kernel, (rows,), 8, **flags, BLOCK_N=4096), (n,), rows, dt)


def plan_fwd(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, weight_offset: float = 0.0,
             cast_before_weight: bool = False) -> FwdPlan:
    n = check_form("rms_norm_triton", x, normalized_shape, weight, weight_offset, cast_before_weight)
    return fwd_plan(_rms_norm_rows, _rms_norm_looped, x, n, leading_rows(x, normalized_shape), weight, weight_offset,
                    cast_before_weight)


def plan_bwd(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
             weight_offset: float = 0.0, cast_before_weight: bool = False) -> BwdPlan:
    n = check_form("rms_norm_bwd_triton", x, normalized_shape, weight, weight_offset, cast_before_weight)
    check_dy("rms_norm_bwd_triton", dy, x, weight, cast_before_weight)
    if x.numel() == 0:
        return BwdPlan(None, (), 0, None)
    rows = x.numel() // n
    flags = dict(HAS_W=weight is not None, OFFSET=bool(weight_offset), HF=bool(weight_offset or cast_before_weight))
    pg = plan_param_grads(rows, n, x.device, has_mean=False, with_bias=False) if weight is not None else None
    block, per, warps = row_settings(n, MAX_FUSED)
    if n <= MAX_FUSED:
        return BwdPlan(Step(_rms_norm_bwd_rows, (triton.cdiv(rows, per),), warps, **flags, BLOCK_N=block, ROWS=per),
                       (rows, n), rows, pg)
    return BwdPlan(Step(_rms_norm_bwd_looped, (rows,), 8, **flags, BLOCK_N=4096), (n,), rows, pg)


def _fwd(plan: FwdPlan, direct: bool, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
         weight_offset: float) -> torch.Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc, dtype=plan.out)
    if plan.step is not None:  # weight: a dummy pointer (x), never read when HAS_W is False
        plan.step(direct, xc, xc if weight is None else weight.contiguous(), y, *plan.ints, eps, float(weight_offset))
    return y


def _bwd(plan: BwdPlan, direct: bool, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
         weight_offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(xc)
    if plan.step is None:
        return dx, (torch.zeros_like(weight) if weight is not None else x.new_empty((0,)))
    w = weight.contiguous() if weight is not None else xc
    rstd = x.new_empty(plan.rows, dtype=torch.float32)
    plan.step(direct, dyc, xc, w, dx, rstd, *plan.ints, eps, float(weight_offset))
    if plan.param_grads is None:
        return dx, x.new_empty((0,))
    dw32, _ = norm_param_grads(plan.param_grads, direct, dyc, xc, None, rstd)
    return dx, dw32.view(weight.shape).to(weight.dtype)


def rms_norm_launch(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float,
                    weight_offset: float = 0.0, cast_before_weight: bool = False) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    plan = plan_fwd(x, normalized_shape, weight, weight_offset, cast_before_weight)
    return _fwd(plan, False, x, weight, eps, weight_offset)


def rms_norm_bwd_launch(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                        eps: float, weight_offset: float = 0.0, cast_before_weight: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of rms_norm; dw is an empty tensor when there is no weight."""
    plan = plan_bwd(dy, x, normalized_shape, weight, weight_offset, cast_before_weight)
    return _bwd(plan, False, dy, x, weight, eps, weight_offset)


rms_norm_triton, rms_norm_bwd_triton = register_ops("rms_norm", rms_norm_launch, rms_norm_bwd_launch)

_fwd_plans, _bwd_plans = Plans(plan_fwd), Plans(plan_bwd)


def rms_norm_fast(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float,
                  weight_offset: float = 0.0, cast_before_weight: bool = False) -> torch.Tensor:
    """rms_norm_launch for eager callers: the plan kept per key, the kernels launched directly."""
    key = (x.shape, x.dtype, x.get_device(), tuple(normalized_shape), param_key(weight), bool(weight_offset),
           bool(cast_before_weight))
    plan = _fwd_plans.get(key) or _fwd_plans.new(key, x, normalized_shape, weight, weight_offset, cast_before_weight)
    return _fwd(plan, True, x, weight, eps, weight_offset)


def rms_norm_bwd_fast(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                      eps: float, weight_offset: float = 0.0, cast_before_weight: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_bwd_launch for eager callers."""
    key = (x.shape, x.dtype, x.get_device(), tuple(normalized_shape), param_key(weight), dy.shape, dy.dtype,
           dy.get_device(), bool(weight_offset), bool(cast_before_weight))
    plan = _bwd_plans.get(key) or _bwd_plans.new(key, dy, x, normalized_shape, weight, weight_offset,
                                                 cast_before_weight)
    return _bwd(plan, True, dy, x, weight, eps, weight_offset)
