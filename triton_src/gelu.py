"""gelu, Triton tier: y = gelu(x + bias) elementwise (bias over the last dim, optional), fp32 math, one
rounding; approximate "none" (erf) or "tanh". Backward: dx = dy * gelu'(x + bias); dbias = dx summed over
every dim but the last (a torch sum of the kernel's dx, accumulated in fp32).

Bytes: forward 1 read + 1 write per element (+ bias, cached). Backward: 2 reads (dy, x) + 1 write.
Limits: 64-bit offsets (tensors over 2^31 elements); non-contiguous inputs are made contiguous.
Versions: v1 — one BLOCK per program, masked tail. v2 — a bias length that is not a multiple of 16 is a
constant of the kernel (the bias loads were one scalar load per element: 57 us against compile's 42 at 65536x300 fp32
on an H200).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import check_float, check_same
from .launch import Plans, Step, param_key, register_ops

BLOCK = 4096
APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _tanh(u):
    return 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0  # exp overflows to inf for u << 0: the result is -1, as it should


@triton.jit
def _load_v(x_ptr, b_ptr, offs, mask, n_cols, HAS_B: tl.constexpr, COLS: tl.constexpr):
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        # COLS: the bias length as a constant where the launch's int specialization says nothing of it (not a
        # multiple of 16): a modulo by a constant is a multiply and shift, and its factors of two keep the bias
        # loads vector-wide; 0: n_cols at run time (a multiple of 16, or no bias).
        if COLS > 0:
            col = offs % COLS
        else:
            col = offs % n_cols
        v += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _gelu_fwd(x_ptr, b_ptr, y_ptr, numel, n_cols, HAS_B: tl.constexpr, TANH: tl.constexpr, COLS: tl.constexpr,
              BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = _load_v(x_ptr, b_ptr, offs, mask, n_cols, HAS_B, COLS)
    if TANH:
        y = 0.5 * v * (1.0 + _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    else:
        y = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    y = tl.where(v == -float("inf"), 0.0, y)  # the limit; the formula gives -inf * 0 = NaN
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(dy_ptr, x_ptr, b_ptr, dx_ptr, numel, n_cols, HAS_B: tl.constexpr, TANH: tl.constexpr,
              COLS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = _load_v(x_ptr, b_ptr, offs, mask, n_cols, HAS_B, COLS)
    if TANH:
        t = _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))
        d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * v * v)
    else:
        d = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476)) + v * 0.3989422804014327 * tl.exp(-0.5 * v * v)
    d = tl.where(v == float("inf"), 1.0, tl.where(v == -float("inf"), 0.0, d))  # the limits, not +-inf * 0
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (dy * d).to(dx_ptr.dtype.element_ty), mask=mask)


def _check(op: str, x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> int:
    check_float(op, "x", x)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias is not None:
        check_same(op, "bias", bias, x)
        if x.dim() == 0 or list(bias.shape) != [x.shape[-1]]:
            raise ValueError(f"{op}: bias must have shape [x.shape[-1]], got {list(bias.shape)} for x of shape "
                             f"{list(x.shape)}")
    return x.shape[-1] if x.dim() else 1


# One launch plan per direction (checks, kernel, grid, constexprs, int arguments) and one host function that launches
# from it: the registered ops (triton_op, wrap_triton) make the plan per call, the eager fast path (gelu_fast, the
# kept compiled kernel) once per (shapes, dtype, device, approximate).
class Plan(NamedTuple):
    step: Step | None  # None: x is empty
    ints: tuple
    n: int  # the last dim (bias length)


def plan(op: str, x: torch.Tensor, bias: torch.Tensor | None, approximate: str, dy: torch.Tensor | None) -> Plan:
    """The forward's plan, or with ``dy`` the backward's."""
    n = _check(op, x, bias, approximate)
    if dy is not None:
        check_same(op, "dy", dy, x)
        if dy.shape != x.shape:
            raise ValueError(f"{op}: dy must have the shape of x {list(x.shape)}, got {list(dy.shape)}")
    numel = x.numel()
    if not numel:
        return Plan(None, (), n)
    kernel = _gelu_fwd if dy is None else _gelu_bwd
    cols = int(n) if bias is not None and int(n) % 16 else 0
    return Plan(Step(kernel, (triton.cdiv(numel, BLOCK),), 8, HAS_B=bias is not None, TANH=approximate == "tanh",
                     COLS=cols, BLOCK=BLOCK), (numel, n), n)


def _fwd(plan: Plan, direct: bool, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if plan.step is not None:  # bias: a dummy pointer (x), never read when HAS_B is False
        plan.step(direct, xc, xc if bias is None else bias.contiguous(), y, *plan.ints)
    return y


def _bwd(plan: Plan, direct: bool, dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(xc)
    if plan.step is not None:
        plan.step(direct, dyc, xc, xc if bias is None else bias.contiguous(), dx, *plan.ints)
    if bias is None:
        return dx, x.new_empty((0,))
    return dx, dx.reshape(-1, plan.n).sum(0, dtype=torch.float32).to(x.dtype)


def gelu_launch(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    return _fwd(plan("gelu_triton", x, bias, approximate, None), False, x, bias)


def gelu_bwd_launch(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias); dbias is an empty tensor without bias."""
    return _bwd(plan("gelu_bwd_triton", x, bias, approximate, dy), False, dy, x, bias)


gelu_triton, gelu_bwd_triton = register_ops("gelu", gelu_launch, gelu_bwd_launch)

_plans = Plans(plan)


def gelu_fast(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """gelu_launch for eager callers: the plan kept per key, the kernel launched directly."""
    key = (x.shape, x.dtype, x.get_device(), param_key(bias), approximate)
    p = _plans.get(key) or _plans.new(key, "gelu_triton", x, bias, approximate, None)
    return _fwd(p, True, x, bias)


def gelu_bwd_fast(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_bwd_launch for eager callers."""
    key = (x.shape, x.dtype, x.get_device(), param_key(bias), approximate, dy.shape, dy.dtype, dy.get_device())
    p = _plans.get(key) or _plans.new(key, "gelu_bwd_triton", x, bias, approximate, dy)
    return _bwd(p, True, dy, x, bias)
