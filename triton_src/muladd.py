"""muladd, Triton tier: out = a * b + c elementwise, fp32 math, one rounding. Backward: da = g * b,
db = g * a in one kernel; dc is g itself.

Bytes: 3 reads + 1 write per element; the floor too (no reuse). Backward: 3 reads (g, a, b) + 2 writes.
Limits: 64-bit offsets (tensors over 2^31 elements); non-contiguous inputs are made contiguous.
Versions: v1 — one BLOCK per program, masked tail.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import check_float
from .launch import Plans, Step, register_ops

BLOCK = 4096


@triton.jit
def _muladd(a_ptr, b_ptr, c_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    c = tl.load(c_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (a * b + c).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _muladd_bwd(g_ptr, a_ptr, b_ptr, da_ptr, db_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    tl.store(da_ptr + offs, (g * b).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, (g * a).to(db_ptr.dtype.element_ty), mask=mask)


def _check(op: str, names: tuple[str, ...], *ts: torch.Tensor) -> None:
    for name, t in zip(names, ts):
        check_float(op, name, t)
    if any(t.shape != ts[0].shape for t in ts):
        raise ValueError(f"{op}: {', '.join(names)} must have the same shape, got "
                         f"{', '.join(str(list(t.shape)) for t in ts)}")
    if any(t.dtype != ts[0].dtype or t.device != ts[0].device for t in ts):
        raise TypeError(f"{op}: {', '.join(names)} must share dtype and device, got "
                        f"{', '.join(f'{t.dtype}/{t.device}' for t in ts)}")


# One launch plan per direction (checks, kernel, grid, constexpr, element count) and one host function that launches
# from it: the registered ops (triton_op, wrap_triton) make the plan per call, the eager fast path (muladd_fast, the
# kept compiled kernel) once per (shapes, dtypes, devices).
class Plan(NamedTuple):
    step: Step | None  # None: nothing to compute
    numel: int


def plan(op: str, names: tuple[str, ...], kernel: object, *ts: torch.Tensor) -> Plan:
    _check(op, names, *ts)
    n = ts[0].numel()
    return Plan(Step(kernel, (triton.cdiv(n, BLOCK),), 8, BLOCK=BLOCK) if n else None, n)


def _fwd(plan: Plan, direct: bool, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    out = torch.empty_like(a)
    if plan.step is not None:
        plan.step(direct, a, b, c, out, plan.numel)
    return out


def _bwd(plan: Plan, direct: bool, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    g, a, b = g.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    if plan.step is not None:
        plan.step(direct, g, a, b, da, db, plan.numel)
    return da, db


def muladd_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    return _fwd(plan("muladd_triton", ("a", "b", "c"), _muladd, a, b, c), False, a, b, c)


def muladd_bwd_launch(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) = (g * b, g * a)."""
    return _bwd(plan("muladd_bwd_triton", ("grad", "a", "b"), _muladd_bwd, g, a, b), False, g, a, b)


muladd_triton, muladd_bwd_triton = register_ops("muladd", muladd_launch, muladd_bwd_launch)

_plans = Plans(plan)


def muladd_fast(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """muladd_launch for eager callers: the plan kept per key, the kernel launched directly."""
    key = (0, a.shape, b.shape, c.shape, a.dtype, b.dtype, c.dtype, a.get_device(), b.get_device(), c.get_device())
    p = _plans.get(key) or _plans.new(key, "muladd_triton", ("a", "b", "c"), _muladd, a, b, c)
    return _fwd(p, True, a, b, c)


def muladd_bwd_fast(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """muladd_bwd_launch for eager callers."""
    key = (1, g.shape, a.shape, b.shape, g.dtype, a.dtype, b.dtype, g.get_device(), a.get_device(), b.get_device())
    p = _plans.get(key) or _plans.new(key, "muladd_bwd_triton", ("grad", "a", "b"), _muladd_bwd, g, a, b)
    return _bwd(p, True, g, a, b)
