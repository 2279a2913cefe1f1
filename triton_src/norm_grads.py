"""The weight/bias gradients of the normalizations' backward (rms_norm, layer_norm, fused_add_rms_norm), in two
launches with the dx pass: the dx kernel runs on a persistent grid (about PROGRAMS_PER_SM programs per SM, each
looping over its rows) and each program writes its rows' fp32 sums of dy * xhat (and dy) as one row of (programs, n)
partials; :func:`_reduce_partials` then sums the partials over programs in fp32 and writes dw (and db) in the
parameter's dtype. Bytes: the partials, programs * n * 4 written once and read once (dy and x are not read again)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import sm_count
from .launch import Step

# Longest row a backward rows kernel keeps in registers: x (or s), dy, w and the dw accumulator are live together.
# Longer rows take the looped kernels (statistics first, then dx block by block of columns).
MAX_FUSED_BWD = 8192
PROGRAMS_PER_SM = 2  # programs of a persistent dx grid per SM: the partials stay small, two programs hide latency
REDUCE_BLOCK_N = 32  # columns per reducing program (one 128-byte line of fp32 a partials row)
REDUCE_BLOCK_G = 64  # partials rows summed per step of a reducing program


def persistent_programs(tiles: int, device: torch.device) -> int:
    """Programs of a persistent grid over ``tiles`` units of work (row tiles or rows): PROGRAMS_PER_SM per SM, never
    more than the tiles (at least 1)."""
    return max(1, min(tiles, PROGRAMS_PER_SM * sm_count(device)))


@triton.jit
def _reduce_partials(pw_ptr, pb_ptr, dw_ptr, db_ptr, n_groups, n_cols, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    # dw[j] = sum over g of pw[g, j] (db from pb alike) for one block of columns, fp32, stored in dw's dtype.
    # Bytes: the (n_groups, n) fp32 partials read once, n parameter values written.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    acc_w = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    for g0 in range(0, n_groups, BLOCK_G):
        gs = g0 + tl.arange(0, BLOCK_G)
        offs = gs[:, None].to(tl.int64) * n_cols + cols[None, :]
        mask = (gs[:, None] < n_groups) & cmask[None, :]
        if HAS_W:
            acc_w += tl.load(pw_ptr + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(pb_ptr + offs, mask=mask, other=0.0)
    if HAS_W:
        tl.store(dw_ptr + cols, tl.sum(acc_w, axis=0).to(dw_ptr.dtype.element_ty), mask=cmask)
    if HAS_B:
        tl.store(db_ptr + cols, tl.sum(acc_b, axis=0).to(db_ptr.dtype.element_ty), mask=cmask)


class GradsPlan(NamedTuple):
    """The reduction of a backward's (groups, n) fp32 partials into the parameter gradients: its step, the partials'
    shape, and which gradients there are (dw, db)."""

    step: Step
    shape: tuple[int, int]
    with_w: bool
    with_b: bool


def plan_grads(groups: int, n: int, with_w: bool, with_b: bool) -> GradsPlan | None:
    """The reducing launch of (groups, n) partials, or None when there is no parameter gradient."""
    if not (with_w or with_b):
        return None
    block_g = min(REDUCE_BLOCK_G, triton.next_power_of_2(max(groups, 1)))
    step = Step(_reduce_partials, (triton.cdiv(n, REDUCE_BLOCK_N),), 4, HAS_W=with_w, HAS_B=with_b, BLOCK_G=block_g,
                BLOCK_N=REDUCE_BLOCK_N)
    return GradsPlan(step, (groups, n), with_w, with_b)


def partials(plan: GradsPlan | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 (groups, n) partials buffers (pw, pb) on like's device for the dx kernel to write; ``like`` itself
    stands for an absent one (a dummy pointer, never written: its flag is off)."""
    if plan is None:
        return like, like
    pw = like.new_empty(plan.shape, dtype=torch.float32) if plan.with_w else like
    pb = like.new_empty(plan.shape, dtype=torch.float32) if plan.with_b else like
    return pw, pb


def reduce_grads(plan: GradsPlan, direct: bool, pw: torch.Tensor, pb: torch.Tensor, shape: list[int] | tuple,
                 dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dw, db) of ``shape`` and ``dtype`` (None where there is none), the partials summed by one launch."""
    dw = pw.new_empty(tuple(shape), dtype=dtype) if plan.with_w else None
    db = pb.new_empty(tuple(shape), dtype=dtype) if plan.with_b else None
    first = dw if dw is not None else db
    plan.step(direct, pw, pb, first if dw is None else dw, first if db is None else db, plan.shape[0], plan.shape[1])
    return dw, db
