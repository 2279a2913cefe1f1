"""rms_norm, Triton tier: y = x * rsqrt(mean(x^2) + eps) * w over the trailing dims, fp32 math.

Backward, with r = rsqrt(mean(x^2) + eps) and g = dy * w: dx = r * (g - x * r^2 * mean(g * x)),
dw = sum over rows of dy * x * r. r is recomputed from x (the backward reads x anyway), so the forward
saves nothing but its inputs.
Bytes: forward 1 read + 1 write of x (+ w, cached) for rows up to MAX_FUSED_FWD elements; longer rows loop
twice (sum of squares, then scale): 2 reads + 1 write. Backward (v2, norm_grads.py): read x, dy, write dx for rows
up to MAX_FUSED_BWD, on a persistent grid whose programs sum dw in registers ((programs, n) fp32 partials, reduced
by a second launch into w's dtype); longer rows read x and dy twice (row statistics, then dx and dw by column block).
Limits: any row length; non-contiguous x is made contiguous first.
Hugging Face forms (constexpr flags of the same kernels, one launch): OFFSET multiplies by (w + w_offset) formed in
fp32 (Gemma); CAST rounds x * r to x's dtype before the weight multiplies it, y in promote(w, x) (Llama). Both take
r = rsqrt(mean(x^2) + eps), the instruction torch.rsqrt is, and a float32 w over bf16/fp16 x. The backward is the
same formula with w + w_offset (through the cast, as autograd passes a gradient through .to()).
Versions: v1 — fused rows kernel + looped kernel; backward rows/looped dx kernel + column dw kernel.
v2 — the forward keeps rows up to 32768 in registers (32 warps; v1 looped from 16384: 4096x32768 read twice).
Backward v2 — two launches (persistent dx kernel with dw partials, then their reduction); v1 read x and dy again in a
column kernel, summed its partials with torch and cast them: 4 launches, 5 passes where 3 would do.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tiered_ops.ops.rms_norm import form_error, form_exception, out_dtype

from .common import MAX_FUSED_FWD, _dy_times_w, _rows_tile, check_float, check_norm, row_settings
from .launch import Plans, Step, param_key, register_ops
from .norm_grads import MAX_FUSED_BWD, GradsPlan, partials, persistent_programs, plan_grads, reduce_grads


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
    """check_norm with the Hugging Face forms' contract (tiered_ops/ops/rms_norm.py, FORM_CHECKS): a form's weight
    may also be float32 over bf16/fp16 x; the normalized size."""
    w_dtype = None if weight is None else weight.dtype
    bad = form_error(weight_offset, cast_before_weight, weight is not None)
    if bad is not None:
        raise form_exception(bad, op)
    if not (weight_offset or cast_before_weight) or weight is None or weight.dtype == x.dtype:
        return check_norm(op, x, normalized_shape, weight=weight)
    n = check_norm(op, x, normalized_shape)
    check_float(op, "weight", weight)
    bad = form_error(weight_offset, cast_before_weight, True, w_dtype, x.dtype)
    if bad is not None:
        raise form_exception(bad, op, x.dtype, w_dtype)
    if weight.device != x.device:
        raise ValueError(f"{op}: weight must be on {x.device} like x, got {weight.device}")
    if list(weight.shape) != list(normalized_shape):
        raise ValueError(f"{op}: weight must have shape {list(normalized_shape)}, got {list(weight.shape)}")
    return n


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
    eps, w_offset = tl.cast(eps, tl.float32), tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
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
    eps, w_offset = tl.cast(eps, tl.float32), tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
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
def _rms_norm_bwd_rows(dy_ptr, x_ptr, w_ptr, dx_ptr, pw_ptr, n_rows, n_cols, eps, w_offset, HAS_W: tl.constexpr,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, OFFSET: tl.constexpr = False,
                       HF: tl.constexpr = False):
    eps, w_offset = tl.cast(eps, tl.float32), tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
    # A persistent program: the row tiles pid, pid + programs, ...; dx tile by tile, and with a weight its tiles' sum
    # of dy * x * r in registers, stored as the program's row of the (programs, n) fp32 dw partials.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if OFFSET:
            w = w + w_offset
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for t in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = t * ROWS + tl.arange(0, ROWS)
        offs, mask = _rows_tile(rows, cols, n_rows, n_cols)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy
        if HAS_W:
            g = dy * w
        rstd = _rstd(tl.sum(x * x, axis=1), n_cols, eps, HF)
        c = tl.sum(g * x, axis=1) * rstd * rstd / n_cols
        dx = rstd[:, None] * (g - x * c[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            acc += dy * x * rstd[:, None]
    if HAS_W:
        tl.store(pw_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=cmask)


@triton.jit
def _rms_norm_bwd_looped(dy_ptr, x_ptr, w_ptr, dx_ptr, pw_ptr, stats_ptr, n_rows, n_cols, eps, w_offset,
                         HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, OFFSET: tl.constexpr = False,
                         HF: tl.constexpr = False):
    eps, w_offset = tl.cast(eps, tl.float32), tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
    # A persistent program over the rows pid, pid + programs, ... longer than one block: first each row's r and
    # c = r^2 mean(g * x) (two floats a row in stats_ptr), then block of columns by block of columns, dx of every row
    # and (with a weight) the rows' sum of dy * x * r in registers, stored into the program's row of the partials.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    for row in range(pid, n_rows, n_prog):
        base = tl.cast(row, tl.int64) * n_cols
        acc_ss = tl.zeros([BLOCK_N], tl.float32)
        acc_gx = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = start + cols < n_cols
            x = tl.load(x_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
            g = _dy_times_w(dy_ptr + base, w_ptr, start + cols, mask, w_offset, HAS_W, OFFSET)
            acc_ss += x * x
            acc_gx += g * x
        rstd = _rstd(tl.sum(acc_ss, axis=0), n_cols, eps, HF)
        tl.store(stats_ptr + 2 * row, rstd)
        tl.store(stats_ptr + 2 * row + 1, tl.sum(acc_gx, axis=0) * rstd * rstd / n_cols)
    tl.debug_barrier()  # every thread of the program sees the stats it stored
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        if HAS_W:
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            if OFFSET:
                w = w + w_offset
        acc = tl.zeros([BLOCK_N], tl.float32)
        for row in range(pid, n_rows, n_prog):
            base = tl.cast(row, tl.int64) * n_cols
            rstd = tl.load(stats_ptr + 2 * row)
            c = tl.load(stats_ptr + 2 * row + 1)
            x = tl.load(x_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
            g = dy
            if HAS_W:
                g = dy * w
            tl.store(dx_ptr + base + start + cols, (rstd * (g - x * c)).to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_W:
                acc += dy * x * rstd
        if HAS_W:
            tl.store(pw_ptr + pid.to(tl.int64) * n_cols + start + cols, acc, mask=mask)


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
    grads: GradsPlan | None  # the reduction of the dx kernel's (programs, n) dw partials (with a weight)
    stats: int = 0  # fp32 scratch values a row of the looped kernel (its per-row statistics)


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
    """Two launches: the persistent dx kernel writing dw's partials, then their reduction (with a weight)."""
    n = check_form("rms_norm_bwd_triton", x, normalized_shape, weight, weight_offset, cast_before_weight)
    check_dy("rms_norm_bwd_triton", dy, x, weight, cast_before_weight)
    if x.numel() == 0:
        return BwdPlan(None, (), 0, None)
    rows = x.numel() // n
    flags = dict(HAS_W=weight is not None, OFFSET=bool(weight_offset), HF=bool(weight_offset or cast_before_weight))
    if n <= MAX_FUSED_BWD:
        block, per, warps = row_settings(n, MAX_FUSED_BWD)
        programs = persistent_programs(triton.cdiv(rows, per), x.device)
        step = Step(_rms_norm_bwd_rows, (programs,), warps, **flags, BLOCK_N=block, ROWS=per)
        return BwdPlan(step, (rows, n), rows, plan_grads(programs, n, weight is not None, False))
    programs = persistent_programs(rows, x.device)
    step = Step(_rms_norm_bwd_looped, (programs,), 8, **flags, BLOCK_N=4096)
    return BwdPlan(step, (rows, n), rows, plan_grads(programs, n, weight is not None, False), 2)


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
    w = weight.contiguous() if weight is not None else xc  # dummy pointers (x), never used without HAS_W
    pw, _ = partials(plan.grads, xc)
    stats = (x.new_empty(plan.rows * plan.stats, dtype=torch.float32),) if plan.stats else ()
    plan.step(direct, dyc, xc, w, dx, pw, *stats, *plan.ints, eps, float(weight_offset))
    if plan.grads is None:
        return dx, x.new_empty((0,))
    return dx, reduce_grads(plan.grads, direct, pw, pw, weight.shape, weight.dtype)[0]


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
