"""gelu(x, bias=None, approximate="none"): torch.nn.functional.gelu(x + bias), fused.

bias (optional) has shape [x.shape[-1]], like a Linear layer's bias, and any floating dtype: ``x + bias`` promotes
as in torch (a bfloat16 bias on float32 x gives float32, a float32 bias on bfloat16 x too). approximate is "none"
(erf) or "tanh", as in F.gelu. The kernel tiers add the bias in fp32 (one rounding where eager rounds x + bias
first).
Bucket: (numel rounded up to a power of two, the last dim when there is a bias, bias?, approximate).
Bytes: read x + write y (+ bias once). Backward: read dy and x, write dx (+ dbias).
Autograd of the kernel ops: save x and bias; dx = dy * gelu'(x + bias) in the tier's backward kernel.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import call, floating, gen, randn, same_device, values

APPROXIMATIONS = ("none", "tanh")


def validate(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> None:
    """The contract of a call (every tier): x floating, bias None or a floating [x.shape[-1]] on x's device (any
    floating dtype: promoted), approximate "none" or "tanh"."""
    floating("gelu", "x", x)
    floating("gelu", "bias", bias, optional=True)
    if bias is not None:
        same_device("gelu", "bias", bias, x, "x")
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias is not None and (x.dim() == 0 or tuple(bias.shape) != (x.shape[-1],)):
        raise ValueError(f"gelu: bias must have shape [x.shape[-1]], got {list(bias.shape)} for x of shape "
                         f"{list(x.shape)}")


def reference(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """Eager tier and reference: F.gelu of x + bias."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def _problem(shape: tuple[int, ...], bias: bool = True, approximate: str = "none") -> Problem:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias and not shape:
        raise ValueError("gelu: a bias needs x with at least one dim")
    return make_problem(shape, bias=bool(bias), approximate=approximate)


def _problem_of(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> Problem:
    return _problem(tuple(x.shape), bias is not None, approximate)


def _numel(p: Problem) -> int:
    return math.prod(p.shape)


def _bucket(p: Problem) -> tuple:
    return pow2_ceil(_numel(p)), (p.shape[-1] if p.kw["bias"] else 0), p.kw["bias"], p.kw["approximate"]


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    x = (2 * randn(p.shape, torch.float32, device, g)).to(dtype)  # both tails of gelu, not just its middle
    b = randn(p.shape[-1:], dtype, device, g) if p.kw["bias"] else None
    return Inputs((x, b, p.kw["approximate"]))


def _bias_elems(p: Problem) -> int:
    return p.shape[-1] if p.kw["bias"] else 0


def _kernel_args(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> tuple:
    return x, bias, approximate


def _fake(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _bwd_fake(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    db = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias is not None else x.new_empty((0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), db


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, bias, ctx.approximate = inputs
    ctx.save_for_backward(x, bias)


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, bias = ctx.saved_tensors
        dx, db = bwd(grad, x, bias, ctx.approximate)
        return dx, (db if bias is not None else None), None

    return backward


BAD_INPUTS = (
    BadInput("bias of another length", call(values(4, 8), values(4), "none"), ValueError,
             r"gelu: bias must have shape"),
    BadInput("unknown approximation", call(values(4, 8), None, "sigmoid"), ValueError,
             r"gelu: approximate must be 'none' or 'tanh'"),
)

SPEC = register_op(OpSpec(
    name="gelu", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=lambda p, dt: (2 * _numel(p) + _bias_elems(p)) * dt.itemsize,
   
    bwd_bytes=lambda p, dt: (3 * _numel(p) + 2 * _bias_elems(p)) * dt.itemsize, grad_args=(0, 1),
    autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1,)),  # one element
        _problem((1823, 781)),  # a tail after every block size
        _problem((3, 1, 5)),  # size-1 dim
        _problem((100003,), bias=False),  # several blocks plus a tail, no bias
        _problem((64, 33), approximate="tanh"),  # the tanh approximation
        _problem((0, 4)),  # empty
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (65536, 256), (32, 4096), (1, 4096)] if dev == "cuda" else [(256, 1024), (4096, 1024)])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
    result_dtype=lambda x, bias=None, approximate="none": (
        x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)),
    bad_inputs=BAD_INPUTS, variants=({"approximate": "none"}, {"approximate": "tanh"}),
))

