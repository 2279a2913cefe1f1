"""fused_add_rms_norm(x, residual, normalized_shape, weight=None, eps=None) -> (y, new_residual).

The pre-norm residual step of a Llama-style block: new_residual = x + residual in x's dtype (rounded once, as torch's
``x + residual``), y = rms_norm(new_residual, normalized_shape, weight, eps) with torch.nn.functional.rms_norm
semantics (fp32 math; eps=None is torch's default, the compute dtype's eps: float32's for float32, bfloat16 and
float16 x). residual has x's shape and dtype; weight has shape normalized_shape and any floating dtype (another dtype
than x's is promoted as torch does: y and new_residual in x's dtype).
Bucket: (rows rounded up to a power of two, the normalized size n, whether there is a weight).
Bytes: read x and residual, write y and new_residual (+ weight once). Backward: read dy, d_new_residual and
new_residual, write dx (+ weight, + dw once); dresidual is dx (the same tensor, as eager autograd of the sum gives).
Autograd of the kernel ops: the kernels return (y, new_residual, rstd) with rstd = rsqrt(mean(new_residual^2) + eps)
per row in fp32 (non-differentiable); new_residual, weight and rstd are saved, so the backward reads 3 row tensors
and recomputes nothing: dx = d_new_residual + rstd * (g - s * rstd^2 * mean(g * s)) with g = dy * w and s =
new_residual, dw = sum over rows of dy * s * rstd.
Hugging Face forms (keyword-only, as rms_norm's: weight_offset, cast_before_weight) apply to y, computed from the
rounded sum s as those modules normalize ``residual + x``; y has promote(weight, x) under cast_before_weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..registry import BadInput, Inputs, OpSpec, Problem, register_op
from ._common import (
    call,
    check_eps,
    check_norm,
    floating,
    gen,
    norm_param,
    norm_shape,
    norm_split,
    randn,
    same_device,
    values,
)
from .rms_norm import (
    _bucket,  # the same bucket: (rows rounded up, normalized size, weight?)
    _eps,
    check_form,
    default_eps,
    form_params,
    form_problem,
    hf_norm,
    out_dtype,
)


def validate(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
             weight: torch.Tensor | None = None, eps: float | None = None, *, weight_offset: float = 0.0,
             cast_before_weight: bool = False) -> None:
    """The contract of a call (every tier): x floating, residual of x's shape, dtype and device (``x + residual``
    would broadcast or promote silently), normalized_shape x's trailing dims, weight of that shape on x's device
    (any floating dtype: torch promotes; x's or float32 in a Hugging Face form), eps a float or None."""
    ns = check_norm("fused_add_rms_norm", x, normalized_shape)
    floating("fused_add_rms_norm", "residual", residual)
    same_device("fused_add_rms_norm", "residual", residual, x, "x")
    if residual.dtype != x.dtype:
        raise TypeError(f"fused_add_rms_norm: residual must have the dtype of x ({x.dtype}), got {residual.dtype}")
    if residual.shape != x.shape:
        raise ValueError(f"fused_add_rms_norm: residual must have the shape of x {list(x.shape)}, "
                         f"got {list(residual.shape)}")
    norm_param("fused_add_rms_norm", "weight", weight, x, ns)
    check_eps("fused_add_rms_norm", eps, optional=True)
    if weight_offset or cast_before_weight:
        check_form(x, weight, weight_offset, cast_before_weight, "fused_add_rms_norm")


def takes_mixed(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
                weight: torch.Tensor | None = None, eps: float | None = None, *, weight_offset: float = 0.0,
                cast_before_weight: bool = False) -> bool:
    """A Hugging Face form's float32 weight over a bfloat16/float16 x is the form itself, not a promotion."""
    return bool(weight_offset or cast_before_weight)


def reference(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
              weight: torch.Tensor | None = None, eps: float | None = None, *, weight_offset: float = 0.0,
              cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager tier and reference: the sum, then torch's own rms_norm of it (fp32 math for low precision); the Hugging
    Face forms as their modules compute them."""
    new_residual = x + residual
    if not weight_offset and not cast_before_weight:
        return F.rms_norm(new_residual, norm_shape(normalized_shape), weight, eps), new_residual
    check_form(x, weight, weight_offset, cast_before_weight, "fused_add_rms_norm")
    k = len(norm_shape(normalized_shape))
    return hf_norm(new_residual, tuple(range(x.dim() - k, x.dim())), weight, _eps(x, eps), weight_offset,
                   cast_before_weight), new_residual


def _problem(shape: tuple[int, ...], normalized_shape: int | Sequence[int] | None = None, weight: bool = True,
             weight_offset: float = 0.0, cast_before_weight: bool = False) -> Problem:
    return form_problem("fused_add_rms_norm", shape, normalized_shape, weight, weight_offset, cast_before_weight)


def _problem_of(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
                weight: torch.Tensor | None = None, eps: float | None = None, *, weight_offset: float = 0.0,
                cast_before_weight: bool = False) -> Problem:
    return _problem(tuple(x.shape), normalized_shape, weight is not None, weight_offset, cast_before_weight)


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    ns = p.kw["normalized_shape"]
    x = randn(p.shape, dtype, device, g)
    residual = (2 * randn(p.shape, torch.float32, device, g)).to(dtype)  # another scale: the sum rounds
    w = (1 + 0.5 * randn(ns, torch.float32, device, g)).to(dtype) if p.kw["weight"] else None
    form = form_params(p.kw.get("weight_offset", 0.0), p.kw.get("cast_before_weight", False))
    return Inputs((x, residual, ns, w, torch.finfo(dtype).eps), form)  # eps of x's dtype, also for float64


def _bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (4 * rows * n + (n if p.kw["weight"] else 0)) * dt.itemsize


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (4 * rows * n + (2 * n if p.kw["weight"] else 0)) * dt.itemsize


def _kernel_args(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
                 weight: torch.Tensor | None = None, eps: float | None = None, *, weight_offset: float = 0.0,
                 cast_before_weight: bool = False) -> tuple:
    """The op's signature onto the kernel ops' schema (x, residual, int[] normalized_shape, weight?, float eps,
    float weight_offset, bool cast_before_weight)."""
    if weight_offset or cast_before_weight:
        check_form(x, weight, weight_offset, cast_before_weight, "fused_add_rms_norm")
    return (x, residual, list(norm_shape(normalized_shape)), weight,
            default_eps(x) if eps is None else float(eps), float(weight_offset), bool(cast_before_weight))


def _rows(x: torch.Tensor, normalized_shape: list[int]) -> Any:
    return math.prod(x.shape[: x.dim() - len(normalized_shape)])


def _fake(x: torch.Tensor, residual: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
          eps: float, weight_offset: float = 0.0, cast_before_weight: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(s, dtype=out_dtype(x, weight, cast_before_weight))
    return y, s, x.new_empty((_rows(x, normalized_shape),), dtype=torch.float32)


def _bwd_fake(dy: torch.Tensor, dres: torch.Tensor, new_residual: torch.Tensor, normalized_shape: list[int],
              weight: torch.Tensor | None, rstd: torch.Tensor, weight_offset: float = 0.0,
              cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else dy.new_empty((0,))
    return torch.empty_like(new_residual, memory_format=torch.contiguous_format), dw


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, _, ctx.normalized_shape, weight, _, *form = inputs
    ctx.form, ctx.y_dtype = tuple(form), output[0].dtype  # (weight_offset, cast_before_weight); dy's dtype
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(output[1], weight, output[2])


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, dy: torch.Tensor | None, dres: torch.Tensor | None, _drstd: Any) -> tuple:
        new_residual, weight, rstd = ctx.saved_tensors
        dy = torch.zeros_like(new_residual, dtype=ctx.y_dtype) if dy is None else dy
        dres = torch.zeros_like(new_residual) if dres is None else dres
        dx, dw = bwd(dy, dres, new_residual, ctx.normalized_shape, weight, rstd, *ctx.form)
        return dx, dx, None, (dw if weight is not None else None), None, *(None,) * len(ctx.form)

    return backward


BAD_INPUTS = (  # a residual that x + residual would broadcast or promote silently
    BadInput("residual that broadcasts", call(values(4, 8), values(1, 8), (8,), values(8)), ValueError,
             r"fused_add_rms_norm: residual must have the shape of x \[4, 8\], got \[1, 8\]"),
    BadInput("residual of a row", call(values(3, 4), values(4), (4,)), ValueError,
             r"residual must have the shape of x"),
    BadInput("residual of float16", call(values(4, 8), values(4, 8, dtype=torch.float16), (8,), values(8)), TypeError,
             r"fused_add_rms_norm: residual must have the dtype of x \(torch.float32\), got torch.float16"),
    BadInput("residual of float64", call(values(3, 4), values(3, 4, dtype=torch.float64), (4,)), TypeError,
             r"residual must have the dtype of x"),
    BadInput("weight of another shape", call(values(4, 8), values(4, 8), (8,), values(7)), ValueError,
             r"fused_add_rms_norm: weight must have shape"),
    BadInput("normalized_shape not x's", call(values(4, 8), values(4, 8), (7,), None), ValueError,
             r"fused_add_rms_norm: normalized_shape"),
    BadInput("normalized_shape too long", call(values(3, 4), values(3, 4), (5,)), ValueError,
             r"fused_add_rms_norm: normalized_shape"),
)

SPEC = register_op(OpSpec(
    name="fused_add_rms_norm", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes, outputs=("y", "new_residual"),
    bwd_bytes=_bwd_bytes, grad_args=(0, 1, 3), autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 4096)),  # 1 row (decode)
        _problem((4096, 1)),  # 1 column
        _problem((1823, 781)),  # no multiple of any block: scalar CUDA path, masked Triton tail
        _problem((2, 20003)),  # a row longer than the backward's register-resident rows: looped backward
        _problem((2, 40009)),  # longer than the forward's register-resident rows: looped forward
        _problem((4, 6, 33), normalized_shape=(6, 33)),  # normalized over two trailing dims
        _problem((5, 64), weight=False),  # no weight
        _problem((0, 16)),  # empty
        _problem((1823, 781), weight_offset=1.0),  # Gemma's form on the sum
        _problem((1823, 781), cast_before_weight=True),  # Llama's form on the sum
        _problem((2, 40009), cast_before_weight=True),  # Llama's form, looped kernels
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(1, 4096), (8, 4096), (64, 4096), (4096, 4096), (32768, 4096), (32768, 8192)] if dev == "cuda"
        else [(8, 1024), (256, 1024)])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, first_output=True,
    validate=validate, takes_mixed=takes_mixed, bad_inputs=BAD_INPUTS,
))
