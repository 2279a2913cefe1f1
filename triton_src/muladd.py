"""muladd, Triton tier: out = a * b + c elementwise, fp32 math, one rounding.

Bytes: 3 reads + 1 write per element; the floor too (no reuse).
Limits: 64-bit offsets (tensors over 2^31 elements); non-contiguous inputs are made contiguous.
Versions: v1 — one BLOCK per program, masked tail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .common import check_float

BLOCK = 4096


@triton.jit
def _muladd(a_ptr, b_ptr, c_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    c = tl.load(c_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (a * b + c).to(out_ptr.dtype.element_ty), mask=mask)


def muladd_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    for name, t in (("a", a), ("b", b), ("c", c)):
        check_float("muladd_triton", name, t)
    if not (a.shape == b.shape == c.shape):
        raise ValueError(f"muladd_triton: a, b and c must have the same shape, got {list(a.shape)}, "
                         f"{list(b.shape)}, {list(c.shape)}")
    if not (a.dtype == b.dtype == c.dtype) or not (a.device == b.device == c.device):
        raise TypeError(f"muladd_triton: a, b and c must share dtype and device, got {a.dtype}/{a.device}, "
                        f"{b.dtype}/{b.device}, {c.dtype}/{c.device}")
    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    if n:
        wrap_triton(_muladd)[(triton.cdiv(n, BLOCK),)](a, b, c, out, n, BLOCK=BLOCK, num_warps=8)
    return out


muladd_triton = triton_op("tiered_ops::muladd_triton", muladd_launch, mutates_args={})
