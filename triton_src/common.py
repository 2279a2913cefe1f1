"""Launch helpers shared by the Triton kernels (block sizes, warps, input checks) and the weight/bias gradient
kernel both normalizations use."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import Step

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> str | None:
    """Why the Triton tier cannot run on ``device``, or None."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreted():
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU interpreter)"


def timeable(device: torch.device) -> str | None:
    if device.type == "cuda" and not interpreted():
        return None
    return "the Triton interpreter is for correctness, not speed"


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOATS:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.device.type != "cuda" and not interpreted():
        raise ValueError(f"{op}: {name} must be a CUDA tensor (or TRITON_INTERPRET=1 on the CPU), got {t.device}")


# Longest row a forward program keeps in registers: 32 fp32 values per thread at 32 warps (1024 threads, so at
# most 64 registers each). The backward keeps two rows (x or y, and dy): it stays at 16384.
MAX_FUSED_FWD = 32768


def num_warps_for(block: int) -> int:
    """Warps per program for a block of `block` elements: about 8-16 elements per thread up to 16384, then
    32 warps (32 per thread at 32768)."""
    return max(1, min(16, block // 512)) if block <= 16384 else 32


def row_settings(n: int, max_fused: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows of n elements: short rows pack several rows in one program."""
    block = triton.next_power_of_2(max(n, 1))
    if block > max_fused:
        block = max_fused
    rows = max(1, min(16, 2048 // block))
    return block, rows, num_warps_for(block * rows)


def target_programs(device: torch.device) -> int:
    """Programs that fill the device a few times over (4 per SM); a handful on the CPU interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def check_same(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str = "x") -> None:
    """``t`` has the dtype and device of ``like`` (an error naming both arguments otherwise)."""
    if t.dtype != like.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of {like_name} ({like.dtype}), got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{op}: {name} must be on {like.device} like {like_name}, got {t.device}")


def check_norm(op: str, x: torch.Tensor, normalized_shape: list[int], **params: torch.Tensor | None) -> int:
    """Validate a normalization's x, normalized_shape and affine parameters (weight=..., bias=...); the
    normalized size n."""
    check_float(op, "x", x)
    k = len(normalized_shape)
    if not 1 <= k <= x.dim() or list(x.shape[x.dim() - k:]) != list(normalized_shape):
        raise ValueError(f"{op}: normalized_shape {list(normalized_shape)} must match the trailing "
                         f"dims of x, got x of shape {list(x.shape)}")
    for name, t in params.items():
        if t is not None:
            check_same(op, name, t, x)
            if list(t.shape) != list(normalized_shape):
                raise ValueError(f"{op}: {name} must have shape {list(normalized_shape)}, got {list(t.shape)}")
    n = 1
    for d in normalized_shape:
        n *= d
    return n


@triton.jit
def _rows_tile(rows, cols, n_rows, n_cols):
    # A (rows, cols) tile of contiguous (n_rows, n_cols) rows: its element offsets (int64) and mask
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return offs, mask


@triton.jit
def _dy_x_rstd_tile(dy_ptr, x_ptr, rstd_ptr, rows, cols, r_end, n_cols):
    # dy and x (fp32) of the rows below r_end of a (rows, cols) tile, the rows' rstd; the tile's offsets and mask
    offs, mask = _rows_tile(rows, cols, r_end, n_cols)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows < r_end, other=0.0)
    return offs, mask, dy, x, rstd


@triton.jit
def _dy_times_w(dy_row, w_ptr, idx, mask, w_offset, HAS_W: tl.constexpr, OFFSET: tl.constexpr):
    # dy[idx] in fp32, times w[idx] in fp32 (plus w_offset with OFFSET) where there is a weight
    g = tl.load(dy_row + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if OFFSET:
            w = w + w_offset
        g = g * w
    return g


@triton.jit
def _online_lse_step(m, s, x):
    # One block of a row into per-lane running (max m, sum s of exp(x - m)); the new (m, s)
    m_new = tl.maximum(m, x)
    keep = m_new != -float("inf")  # lanes that saw only -inf add nothing (avoids -inf - -inf)
    shift = tl.where(keep, m_new, 0.0)  # the lanes not kept compute nothing invalid either
    s = tl.where(keep, s * tl.exp(m - shift) + tl.exp(x - shift), s)
    return m_new, s


@triton.jit
def _norm_param_grads(dy_ptr, x_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols, rows_per,
                      HAS_MEAN: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # Partial sums over one group of rows, for one block of columns: dw += dy * xhat, db += dy, with
    # xhat = (x - mean) * rstd (mean 0 for rms_norm). Bytes: dy and x read once more; partials (G, n) in fp32.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    g = tl.program_id(1)
    r_start = g * rows_per
    r_end = tl.minimum(r_start + rows_per, n_rows)
    acc_w = tl.zeros([BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        _, _, dy, x, rstd = _dy_x_rstd_tile(dy_ptr, x_ptr, rstd_ptr, rows, cols, r_end, n_cols)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + rows, mask=rows < r_end, other=0.0)[:, None]
        acc_w += tl.sum(dy * x * rstd[:, None], axis=0)
        if HAS_B:
            acc_b += tl.sum(dy, axis=0)
    tl.store(dw_ptr + g * n_cols + cols, acc_w, mask=cmask)
    if HAS_B:
        tl.store(db_ptr + g * n_cols + cols, acc_b, mask=cmask)


class ParamGradsPlan(NamedTuple):
    """The launch of the weight/bias gradient kernel for (rows, n) rows: its step, the partials' shape (groups, n),
    its int arguments, and whether there is one group (its partial sums are the sums)."""

    step: Step
    shape: tuple
    ints: tuple
    with_bias: bool
    one: bool


def plan_param_grads(rows: int, n: int, device: torch.device, has_mean: bool, with_bias: bool) -> ParamGradsPlan:
    block_n = min(128, triton.next_power_of_2(max(n, 1)))
    col_blocks = triton.cdiv(n, block_n)
    groups = max(1, min(rows, triton.cdiv(target_programs(device), col_blocks)))
    rows_per = triton.cdiv(rows, groups)
    groups = triton.cdiv(rows, rows_per)
    step = Step(_norm_param_grads, (col_blocks, groups), 4, HAS_MEAN=has_mean, HAS_B=with_bias, BLOCK_N=block_n,
                BLOCK_R=32)
    return ParamGradsPlan(step, (groups, n), (rows, n, rows_per), with_bias, groups == 1)


def norm_param_grads(plan: ParamGradsPlan, direct: bool, dy: torch.Tensor, x: torch.Tensor,
                     mean: torch.Tensor | None, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dw, db) in fp32 for contiguous dy and x of (rows, n) elements and per-row fp32 mean/rstd: partial sums per
    group of rows in a kernel, then one sum over the groups, each of n elements in a shape to view as the parameter's.
    On the eager fast path (``direct``) one group's partial sums are the sums (no reduction kernel)."""
    dw = dy.new_empty(plan.shape, dtype=torch.float32)
    db = dy.new_empty(plan.shape, dtype=torch.float32) if plan.with_bias else dw
    plan.step(direct, dy, x, rstd if mean is None else mean, rstd, dw, db, *plan.ints)
    if direct and plan.one:
        return dw, (db if plan.with_bias else None)
    return dw.sum(0), (db.sum(0) if plan.with_bias else None)
