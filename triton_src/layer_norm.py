"""layer_norm, Triton tier: y = (x - mean) * rstd * w + b over the trailing dims, fp32 math; returns
(y, mean, rstd) with per-row fp32 statistics that the backward reuses.

Backward, with xhat = (x - mean) * rstd and g = dy * w: dx = rstd * (g - xhat * mean(g * xhat) - mean(g)),
dw = sum over rows of dy * xhat, db = sum over rows of dy.
Bytes: forward 1 read + 1 write of x for rows up to MAX_FUSED_FWD elements (two-pass variance in registers);
longer rows read x three times (mean, variance, normalize). Backward: read x, dy, write dx; with a weight
or bias, x and dy are read once more by the parameter-gradient kernel.
Few rows longer than MAX_FUSED (fewer rows than 4 programs per SM) are split over programs of SPLIT_BLOCK
elements: chunk mean and squared deviations per program, combined per row with Chan's formula (torch ops on
the small partials), then a normalize pass: x is read twice, y written once. The backward splits the same way
(sums of g * xhat and g per chunk, then dx): x and dy read twice, dx written once.
Limits: any row length. Non-contiguous x is made contiguous first.
Versions: v1 — fused rows kernel + looped kernel; backward rows/looped dx kernel + column dw/db kernel.
v2 — split rows for few giant rows (16 rows of 2^22: 161 GB/s fp32 fwd with one program per row on the H100).
v3 — the forward keeps rows up to 32768 in registers (32 warps; v2 looped from 16384: 4096x32768 read 3 times).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .common import MAX_FUSED_FWD, ParamGrads, check_norm, check_same, norm_param_grads, row_settings, target_programs
from .launch import bound, param_key

MAX_FUSED = 16384
SPLIT_BLOCK = 8192  # elements of one row per program when rows are split


@triton.jit
def _layer_norm_rows(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, eps, HAS_W: tl.constexpr,
                     HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(x, axis=1)
    mean = tl.math.div_rn(s, tl.zeros_like(s) + n_cols)  # IEEE division: mean of one element is that element
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rows < n_rows)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _layer_norm_looped(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, HAS_W: tl.constexpr,
                       HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        acc += tl.load(x_ptr + row * n_cols + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
    s = tl.sum(acc, axis=0)
    mean = tl.math.div_rn(s, tl.zeros_like(s) + n_cols)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean, 0.0)
        acc += xc * xc
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        y = (tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_bwd_rows(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, n_rows, n_cols, HAS_W: tl.constexpr,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    mean = tl.load(mean_ptr + rows, mask=rows < n_rows, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        g = g * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    s1 = tl.sum(g * xhat, axis=1)
    s2 = tl.sum(g, axis=1)
    dx = rstd[:, None] * (g - xhat * (s1 / n_cols)[:, None] - (s2 / n_cols)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_looped(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, n_cols, HAS_W: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        xhat = (tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
        g = tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        acc1 += tl.where(mask, g * xhat, 0.0)
        acc2 += g
    c1 = tl.sum(acc1, axis=0) / n_cols
    c2 = tl.sum(acc2, axis=0) / n_cols
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        xhat = (tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
        g = tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        dx = rstd * (g - xhat * c1 - c2)
        tl.store(dx_ptr + row * n_cols + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_split_stats(x_ptr, part_ptr, n_cols, n_splits, BLOCK_N: tl.constexpr):
    # One chunk of one row: its mean and the sum of squared deviations from that mean (combined per row with
    # Chan's formula: no cancellation of a sum of squares).
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    m = tl.sum(x, axis=0) / tl.minimum(n_cols - c * BLOCK_N, BLOCK_N)
    d = tl.where(mask, x - m, 0.0)
    base = (row * n_splits + c) * 2
    tl.store(part_ptr + base, m)
    tl.store(part_ptr + base + 1, tl.sum(d * d, axis=0))


@triton.jit
def _ln_split_apply(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, HAS_W: tl.constexpr,
                    HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_split_bwd(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, part_ptr, c_ptr, dx_ptr, n_cols, n_splits,
                  HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, APPLY: tl.constexpr):
    # APPLY=False: per-chunk sums of g * xhat and g (g = dy * w); APPLY=True: dx from the row's means of them.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    rstd = tl.load(rstd_ptr + row)
    xhat = tl.where(mask, (tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                           - tl.load(mean_ptr + row)) * rstd, 0.0)
    g = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        g = g * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if APPLY:
        dx = rstd * (g - xhat * tl.load(c_ptr + row * 2) - tl.load(c_ptr + row * 2 + 1))
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        base = (row * n_splits + c) * 2
        tl.store(part_ptr + base, tl.sum(g * xhat, axis=0))
        tl.store(part_ptr + base + 1, tl.sum(g, axis=0))


def _split_rows(rows: int, n: int, device: torch.device, fused: int = MAX_FUSED) -> bool:
    """Few rows longer than one fused block: split each row over programs so that every SM has work."""
    return n > fused and rows < target_programs(device)


def layer_norm_launch(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    n = check_norm("layer_norm_triton", x, normalized_shape, weight=weight, bias=bias)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // n if n else 0
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if xc.numel() == 0:
        return y, mean, rstd
    w = weight.contiguous() if weight is not None else xc  # dummy pointers, never read without HAS_W / HAS_B
    b = bias.contiguous() if bias is not None else xc
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None)
    block, per, warps = row_settings(n, MAX_FUSED_FWD)
    if _split_rows(rows, n, x.device, MAX_FUSED_FWD):
        splits = triton.cdiv(n, SPLIT_BLOCK)
        part = torch.empty((rows, splits, 2), dtype=torch.float32, device=x.device)
        wrap_triton(_ln_split_stats)[(rows, splits)](xc, part, n, splits, BLOCK_N=SPLIT_BLOCK, num_warps=16)
        cnt = torch.full((splits,), float(SPLIT_BLOCK), device=x.device)
        cnt[-1] = n - SPLIT_BLOCK * (splits - 1)
        mean.copy_((part[..., 0] * cnt).sum(1) / n)
        m2 = (part[..., 1] + cnt * (part[..., 0] - mean[:, None]) ** 2).sum(1)
        rstd.copy_(torch.rsqrt(m2 / n + eps))
        wrap_triton(_ln_split_apply)[(rows, splits)](xc, w, b, y, mean, rstd, n, **flags, BLOCK_N=SPLIT_BLOCK,
                                                     num_warps=16)
    elif n <= MAX_FUSED_FWD:
        wrap_triton(_layer_norm_rows)[(triton.cdiv(rows, per),)](xc, w, b, y, mean, rstd, rows, n, eps, **flags,
                                                                   BLOCK_N=block, ROWS=per, num_warps=warps)
    else:
        wrap_triton(_layer_norm_looped)[(rows,)](xc, w, b, y, mean, rstd, n, eps, **flags, BLOCK_N=4096,
                                                 num_warps=8)
    return y, mean, rstd


def layer_norm_bwd_launch(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int],
                          weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, has_bias: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of layer_norm from the saved statistics; dw / db are empty tensors without weight / bias."""
    n = check_norm("layer_norm_bwd_triton", x, normalized_shape, weight=weight)
    check_same("layer_norm_bwd_triton", "dy", dy, x)
    if dy.shape != x.shape:
        raise ValueError(f"layer_norm_bwd_triton: dy must have the shape of x {list(x.shape)}, got {list(dy.shape)}")
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(xc)
    rows = xc.numel() // n if n else 0
    def none() -> torch.Tensor:  # a fresh empty tensor per absent gradient (outputs may not alias)
        return x.new_empty((0,))

    if xc.numel() == 0:
        zeros = x.new_zeros(tuple(normalized_shape))
        return dx, (zeros if weight is not None else none()), (zeros.clone() if has_bias else none())
    has_w = weight is not None
    w = weight.contiguous() if has_w else xc
    block, per, warps = row_settings(n, MAX_FUSED)
    if n == 1:
        # y = b whatever x is, so dx is exactly 0. The kernel would leave ptxas's FMA contraction of
        # dy * w - sum(dy * w) (the product's rounding error) times rstd = 1 / sqrt(eps): seen on the H100.
        dx.zero_()
    elif _split_rows(rows, n, x.device):
        splits = triton.cdiv(n, SPLIT_BLOCK)
        part = torch.empty((rows, splits, 2), dtype=torch.float32, device=x.device)
        args = (dyc, xc, w, mean, rstd, part)
        wrap_triton(_ln_split_bwd)[(rows, splits)](*args, part, dx, n, splits, HAS_W=has_w, BLOCK_N=SPLIT_BLOCK,
                                                   APPLY=False, num_warps=16)
        c = (part.sum(1) / n).contiguous()  # (rows, 2): mean of g * xhat, mean of g
        wrap_triton(_ln_split_bwd)[(rows, splits)](*args[:5], part, c, dx, n, splits, HAS_W=has_w,
                                                   BLOCK_N=SPLIT_BLOCK, APPLY=True, num_warps=16)
    elif n <= MAX_FUSED:
        wrap_triton(_layer_norm_bwd_rows)[(triton.cdiv(rows, per),)](dyc, xc, w, mean, rstd, dx, rows, n, HAS_W=has_w,
                                                                       BLOCK_N=block, ROWS=per, num_warps=warps)
    else:
        wrap_triton(_layer_norm_bwd_looped)[(rows,)](dyc, xc, w, mean, rstd, dx, n, HAS_W=has_w, BLOCK_N=4096,
                                                     num_warps=8)
    if not (has_w or has_bias):
        return dx, none(), none()
    dw32, db32 = norm_param_grads(dyc.view(rows, n), xc.view(rows, n), mean, rstd, with_bias=has_bias)
    dw = dw32.view(normalized_shape).to(x.dtype) if has_w else none()
    db = db32.view(normalized_shape).to(x.dtype) if has_bias else none()
    return dx, dw, db


layer_norm_triton = triton_op("tiered_ops::layer_norm_triton", layer_norm_launch, mutates_args={})
layer_norm_bwd_triton = triton_op("tiered_ops::layer_norm_bwd_triton", layer_norm_bwd_launch, mutates_args={})


# The eager fast path: the launches of layer_norm_launch / layer_norm_bwd_launch through DirectKernel, the settings
# of each (shapes, dtype, device) worked out once. Only when not traced: torch.compile traces the ops above.
_fwd_plans: dict[tuple, tuple] = {}
_bwd_plans: dict[tuple, tuple] = {}


def _fwd_plan(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None
              ) -> tuple:
    """(kind, launch(es), int args, rows, n, scratch): kind 0 empty, 1 one kernel, 2 split rows (two kernels);
    scratch: (mean, rstd) the inference path writes and nobody reads (kind 1)."""
    n = check_norm("layer_norm_triton", x, normalized_shape, weight=weight, bias=bias)
    rows = x.numel() // n if n else 0
    if x.numel() == 0:
        return 0, None, (), rows, n, None
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None)
    block, per, warps = row_settings(n, MAX_FUSED_FWD)
    if _split_rows(rows, n, x.device, MAX_FUSED_FWD):
        splits = triton.cdiv(n, SPLIT_BLOCK)
        grid = (rows, splits, 1)
        launches = (bound(_ln_split_stats, grid, 16, BLOCK_N=SPLIT_BLOCK),
                    bound(_ln_split_apply, grid, 16, **flags, BLOCK_N=SPLIT_BLOCK))
        return 2, launches, (n, splits), rows, n, None
    scratch = (x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32))
    if n <= MAX_FUSED_FWD:
        return (1, bound(_layer_norm_rows, (triton.cdiv(rows, per), 1, 1), warps, **flags, BLOCK_N=block, ROWS=per),
                (rows, n), rows, n, scratch)
    return 1, bound(_layer_norm_looped, (rows, 1, 1), 8, **flags, BLOCK_N=4096), (n,), rows, n, scratch


def _fwd_plan_of(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                 bias: torch.Tensor | None) -> tuple:
    key = (x.shape, x.dtype, x.get_device(), tuple(normalized_shape), param_key(weight), param_key(bias))
    plan = _fwd_plans.get(key)
    if plan is None:
        plan = _fwd_plans[key] = _fwd_plan(x, normalized_shape, weight, bias)
    return plan


def layer_norm_fast(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                    bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layer_norm_launch, launched directly (the same kernels and settings)."""
    kind, launch, ints, rows, n, _ = _fwd_plan_of(x, normalized_shape, weight, bias)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    mean = x.new_empty(rows, dtype=torch.float32)
    rstd = x.new_empty(rows, dtype=torch.float32)
    if kind == 0:
        return y, mean, rstd
    w = weight.contiguous() if weight is not None else xc
    b = bias.contiguous() if bias is not None else xc
    if kind == 1:
        launch(xc, w, b, y, mean, rstd, *ints, eps)
        return y, mean, rstd
    splits = ints[1]
    part = x.new_empty((rows, splits, 2), dtype=torch.float32)
    launch[0](xc, part, n, splits)
    cnt = torch.full((splits,), float(SPLIT_BLOCK), device=x.device)
    cnt[-1] = n - SPLIT_BLOCK * (splits - 1)
    mean.copy_((part[..., 0] * cnt).sum(1) / n)
    m2 = (part[..., 1] + cnt * (part[..., 0] - mean[:, None]) ** 2).sum(1)
    rstd.copy_(torch.rsqrt(m2 / n + eps))
    launch[1](xc, w, b, y, mean, rstd, n)
    return y, mean, rstd


def layer_norm_infer_fast(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                          bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y of layer_norm_fast alone, for a caller that needs no gradient: the kernel's per-row statistics go to
    scratch buffers of the plan (written by every call, on any stream, read by none) instead of two new tensors."""
    plan = _fwd_plan_of(x, normalized_shape, weight, bias)
    if plan[0] != 1:
        return layer_norm_fast(x, normalized_shape, weight, bias, eps)[0]
    _, launch, ints, _, _, (mean, rstd) = plan
    xc = x.contiguous()
    y = torch.empty_like(xc)
    launch(xc, xc if weight is None else weight.contiguous(), xc if bias is None else bias.contiguous(), y, mean, rstd,
           *ints, eps)
    return y


def _bwd_plan(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
              has_bias: bool) -> tuple:
    """(kind, launch(es), int args, rows, n, parameter-gradient plan or None): kind 0 empty, 1 one kernel,
    2 split rows, 3 n == 1 (dx is 0)."""
    n = check_norm("layer_norm_bwd_triton", x, normalized_shape, weight=weight)
    check_same("layer_norm_bwd_triton", "dy", dy, x)
    if dy.shape != x.shape:
        raise ValueError(f"layer_norm_bwd_triton: dy must have the shape of x {list(x.shape)}, got {list(dy.shape)}")
    rows = x.numel() // n if n else 0
    if x.numel() == 0:
        return 0, None, (), rows, n, None
    has_w = weight is not None
    pg = ParamGrads(rows, n, x.device, has_mean=True, with_bias=has_bias) if has_w or has_bias else None
    block, per, warps = row_settings(n, MAX_FUSED)
    if n == 1:
        return 3, None, (), rows, n, pg
    if _split_rows(rows, n, x.device):
        splits = triton.cdiv(n, SPLIT_BLOCK)
        grid = (rows, splits, 1)
        launches = (bound(_ln_split_bwd, grid, 16, HAS_W=has_w, BLOCK_N=SPLIT_BLOCK, APPLY=False),
                    bound(_ln_split_bwd, grid, 16, HAS_W=has_w, BLOCK_N=SPLIT_BLOCK, APPLY=True))
        return 2, launches, (n, splits), rows, n, pg
    if n <= MAX_FUSED:
        return (1, bound(_layer_norm_bwd_rows, (triton.cdiv(rows, per), 1, 1), warps, HAS_W=has_w, BLOCK_N=block,
                         ROWS=per), (rows, n), rows, n, pg)
    return 1, bound(_layer_norm_bwd_looped, (rows, 1, 1), 8, HAS_W=has_w, BLOCK_N=4096), (n,), rows, n, pg


def layer_norm_bwd_fast(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                        mean: torch.Tensor, rstd: torch.Tensor, has_bias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layer_norm_bwd_launch, launched directly."""
    key = (x.shape, x.dtype, x.get_device(), tuple(normalized_shape), param_key(weight), has_bias, dy.shape,
           dy.dtype, dy.get_device(), mean.dtype, rstd.dtype)
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plans[key] = _bwd_plan(dy, x, normalized_shape, weight, has_bias)
    kind, launch, ints, rows, n, pg = plan
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(xc)
    if kind == 0:
        zeros = x.new_zeros(tuple(normalized_shape))
        return (dx, (zeros if weight is not None else x.new_empty((0,))),
                (zeros.clone() if has_bias else x.new_empty((0,))))
    w = weight.contiguous() if weight is not None else xc
    if kind == 1:
        launch(dyc, xc, w, mean, rstd, dx, *ints)
    elif kind == 3:
        dx.zero_()
    else:
        part = x.new_empty((rows, ints[1], 2), dtype=torch.float32)
        launch[0](dyc, xc, w, mean, rstd, part, part, dx, *ints)
        c = (part.sum(1) / n).contiguous()
        launch[1](dyc, xc, w, mean, rstd, part, c, dx, *ints)
    if pg is None:
        return dx, x.new_empty((0,)), x.new_empty((0,))
    dw32, db32 = pg(dyc, xc, mean, rstd)
    dw = dw32.view(normalized_shape).to(x.dtype) if weight is not None else x.new_empty((0,))
    db = db32.view(normalized_shape).to(x.dtype) if has_bias else x.new_empty((0,))
    return dx, dw, db
