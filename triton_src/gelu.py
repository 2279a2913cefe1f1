"""gelu, Triton tier: y = gelu(x + bias) elementwise (bias over the last dim, optional), fp32 math, one
rounding; approximate "none" (erf) or "tanh". Backward: dx = dy * gelu'(x + bias); dbias = dx summed over
every dim but the last (a torch sum of the kernel's dx, accumulated in fp32).

Bytes: forward 1 read + 1 write per element (+ bias, cached). Backward: 2 reads (dy, x) + 1 write.
Limits: 64-bit offsets (tensors over 2^31 elements); non-contiguous inputs are made contiguous.
Versions: v1 — one BLOCK per program, masked tail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .common import check_float, check_same
from .launch import bound, param_key

BLOCK = 4096
APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _tanh(u):
    return 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0  # exp overflows to inf for u << 0: the result is -1, as it should


@triton.jit
def _load_v(x_ptr, b_ptr, offs, mask, n_cols, HAS_B: tl.constexpr):
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        v += tl.load(b_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _gelu_fwd(x_ptr, b_ptr, y_ptr, numel, n_cols, HAS_B: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = _load_v(x_ptr, b_ptr, offs, mask, n_cols, HAS_B)
    if TANH:
        y = 0.5 * v * (1.0 + _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    else:
        y = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    y = tl.where(v == -float("inf"), 0.0, y)  # the limit; the formula gives -inf * 0 = NaN
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(dy_ptr, x_ptr, b_ptr, dx_ptr, numel, n_cols, HAS_B: tl.constexpr, TANH: tl.constexpr,
              BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = _load_v(x_ptr, b_ptr, offs, mask, n_cols, HAS_B)
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


def gelu_launch(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    n = _check("gelu_triton", x, bias, approximate)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if xc.numel():
        b = bias.contiguous() if bias is not None else xc
        wrap_triton(_gelu_fwd)[(triton.cdiv(xc.numel(), BLOCK),)](
            xc, b, y, xc.numel(), n, HAS_B=bias is not None, TANH=approximate == "tanh", BLOCK=BLOCK, num_warps=8)
    return y


def gelu_bwd_launch(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias); dbias is an empty tensor without bias."""
    n = _check("gelu_bwd_triton", x, bias, approximate)
    check_same("gelu_bwd_triton", "dy", dy, x)
    if dy.shape != x.shape:
        raise ValueError(f"gelu_bwd_triton: dy must have the shape of x {list(x.shape)}, got {list(dy.shape)}")
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(xc)
    if xc.numel():
        b = bias.contiguous() if bias is not None else xc
        wrap_triton(_gelu_bwd)[(triton.cdiv(xc.numel(), BLOCK),)](
            dyc, xc, b, dx, xc.numel(), n, HAS_B=bias is not None, TANH=approximate == "tanh", BLOCK=BLOCK,
            num_warps=8)
    if bias is None:
        return dx, x.new_empty((0,))
    return dx, dx.reshape(-1, n).sum(0, dtype=torch.float32).to(x.dtype)


gelu_triton = triton_op("tiered_ops::gelu_triton", gelu_launch, mutates_args={})
gelu_bwd_triton = triton_op("tiered_ops::gelu_bwd_triton", gelu_bwd_launch, mutates_args={})


# The eager fast path: the launches of gelu_launch / gelu_bwd_launch through DirectKernel, the settings of each
# (shapes, dtype, device, approximate) worked out once. Only when not traced: torch.compile traces the ops above.
_plans: dict[tuple, tuple] = {}


def _plan(op: str, x: torch.Tensor, bias: torch.Tensor | None, approximate: str, dy: torch.Tensor | None) -> tuple:
    """(launch or None when x is empty, int args)."""
    n = _check(op, x, bias, approximate)
    if dy is not None:
        check_same(op, "dy", dy, x)
        if dy.shape != x.shape:
            raise ValueError(f"{op}: dy must have the shape of x {list(x.shape)}, got {list(dy.shape)}")
    numel = x.numel()
    if not numel:
        return None, ()
    kernel = _gelu_fwd if dy is None else _gelu_bwd
    return (bound(kernel, (triton.cdiv(numel, BLOCK), 1, 1), 8, HAS_B=bias is not None, TANH=approximate == "tanh",
                  BLOCK=BLOCK), (numel, n))


def gelu_fast(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """gelu_launch, launched directly (the same kernel and settings)."""
    key = (x.shape, x.dtype, x.get_device(), param_key(bias),
           approximate)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan("gelu_triton", x, bias, approximate, None)
    launch, ints = plan
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if launch is not None:
        launch(xc, xc if bias is None else bias.contiguous(), y, *ints)
    return y


def gelu_bwd_fast(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_bwd_launch, launched directly."""
    key = (x.shape, x.dtype, x.get_device(), param_key(bias),
           approximate, dy.shape, dy.dtype, dy.get_device())
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan("gelu_bwd_triton", x, bias, approximate, dy)
    launch, ints = plan
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(xc)
    if launch is not None:
        launch(dyc, xc, xc if bias is None else bias.contiguous(), dx, *ints)
    if bias is None:
        return dx, x.new_empty((0,))
    return dx, dx.reshape(-1, ints[1] if ints else bias.shape[0]).sum(0, dtype=torch.float32).to(x.dtype)
