"""layer_norm's split-row kernels (Triton tier): few rows longer than a fused block, each row over programs of
SPLIT_BLOCK elements so that every SM has work (layer_norm.py plans and launches them; its header has the bytes).
Forward: chunk mean and squared deviations per program, combined per row with Chan's formula, then a normalize pass.
Backward: the chunk sums of g * xhat and g, then dx with the dw/db partials of each chunk over a grid of row groups."""

import triton
import triton.language as tl

from .common import _dy_times_w

SPLIT_BLOCK = 8192  # elements of one row per program when rows are split


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
def _ln_split_bwd_sums(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, part_ptr, n_cols, n_splits, HAS_W: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # One chunk of one row: its sums of g * xhat and g (g = dy * w), two floats of the (rows, splits, 2) part.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    xhat = tl.where(mask, (tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                           - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row), 0.0)
    g = _dy_times_w(dy_ptr + row * n_cols, w_ptr, cols, mask, 0.0, HAS_W, False)
    base = (row * n_splits + c) * 2
    tl.store(part_ptr + base, tl.sum(g * xhat, axis=0))
    tl.store(part_ptr + base + 1, tl.sum(g, axis=0))


@triton.jit
def _ln_split_bwd_apply(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, part_ptr, dx_ptr, pw_ptr, pb_ptr, n_rows, n_cols,
                        n_splits, HAS_W: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLITS: tl.constexpr):
    # One chunk of the rows pid0, pid0 + programs0, ...: dx from each row's means of g * xhat and g (its chunks' sums,
    # added here), and the rows' sums of dy * xhat and dy for the chunk's columns as the program's partials rows.
    gi = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    chunks = tl.arange(0, SPLITS)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    acc_w = tl.zeros([BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_N], tl.float32)
    for r in range(gi, n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        part = part_ptr + (row * n_splits + chunks) * 2
        c1 = tl.sum(tl.load(part, mask=chunks < n_splits, other=0.0), axis=0) / n_cols
        c2 = tl.sum(tl.load(part + 1, mask=chunks < n_splits, other=0.0), axis=0) / n_cols
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(mask, (tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                               - tl.load(mean_ptr + row)) * rstd, 0.0)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        g = dy
        if HAS_W:
            g = dy * w
        tl.store(dx_ptr + row * n_cols + cols, (rstd * (g - xhat * c1 - c2)).to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            acc_w += dy * xhat
        if HAS_DB:
            acc_b += dy
    if HAS_W:
        tl.store(pw_ptr + gi.to(tl.int64) * n_cols + cols, acc_w, mask=mask)
    if HAS_DB:
        tl.store(pb_ptr + gi.to(tl.int64) * n_cols + cols, acc_b, mask=mask)
