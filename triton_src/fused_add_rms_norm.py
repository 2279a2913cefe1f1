"""fused_add_rms_norm, Triton tier: s = x + residual (rounded once to x's dtype), y = s * rsqrt(mean(s^2) + eps) * w
over the trailing dims, fp32 math; the kernels return (y, s, rstd) with rstd per row in fp32.

Backward, with r the saved rstd, g = dy * w and ds the gradient of s (d_new_residual):
dx = dresidual = ds + r * (g - s * r^2 * mean(g * s)), dw = sum over rows of dy * s * r.
Bytes: forward 2 reads + 2 writes of a row (+ w, cached; + 4 bytes of rstd a row) for rows up to MAX_FUSED_FWD
elements; longer rows loop twice (x and residual read twice). Backward: read dy, ds, s, write dx, for rows up to
MAX_FUSED_BWD: a persistent grid whose programs each sum their rows' dw in registers ((programs, n) fp32 partials,
reduced by a second launch into w's dtype, norm_grads.py), so dy and s are read once; longer rows read dy and s
twice (c per row first, then dx and dw by column block), on a persistent grid too: two launches either way.
Hugging Face forms: the flags of rms_norm's kernels (OFFSET: w + w_offset in fp32; CAST: y rounded to x's dtype before
the weight, y in promote(w, x)), applied to y of the rounded sum s, in the same launch.
Limits: any row length; non-contiguous inputs are made contiguous first.
Versions: v1 — fused rows kernel + looped kernel forward; persistent rows kernel + looped kernel backward.
v2 — the backward in two launches at every row length (v1 summed the partials with torch and cast them, and long rows
took a per-row dx kernel and the column dw kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _dy_times_w, _dy_x_rstd_tile, _rows_tile, check_float, check_same, row_settings
from .launch import Plans, Step, param_key, register_ops
from .norm_grads import MAX_FUSED_BWD, partials, persistent_programs, plan_grads, reduce_grads
from .rms_norm import (
    BwdPlan,
    FwdPlan,
    _apply_weight,
    _rstd,
    check_dy,
    check_form,
    fwd_plan,
    leading_rows,
)

OP = "fused_add_rms_norm_triton"
BWD = "fused_add_rms_norm_bwd_triton"


@triton.jit
def _fused_add_rms_norm_rows(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, n_rows, n_cols, eps, w_offset,
                             HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, OFFSET: tl.constexpr,
                             CAST: tl.constexpr):
    eps, w_offset = tl.cast(eps, tl.float32), tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs, mask = _rows_tile(rows, cols, n_rows, n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(s_ptr.dtype.element_ty)  # one rounding, as torch's x + residual
    tl.store(s_ptr + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = _rstd(tl.sum(sf * sf, axis=1), n_cols, eps, OFFSET or CAST)
    y = sf * rstd[:, None]
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        y = _apply_weight(y, w, w_offset, s_ptr.dtype.element_ty, OFFSET, CAST)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _fused_add_rms_norm_looped(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, n_cols, eps, w_offset,
                               HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, OFFSET: tl.constexpr, CAST: tl.constexpr):
    eps, w_offset = tl.cast(eps, tl.float32), tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + base + start + cols, s, mask=mask)
        sf = s.to(tl.float32)
        acc += sf * sf
    rstd = _rstd(tl.sum(acc, axis=0), n_cols, eps, OFFSET or CAST)
    for start in range(0, n_cols, BLOCK_N):
        # s again from x and residual (not read back from s_ptr: no barrier orders this program's own stores)
        mask = start + cols < n_cols
        x = tl.load(x_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x + r).to(s_ptr.dtype.element_ty).to(tl.float32) * rstd
        if HAS_W:
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = _apply_weight(y, w, w_offset, s_ptr.dtype.element_ty, OFFSET, CAST)
        tl.store(y_ptr + base + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _fused_add_rms_norm_bwd_rows(dy_ptr, ds_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, pw_ptr, n_rows, n_cols, w_offset,
                                 HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                                 OFFSET: tl.constexpr):
    w_offset = tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
    # A persistent program: the row tiles pid, pid + programs, ...; dx tile by tile, and with a weight its tiles' sum
    # of dy * s * r in registers, stored as the program's row of the (programs, n) fp32 dw partials.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if OFFSET:
            w = w + w_offset
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for t in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = t * ROWS + tl.arange(0, ROWS)
        offs, mask, dy, s, rstd = _dy_x_rstd_tile(dy_ptr, s_ptr, rstd_ptr, rows, cols, n_rows, n_cols)
        g = dy
        if HAS_W:
            g = dy * w[None, :]
        c = tl.sum(g * s, axis=1) * rstd * rstd / n_cols
        dx = rstd[:, None] * (g - s * c[:, None]) + tl.load(ds_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            acc += dy * s * rstd[:, None]
    if HAS_W:
        tl.store(pw_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=cmask)


@triton.jit
def _fused_add_rms_norm_bwd_looped(dy_ptr, ds_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, pw_ptr, c_ptr, n_rows, n_cols,
                                   w_offset, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, OFFSET: tl.constexpr):
    w_offset = tl.cast(w_offset, tl.float32)  # Inductor passes float arguments as fp64
    # A persistent program over the rows pid, pid + programs, ... longer than one block: first each row's
    # c = r^2 mean(g * s) (into c_ptr), then block of columns by block of columns, dx of every row and (with a weight)
    # the rows' sum of dy * s * r in registers, stored into the program's row of the partials.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    for row in range(pid, n_rows, n_prog):
        base = tl.cast(row, tl.int64) * n_cols
        rstd = tl.load(rstd_ptr + row)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = start + cols < n_cols
            g = _dy_times_w(dy_ptr + base, w_ptr, start + cols, mask, w_offset, HAS_W, OFFSET)
            acc += g * tl.load(s_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + row, tl.sum(acc, axis=0) * rstd * rstd / n_cols)
    tl.debug_barrier()  # every thread of the program sees the c it stored
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        if HAS_W:
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            if OFFSET:
                w = w + w_offset
        acc = tl.zeros([BLOCK_N], tl.float32)
        for row in range(pid, n_rows, n_prog):
            base = tl.cast(row, tl.int64) * n_cols
            rstd = tl.load(rstd_ptr + row)
            c = tl.load(c_ptr + row)
            dy = tl.load(dy_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(s_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
            g = dy
            if HAS_W:
                g = dy * w
            dx = rstd * (g - s * c) + tl.load(ds_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + base + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_W:
                acc += dy * s * rstd
        if HAS_W:
            tl.store(pw_ptr + pid.to(tl.int64) * n_cols + start + cols, acc, mask=mask)


def _check_like_rows(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """``t`` is a float tensor with the dtype, device and shape of ``like``."""
    check_float(op, name, t)
    check_same(op, name, t, like, like_name)
    if t.shape != like.shape:
        raise ValueError(f"{op}: {name} must have the shape of {like_name} {list(like.shape)}, got {list(t.shape)}")


# One launch plan per direction (rms_norm's FwdPlan and BwdPlan: checks, kernels, grids, constexprs, int arguments)
# and one host function that launches from it: the registered ops (triton_op, wrap_triton) make the plan per call,
# the eager fast path (fused_add_rms_norm_fast, the kept compiled kernels) once per (shapes, dtype, device).
def plan_fwd(x: torch.Tensor, residual: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
             weight_offset: float = 0.0, cast_before_weight: bool = False) -> FwdPlan:
    n = check_form(OP, x, normalized_shape, weight, weight_offset, cast_before_weight)
    _check_like_rows(OP, "residual", residual, x, "x")
    return fwd_plan(_fused_add_rms_norm_rows, _fused_add_rms_norm_looped, x, n, leading_rows(x, normalized_shape),
                    weight, weight_offset, cast_before_weight)


def plan_bwd(dy: torch.Tensor, dres: torch.Tensor, new_residual: torch.Tensor, normalized_shape: list[int],
             weight: torch.Tensor | None, rstd: torch.Tensor, weight_offset: float = 0.0,
             cast_before_weight: bool = False) -> BwdPlan:
    check_float(BWD, "new_residual", new_residual)
    n = check_form(BWD, new_residual, normalized_shape, weight, weight_offset, cast_before_weight)
    check_float(BWD, "dy", dy)
    check_dy(BWD, dy, new_residual, weight, cast_before_weight, "new_residual")
    _check_like_rows(BWD, "dres", dres, new_residual, "new_residual")
    rows = leading_rows(new_residual, normalized_shape)
    if rstd.dtype != torch.float32 or rstd.shape != (rows,) or rstd.device != new_residual.device:
        raise ValueError(f"{BWD}: rstd must be a float32 tensor of {rows} row statistics on {new_residual.device}, "
                         f"got {rstd.dtype} of shape {list(rstd.shape)} on {rstd.device}")
    if new_residual.numel() == 0:
        return BwdPlan(None, (), rows, None)
    has_w = weight is not None
    flags = dict(HAS_W=has_w, OFFSET=bool(weight_offset))
    if n <= MAX_FUSED_BWD:
        block, per, warps = row_settings(n, MAX_FUSED_BWD)
        programs = persistent_programs(triton.cdiv(rows, per), new_residual.device)
        step = Step(_fused_add_rms_norm_bwd_rows, (programs,), warps, **flags, BLOCK_N=block, ROWS=per)
        return BwdPlan(step, (rows, n), rows, plan_grads(programs, n, has_w, False))
    programs = persistent_programs(rows, new_residual.device)
    step = Step(_fused_add_rms_norm_bwd_looped, (programs,), 8, **flags, BLOCK_N=4096)
    return BwdPlan(step, (rows, n), rows, plan_grads(programs, n, has_w, False), 1)


def _fwd(plan: FwdPlan, direct: bool, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
         eps: float, weight_offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xc, rc = x.contiguous(), residual.contiguous()
    y, s = torch.empty_like(xc, dtype=plan.out), torch.empty_like(xc)
    rstd = x.new_empty(plan.rows, dtype=torch.float32)
    if plan.step is not None:  # weight: a dummy pointer (x), never read when HAS_W is False
        plan.step(direct, xc, rc, xc if weight is None else weight.contiguous(), y, s, rstd, *plan.ints, eps,
                  float(weight_offset))
    return y, s, rstd


def _bwd(plan: BwdPlan, direct: bool, dy: torch.Tensor, dres: torch.Tensor, new_residual: torch.Tensor,
         weight: torch.Tensor | None, rstd: torch.Tensor, weight_offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    sc, dyc, dsc = new_residual.contiguous(), dy.contiguous(), dres.contiguous()
    dx = torch.empty_like(sc)
    if plan.step is None:
        return dx, (torch.zeros_like(weight) if weight is not None else sc.new_empty((0,)))
    w = weight.contiguous() if weight is not None else sc  # dummy pointers (s), never used without HAS_W
    pw, _ = partials(plan.grads, sc)
    stats = (sc.new_empty(plan.rows * plan.stats, dtype=torch.float32),) if plan.stats else ()
    plan.step(direct, dyc, dsc, sc, w, rstd, dx, pw, *stats, *plan.ints, float(weight_offset))
    if plan.grads is None:
        return dx, sc.new_empty((0,))
    return dx, reduce_grads(plan.grads, direct, pw, pw, weight.shape, weight.dtype)[0]


def fused_add_rms_norm_launch(x: torch.Tensor, residual: torch.Tensor, normalized_shape: list[int],
                              weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                              cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, new_residual, rstd). The launcher as a plain function: the op below registers it; called bare it is the
    unregistered contrast."""
    plan = plan_fwd(x, residual, normalized_shape, weight, weight_offset, cast_before_weight)
    return _fwd(plan, False, x, residual, weight, eps, weight_offset)


def fused_add_rms_norm_bwd_launch(dy: torch.Tensor, dres: torch.Tensor, new_residual: torch.Tensor,
                                  normalized_shape: list[int], weight: torch.Tensor | None, rstd: torch.Tensor,
                                  weight_offset: float = 0.0, cast_before_weight: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw): dx is the gradient of x and of residual alike; dw is an empty tensor when there is no weight."""
    plan = plan_bwd(dy, dres, new_residual, normalized_shape, weight, rstd, weight_offset, cast_before_weight)
    return _bwd(plan, False, dy, dres, new_residual, weight, rstd, weight_offset)


fused_add_rms_norm_triton, fused_add_rms_norm_bwd_triton = register_ops(
    "fused_add_rms_norm", fused_add_rms_norm_launch, fused_add_rms_norm_bwd_launch)

_fwd_plans, _bwd_plans = Plans(plan_fwd), Plans(plan_bwd)


def fused_add_rms_norm_fast(x: torch.Tensor, residual: torch.Tensor, normalized_shape: list[int],
                            weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                            cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm_launch for eager callers: the plan kept per key, the kernels launched directly."""
    key = (x.shape, x.dtype, x.get_device(), residual.shape, residual.dtype, residual.get_device(),
           tuple(normalized_shape), param_key(weight), bool(weight_offset), bool(cast_before_weight))
    plan = _fwd_plans.get(key) or _fwd_plans.new(key, x, residual, normalized_shape, weight, weight_offset,
                                                 cast_before_weight)
    return _fwd(plan, True, x, residual, weight, eps, weight_offset)


def fused_add_rms_norm_bwd_fast(dy: torch.Tensor, dres: torch.Tensor, new_residual: torch.Tensor,
                                normalized_shape: list[int], weight: torch.Tensor | None, rstd: torch.Tensor,
                                weight_offset: float = 0.0, cast_before_weight: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm_bwd_launch for eager callers."""
    key = (new_residual.shape, new_residual.dtype, new_residual.get_device(), dy.shape, dy.dtype, dy.get_device(),
           dres.shape, dres.dtype, dres.get_device(), tuple(normalized_shape), param_key(weight), rstd.shape,
           rstd.dtype, rstd.get_device(), bool(weight_offset), bool(cast_before_weight))
    plan = _bwd_plans.get(key) or _bwd_plans.new(key, dy, dres, new_residual, normalized_shape, weight, rstd,
                                                 weight_offset, cast_before_weight)
    return _bwd(plan, True, dy, dres, new_residual, weight, rstd, weight_offset)
