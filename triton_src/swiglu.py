"""swiglu, Triton tier: out = act(gate) * up elementwise, act silu, gelu (tanh) or gelu (erf); fp32 math, one
rounding. Backward, in one kernel recomputing the activation from gate: dgate = dy * up * act'(gate),
dup = dy * act(gate).

Bytes: forward 2 reads + 1 write per element; backward 3 reads (dy, gate, up) + 2 writes.
Limits: 64-bit offsets (tensors over 2^31 elements); non-contiguous inputs are made contiguous.
Special values: act at +-inf is its limit (silu, gelu: +inf -> +inf, -inf -> 0), act' too (1 at +inf, 0 at -inf).
Versions: v1 — one BLOCK per program, masked tail.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import check_float, check_same
from .launch import Step, register_ops

BLOCK = 4096
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_ACT = {a: i for i, a in enumerate(ACTIVATIONS)}  # the kernels' ACT constexpr


@triton.jit
def _act_and_grad(v, ACT: tl.constexpr):
    # (act(v), act'(v)) in fp32, at +-inf their limits
    if ACT == 0:  # silu: v * s, s = sigmoid(v); silu' = s (1 + v (1 - s))
        s = 1.0 / (1.0 + tl.exp(-v))
        a = v * s
        d = s * (1.0 + v * (1.0 - s))
    elif ACT == 1:  # gelu, tanh form
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0  # exp overflows to inf for u << 0: t = -1, as it should
        a = 0.5 * v * (1.0 + t)
        d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * v * v)
    else:  # gelu, erf form
        a = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
        d = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476)) + v * 0.3989422804014327 * tl.exp(-0.5 * v * v)
    a = tl.where(v == -float("inf"), 0.0, a)  # the formulas give -inf * 0 = NaN
    d = tl.where(v == float("inf"), 1.0, tl.where(v == -float("inf"), 0.0, d))
    return a, d


@triton.jit
def _swiglu_fwd(gate_ptr, up_ptr, out_ptr, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)  # the unused derivative is dead code to the compiler
    tl.store(out_ptr + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a, d = _act_and_grad(g, ACT)
    tl.store(dgate_ptr + offs, (dy * u * d).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dy * a).to(dup_ptr.dtype.element_ty), mask=mask)


def _check(op: str, gate: torch.Tensor, up: torch.Tensor, activation: str, dy: torch.Tensor | None) -> None:
    check_float(op, "gate", gate)
    check_float(op, "up", up)
    check_same(op, "up", up, gate, "gate")
    if up.shape != gate.shape:
        raise ValueError(f"{op}: gate and up must have the same shape (no broadcasting), got {list(gate.shape)} and "
                         f"{list(up.shape)}")
    if activation not in _ACT:
        raise ValueError(f"{op}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    if dy is not None:
        check_same(op, "dy", dy, gate, "gate")
        if dy.shape != gate.shape:
            raise ValueError(f"{op}: dy must have the shape of gate {list(gate.shape)}, got {list(dy.shape)}")


class Plan(NamedTuple):
    step: Step | None  # None: nothing to compute
    numel: int


def plan(op: str, gate: torch.Tensor, up: torch.Tensor, activation: str, dy: torch.Tensor | None) -> Plan:
    """The forward's plan, or with ``dy`` the backward's."""
    _check(op, gate, up, activation, dy)
    n = gate.numel()
    kernel = _swiglu_fwd if dy is None else _swiglu_bwd
    return Plan(Step(kernel, (triton.cdiv(n, BLOCK),), 8, ACT=_ACT[activation], BLOCK=BLOCK) if n else None, n)


def swiglu_launch(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    p = plan("swiglu_triton", gate, up, activation, None)
    gc, uc = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gc)
    if p.step is not None:
        p.step(False, gc, uc, out, p.numel)
    return out


def swiglu_bwd_launch(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) = (dy * up * act'(gate), dy * act(gate))."""
    p = plan("swiglu_bwd_triton", gate, up, activation, dy)
    dyc, gc, uc = dy.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gc), torch.empty_like(uc)
    if p.step is not None:
        p.step(False, dyc, gc, uc, dgate, dup, p.numel)
    return dgate, dup


swiglu_triton, swiglu_bwd_triton = register_ops("swiglu", swiglu_launch, swiglu_bwd_launch)
