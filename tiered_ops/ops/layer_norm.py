"""layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5): torch.nn.functional.layer_norm semantics.

y = (x - mean) / sqrt(var + eps) * weight + bias over the trailing normalized_shape dims (biased variance),
in x's dtype; weight and bias are optional, each of shape normalized_shape and of x's dtype, or float32 for a
bfloat16/float16 x (torch's mixed layer_norm: the math in float32, y in x's dtype); torch refuses any other mix, and
so does every tier here (a TypeError naming the parameter).
Bucket: (rows rounded up to a power of two, the normalized size n, weight?, bias?).
Bytes: read x + write y (+ weight, bias once). Backward: read x and dy, write dx (+ weight, dw, db once).
Autograd of the kernel ops: the kernels return (y, mean, rstd) with fp32 per-row statistics, saved for
the backward kernel with x and weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import (
    LOW_PRECISION,
    call,
    check_eps,
    check_norm,
    gen,
    norm_param,
    norm_shape,
    norm_split,
    randn,
    values,
)


def reference(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Eager tier and reference: torch's own layer_norm (computes in fp32 for low precision)."""
    return F.layer_norm(x, norm_shape(normalized_shape), weight, bias, eps)


def validate(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, eps: float = 1e-5) -> None:
    """The contract of a call (every tier): x floating, normalized_shape x's trailing dims, weight and bias of that
    shape on x's device, of x's dtype or (both) float32 for a bfloat16/float16 x; eps a float."""
    ns = check_norm("layer_norm", x, normalized_shape)
    norm_param("layer_norm", "weight", weight, x, ns)
    norm_param("layer_norm", "bias", bias, x, ns)
    params = [(n, t) for n, t in (("weight", weight), ("bias", bias)) if t is not None]
    mixed = x.dtype in LOW_PRECISION and all(t.dtype == torch.float32 for _, t in params)
    for name, t in params:
        if t.dtype != x.dtype and not mixed:
            raise TypeError(f"layer_norm: {name} must have x's dtype ({x.dtype}), or float32 like every parameter "
                            f"for a bfloat16/float16 x, got {t.dtype}"
                            + ("" if len(params) == 1 else f" (weight {weight.dtype}, bias {bias.dtype})"))
    check_eps("layer_norm", eps, optional=False)


def _problem(shape: tuple[int, ...], normalized_shape: int | Sequence[int] | None = None, weight: bool = True,
             bias: bool = True) -> Problem:
    ns = norm_shape(shape[-1:] if normalized_shape is None else normalized_shape, "layer_norm")
    if not 1 <= len(ns) <= len(shape) or tuple(shape[len(shape) - len(ns):]) != ns:
        raise ValueError(f"layer_norm: normalized_shape {list(ns)} must match the trailing dims of x, "
                         f"got x of shape {list(shape)}")
    return make_problem(shape, normalized_shape=ns, weight=bool(weight), bias=bool(bias))


def _problem_of(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, eps: float = 1e-5) -> Problem:
    return _problem(tuple(x.shape), normalized_shape, weight is not None, bias is not None)


def _bucket(p: Problem) -> tuple:
    rows, n = norm_split(p)
    return pow2_ceil(rows), n, p.kw["weight"], p.kw["bias"]


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    ns = p.kw["normalized_shape"]
    x = (1 + 2 * randn(p.shape, torch.float32, device, g)).to(dtype)  # a non-zero mean: the centring matters
    w = (1 + 0.5 * randn(ns, torch.float32, device, g)).to(dtype) if p.kw["weight"] else None
    b = (0.5 * randn(ns, torch.float32, device, g)).to(dtype) if p.kw["bias"] else None
    return Inputs((x, ns, w, b, 1e-5))


def _params(p: Problem) -> int:
    return p.kw["weight"] + p.kw["bias"]


def _bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (2 * rows * n + _params(p) * n) * dt.itemsize


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (3 * rows * n + (n if p.kw["weight"] else 0) + _params(p) * n) * dt.itemsize


def _kernel_args(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple:
    """F.layer_norm's signature onto the kernel ops' schema (x, int[] normalized_shape, weight?, bias?, eps)."""
    return x, list(norm_shape(normalized_shape)), weight, bias, float(eps)


def _rows(x: torch.Tensor, normalized_shape: list[int]) -> Any:
    return math.prod(x.shape[: x.dim() - len(normalized_shape)])


def _fake(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None,
          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = _rows(x, normalized_shape)
    stat = x.new_empty((rows,), dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stat, stat.clone()


def _bwd_fake(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
              mean: torch.Tensor, rstd: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, ...]:
    param = x.new_empty(tuple(normalized_shape))
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            param if weight is not None else x.new_empty((0,)), param.clone() if has_bias else x.new_empty((0,)))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, ctx.normalized_shape, weight, bias, _ = inputs
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(x, weight, output[1], output[2])


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor, _gmean: Any, _grstd: Any) -> tuple:
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = bwd(grad, x, ctx.normalized_shape, weight, mean, rstd, ctx.has_bias)
        return dx, None, (dw if weight is not None else None), (db if ctx.has_bias else None), None

    return backward


BAD_INPUTS = (
    BadInput("weight of a lower precision", call(values(4, 8), (8,), values(8, dtype=torch.float16), None), TypeError,
             r"layer_norm: weight must have x's dtype"),
    BadInput("bias of another shape", call(values(4, 8), (8,), None, values(7)), ValueError,
             r"layer_norm: bias must have shape"),
    BadInput("normalized_shape not x's", call(values(4, 8), (7,), None, None), ValueError,
             r"layer_norm: normalized_shape"),
    BadInput("normalized_shape too long", call(values(3, 4), (5,)), ValueError, r"layer_norm: normalized_shape"),
)

SPEC = register_op(OpSpec(
    name="layer_norm", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes,
    bwd_bytes=_bwd_bytes, grad_args=(0, 2, 3), autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 4096)),  # 1 row
        _problem((4096, 1)),  # 1 column: y = bias, dx = 0
        _problem((1823, 781)),  # no multiple of any block
        _problem((2, 20003)),  # rows longer than one block: Triton's backward splits few rows, CUDA loops
        _problem((2, 40009)),  # longer than the forward's register-resident rows: Triton splits few rows
        _problem((4, 6, 33), normalized_shape=(6, 33)),  # normalized over two trailing dims
        _problem((5, 64), weight=False, bias=False),  # no affine parameters
        _problem((5, 64), bias=False),  # weight only
        _problem((0, 16)),  # empty
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (4096, 32768), (65536, 256), (32, 4096), (1, 4096), (12, 250000)] if dev == "cuda"
        else [(256, 1024), (8, 65536)])] + ([_problem((16, 64, 256, 256), normalized_shape=(64, 256, 256))]
                                              if dev == "cuda" else []),
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, first_output=True,
    validate=validate, bad_inputs=BAD_INPUTS,
))

