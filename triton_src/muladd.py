"""muladd, Triton tier: out = a * b + c elementwise, fp32 math, one rounding. Backward: da = g * b,
db = g * a in one kernel; dc is g itself.

Bytes: 3 reads + 1 write per element; the floor too (no reuse). Backward: 3 reads (g, a, b) + 2 writes.
Limits: 64-bit offsets (tensors over 2^31 elements); non-contiguous inputs are made contiguous.
Versions: v1 — one BLOCK per program, masked tail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .common import check_float
from .launch import bound

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


def muladd_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    _check("muladd_triton", ("a", "b", "c"), a, b, c)
    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    if n:
        wrap_triton(_muladd)[(triton.cdiv(n, BLOCK),)](a, b, c, out, n, BLOCK=BLOCK, num_warps=8)
    return out


def muladd_bwd_launch(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) = (g * b, g * a)."""
    _check("muladd_bwd_triton", ("grad", "a", "b"), g, a, b)
    g, a, b = g.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        wrap_triton(_muladd_bwd)[(triton.cdiv(n, BLOCK),)](g, a, b, da, db, n, BLOCK=BLOCK, num_warps=8)
    return da, db


muladd_triton = triton_op("tiered_ops::muladd_triton", muladd_launch, mutates_args={})
muladd_bwd_triton = triton_op("tiered_ops::muladd_bwd_triton", muladd_bwd_launch, mutates_args={})


# The eager fast path: the launches of muladd_launch / muladd_bwd_launch through DirectKernel, the settings of each
# (shape, dtypes, device) worked out once. Only when not traced: torch.compile traces the ops above.
_plans: dict[tuple, tuple] = {}


def _plan(op: str, names: tuple[str, ...], kernel: object, *ts: torch.Tensor) -> tuple:
    _check(op, names, *ts)
    n = ts[0].numel()
    return (bound(kernel, (triton.cdiv(n, BLOCK), 1, 1), 8, BLOCK=BLOCK) if n else None), n


def muladd_fast(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """muladd_launch, launched directly (the same kernel and settings)."""
    key = (0, a.shape, b.shape, c.shape, a.dtype, b.dtype, c.dtype, a.get_device(), b.get_device(), c.get_device())
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan("muladd_triton", ("a", "b", "c"), _muladd, a, b, c)
    launch, n = plan
    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    out = torch.empty_like(a)
    if launch is not None:
        launch(a, b, c, out, n)
    return out


def muladd_bwd_fast(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """muladd_bwd_launch, launched directly."""
    key = (1, g.shape, a.shape, b.shape, g.dtype, a.dtype, b.dtype, g.get_device(), a.get_device(), b.get_device())
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan("muladd_bwd_triton", ("grad", "a", "b"), _muladd_bwd, g, a, b)
    launch, n = plan
    g, a, b = g.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    if launch is not None:
        launch(g, a, b, da, db, n)
    return da, db
