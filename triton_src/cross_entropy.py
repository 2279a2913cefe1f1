"""cross_entropy, Triton tier: per row of logits [N, V], lse = log sum exp(x) by an online softmax (one pass: a
running max and sum of exp per lane, combined once at the end), loss = lse - (1 - s) x[t] - s / V sum(x), the [N]
losses in float32. Backward:
dx = (exp(x - lse) - s / V - (1 - s) [j == t]) * g from the saved lse; an ignored row 0, NaN where its lse is not
finite (torch's 0 * softmax). The reductions ('sum'; 'mean': over the count of rows whose target is not ignore_index,
0 / 0 = NaN where every row is ignored) are one more launch of one program that sums the losses in a fixed order and
writes the scalar in the output dtype.

Bytes: forward 1 read of the logits (+ the target's logit, one cached line) + 8 N (targets) + 8 N (loss and lse,
float32); no [N, V] intermediate. Backward 1 read + 1 write of [N, V] (+ targets, lse, the output gradient).
Limits: any V (the row is looped over in BLOCK_V chunks); one program per row; rows with a row stride (logits whose
last dim is contiguous) are read in place, others are made contiguous first. Targets are not checked on a GPU (a
sync): a target outside [0, V) that is not ignore_index makes its row's loss and gradient NaN. On the CPU
interpreter the launcher checks them (no sync there) and raises a ValueError naming target.
Versions: v1 — one program per row, per-lane online softmax, recompute in the backward.
v2 — the forward's online softmax over groups of GROUP adjacent elements a thread holds: one max per group (no
shuffle), so one exp per element and one per group where v1 took two per element. v1's forward was bound by the exp
unit, not memory (an H100, 4096x128256 bf16: 0.77 of copy; v2 0.98).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import check_float, num_warps_for
from .launch import Plans, Step, register_ops

MAX_BLOCK = 4096  # elements of a row one iteration of a program loads
GROUP = 8  # adjacent elements of the forward's block that share one running max (v2)
REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _ce_fwd(x_ptr, t_ptr, loss_ptr, lse_ptr, n_cols, stride, ignore_index, smoothing, BLOCK_V: tl.constexpr,
            GROUP: tl.constexpr, SMOOTH: tl.constexpr):
    smoothing = tl.cast(smoothing, tl.float32)  # Inductor passes float arguments as fp64
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    if t == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
    else:
        x_row = x_ptr + row * stride
        # a block as [BLOCK_V // GROUP, GROUP]: a group's elements are adjacent, so one thread holds them
        cols = tl.arange(0, BLOCK_V // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        m = tl.full([BLOCK_V // GROUP], -float("inf"), tl.float32)  # per-group running max
        s = tl.zeros([BLOCK_V // GROUP], tl.float32)  # per-group sum of exp(x - m)
        xs = tl.zeros([BLOCK_V // GROUP], tl.float32)  # per-group sum of x (label smoothing)
        for start in range(0, n_cols, BLOCK_V):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            keep = m_new != -float("inf")  # groups that saw only -inf add nothing (avoids -inf - -inf)
            shift = tl.where(keep, m_new, 0.0)  # the groups not kept compute nothing invalid either
            s = tl.where(keep, s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1), s)
            # maximum drops a NaN: the sum carries it
            s = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), s)
            m = m_new
            if SMOOTH:
                xs += tl.sum(tl.where(mask, x, 0.0), axis=1)
        m_row = tl.max(m, axis=0)
        # a NaN anywhere made its group's s NaN (NaN * 0 stays NaN), so the row's lse is NaN, as in torch
        s_row = tl.sum(s * tl.where(m != -float("inf"), tl.exp(m - tl.where(m_row == -float("inf"), 0.0, m_row)), 0.0),
                       axis=0)
        lse = m_row + tl.log(s_row)
        ok = (t >= 0) & (t < n_cols)
        xt = tl.load(x_row + tl.where(ok, t, 0)).to(tl.float32)
        loss = lse - (1.0 - smoothing) * xt
        if SMOOTH:
            loss -= smoothing / n_cols * tl.sum(xs, axis=0)
        tl.store(loss_ptr + row, tl.where(ok, loss, float("nan")))
        tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd(x_ptr, t_ptr, lse_ptr, g_ptr, g_stride, dx_ptr, n_cols, stride, ignore_index, smoothing,
            BLOCK_V: tl.constexpr):
    smoothing = tl.cast(smoothing, tl.float32)  # Inductor passes float arguments as fp64
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    dx_row = dx_ptr + row * n_cols
    if t == ignore_index:
        # torch's gradient of an ignored row is 0 * softmax: 0, or NaN across the row where its lse is not finite
        # (a NaN, a +inf, or every entry -inf): the row's max, a NaN counted as +inf, says which.
        x_row = x_ptr + row * stride
        m = tl.full([BLOCK_V], -float("inf"), tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float("inf")).to(tl.float32)
            m = tl.maximum(m, tl.where(x != x, float("inf"), x))
        z = tl.zeros([BLOCK_V], tl.float32) + tl.max(m, axis=0) * 0.0  # NaN for +-inf
        for start in range(0, n_cols, BLOCK_V):
            tl.store(dx_row + start + cols, z.to(dx_ptr.dtype.element_ty), mask=start + cols < n_cols)
    else:
        x_row = x_ptr + row * stride
        g = tl.load(g_ptr + row * g_stride)
        lse = tl.load(lse_ptr + row)
        ok = (t >= 0) & (t < n_cols)
        off = smoothing / n_cols
        for start in range(0, n_cols, BLOCK_V):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            d = tl.exp(x - lse) - off - tl.where(start + cols == t, 1.0 - smoothing, 0.0)
            d = tl.where(ok, d * g, float("nan"))
            tl.store(dx_row + start + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_reduce(num_ptr, t_ptr, out_ptr, rows, ignore_index, BLOCK: tl.constexpr, MEAN: tl.constexpr,
               SUM_ROWS: tl.constexpr):
    # out = the sum of num[:rows] (SUM_ROWS: the forward's losses) or num[0] (the backward's output gradient), over
    # the count of targets not ignore_index where MEAN
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.int64)
    for start in range(0, rows, BLOCK):
        mask = start + offs < rows
        if SUM_ROWS:
            total += tl.load(num_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        if MEAN:
            t = tl.load(t_ptr + start + offs, mask=mask, other=ignore_index)
            count += (t != ignore_index).to(tl.int64)
    if SUM_ROWS:
        out = tl.sum(total, axis=0)
    else:
        out = tl.load(num_ptr).to(tl.float32)
    if MEAN:
        out = out / tl.sum(count, axis=0).to(tl.float32)  # a float32 sum over an int64 count, as torch divides
    tl.store(out_ptr, out.to(out_ptr.dtype.element_ty))


REDUCE_BLOCK = 1024  # losses one iteration of the reduction loads (fixed: the rows stay symbolic under compile)


def _check(op: str, logits: torch.Tensor, target: torch.Tensor, reduction: str, label_smoothing: float) -> None:
    check_float(op, "logits", logits)
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"{op}: logits must have shape [N, V] with V >= 1, got {list(logits.shape)}")
    if target.dtype != torch.int64:
        raise TypeError(f"{op}: target must have dtype int64 (class indices), got {target.dtype}")
    if target.device != logits.device:
        raise ValueError(f"{op}: target must be on {logits.device} like logits, got {target.device}")
    if tuple(target.shape) != (logits.shape[0],):
        raise ValueError(f"{op}: target must have shape [N] = [{logits.shape[0]}] for logits of shape "
                         f"{list(logits.shape)}, got {list(target.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")


def _check_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Targets in [0, V) or ignore_index, checked where that costs no device sync (the CPU interpreter)."""
    if target.device.type != "cpu":
        return
    bad = ((target < 0) | (target >= n_classes)) & (target != ignore_index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"cross_entropy_triton: target[{i}] = {int(target[i])} is outside [0, {n_classes}) and is "
                         f"not ignore_index ({ignore_index})")


def _rows_of(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(1) == 1 else logits.contiguous()


# One launch plan per direction (checks, kernel, grid, constexprs, int arguments) and one host function that launches
# from it: the registered ops (triton_op, wrap_triton) make the plan per call, the eager fast path
# (cross_entropy_fast, the kept compiled kernel) once per (shapes, strides, dtypes, device, options: ignore_index too,
# an int argument whose specialization the kept kernel fixes). The targets' values are checked (on the CPU) per call.
class Plan(NamedTuple):
    step: Step | None  # None: no rows
    ints: tuple  # the kernel's int arguments after the pointers (V and the logits' row stride)
    rows: int
    n: int
    reduce: Step | None = None  # the forward's reduction to a scalar ('sum', 'mean'), the backward's scale ('mean')


def _block(n: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(n))


def _plan(logits: torch.Tensor, kernel: object, **consts: object) -> Plan:
    # BLOCK_V is a compile-time constant derived from V: under dynamic shapes specialize on V; rows stay symbolic.
    rows, n = logits.shape[0], int(logits.shape[1])
    if not rows:
        return Plan(None, (), rows, n)
    block = _block(n)
    stride = int(logits.stride(0)) if logits.stride(1) == 1 else n  # the rows _rows_of reads
    return Plan(Step(kernel, (rows,), num_warps_for(block), BLOCK_V=block, **consts), (n, stride), rows, n)


def plan_fwd(logits: torch.Tensor, target: torch.Tensor, reduction: str, label_smoothing: float,
             dtype: torch.dtype | None = None) -> Plan:
    _check("cross_entropy_triton", logits, target, reduction, label_smoothing)
    if dtype not in (None, torch.float32, logits.dtype):
        raise ValueError(f"cross_entropy_triton: dtype must be None, torch.float32 or the logits' dtype "
                         f"({logits.dtype}), got {dtype}")
    reduce = None if reduction == "none" else Step(_ce_reduce, (1,), 4, BLOCK=REDUCE_BLOCK, MEAN=reduction == "mean",
                                                   SUM_ROWS=True)
    group = min(GROUP, _block(int(logits.shape[1])))
    return _plan(logits, _ce_fwd, GROUP=group, SMOOTH=label_smoothing > 0)._replace(reduce=reduce)


def plan_bwd(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, reduction: str,
             label_smoothing: float) -> Plan:
    op = "cross_entropy_bwd_triton"
    _check(op, logits, target, reduction, label_smoothing)
    rows = logits.shape[0]
    want = (rows,) if reduction == "none" else ()
    if grad.dtype not in (torch.float32, logits.dtype):
        raise TypeError(f"{op}: grad must be float32 or the logits' dtype ({logits.dtype}), got {grad.dtype}")
    if tuple(grad.shape) != want:
        raise ValueError(f"{op}: grad must have shape {list(want)} for reduction {reduction!r}, got {list(grad.shape)}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (rows,):
        raise ValueError(f"{op}: lse must be a float32 [N] = [{rows}] tensor, got {lse.dtype} {list(lse.shape)}")
    scale = None if reduction != "mean" else Step(_ce_reduce, (1,), 4, BLOCK=REDUCE_BLOCK, MEAN=True, SUM_ROWS=False)
    return _plan(logits, _ce_bwd)._replace(reduce=scale)


def _fwd(plan: Plan, direct: bool, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
         label_smoothing: float, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_targets(target, plan.n, ignore_index)
    loss = logits.new_empty((plan.rows,), dtype=torch.float32)
    lse = logits.new_empty((plan.rows,), dtype=torch.float32)
    tc = target.contiguous()
    if plan.step is not None:
        plan.step(direct, _rows_of(logits), tc, loss, lse, *plan.ints, ignore_index, label_smoothing)
    if plan.reduce is None:
        return loss.to(dtype or logits.dtype), lse
    out = logits.new_empty((), dtype=dtype or logits.dtype)
    plan.reduce(direct, loss, tc, out, plan.rows, ignore_index)
    return out, lse


def _bwd(plan: Plan, direct: bool, grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
         ignore_index: int, reduction: str, label_smoothing: float) -> torch.Tensor:
    dx = logits.new_empty((plan.rows, plan.n))
    if plan.step is None:
        return dx
    tc = target.contiguous()
    if plan.reduce is not None:  # 'mean': the output gradient over the count of rows not ignored, one launch
        scale = logits.new_empty((1,), dtype=torch.float32)
        plan.reduce(direct, grad, tc, scale, plan.rows, ignore_index)
    else:
        scale = grad.float().reshape(-1).contiguous()
    n, stride = plan.ints
    plan.step(direct, _rows_of(logits), tc, lse.contiguous(), scale, 1 if reduction == "none" else 0, dx, n, stride,
              ignore_index, label_smoothing)
    return dx


def cross_entropy_launch(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                         label_smoothing: float, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss in ``dtype``, else the logits' dtype; lse float32 [N]); the launcher as a plain function (the op below
    registers it)."""
    plan = plan_fwd(logits, target, reduction, label_smoothing, dtype)
    return _fwd(plan, False, logits, target, ignore_index, reduction, label_smoothing, dtype)


def cross_entropy_bwd_launch(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                             ignore_index: int, reduction: str, label_smoothing: float) -> torch.Tensor:
    """dlogits [N, V] (contiguous, the logits' dtype) from the saved lse, for the output gradient ``grad``."""
    plan = plan_bwd(grad, logits, target, lse, reduction, label_smoothing)
    return _bwd(plan, False, grad, logits, target, lse, ignore_index, reduction, label_smoothing)


cross_entropy_triton, cross_entropy_bwd_triton = register_ops(
    "cross_entropy", cross_entropy_launch, cross_entropy_bwd_launch)

_fwd_plans, _bwd_plans = Plans(plan_fwd), Plans(plan_bwd)


def cross_entropy_fast(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                       label_smoothing: float, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_launch for eager callers: the plan kept per key, the kernel launched directly."""
    key = (logits.shape, logits.stride(), logits.dtype, logits.get_device(), target.shape, target.dtype,
           target.get_device(), ignore_index, reduction, label_smoothing > 0, label_smoothing <= 1.0,
           label_smoothing >= 0.0, dtype)
    plan = _fwd_plans.get(key) or _fwd_plans.new(key, logits, target, reduction, label_smoothing, dtype)
    return _fwd(plan, True, logits, target, ignore_index, reduction, label_smoothing, dtype)


def cross_entropy_bwd_fast(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           ignore_index: int, reduction: str, label_smoothing: float) -> torch.Tensor:
    """cross_entropy_bwd_launch for eager callers."""
    key = (grad.shape, grad.dtype, logits.shape, logits.stride(), logits.dtype, logits.get_device(), target.shape,
           target.dtype, target.get_device(), lse.shape, lse.dtype, ignore_index, reduction, label_smoothing > 0,
           label_smoothing <= 1.0, label_smoothing >= 0.0)
    plan = _bwd_plans.get(key) or _bwd_plans.new(key, grad, logits, target, lse, reduction, label_smoothing)
    return _bwd(plan, True, grad, logits, target, lse, ignore_index, reduction, label_smoothing)
