"""rms_norm(x, normalized_shape, weight=None, eps=None): torch.nn.functional.rms_norm semantics.

y = x * rsqrt(mean(x^2 over the trailing normalized_shape dims) + eps) * weight, in x's dtype;
eps=None means torch's default: the eps of the compute dtype (torch.finfo(torch.float32).eps for float32, bfloat16
and float16 x, float64's for float64). weight has shape normalized_shape and any floating dtype: another dtype than
x's is promoted as torch does (the math in the wider dtype, y in x's dtype).
Bucket: (rows rounded up to a power of two, the normalized size n, whether there is a weight).
Bytes: read x + write y (+ weight once). Backward: read x and dy, write dx (+ weight, + dw once).
Autograd of the kernel ops: save x and weight; the backward kernel recomputes rsqrt(mean(x^2) + eps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..registry import Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import check_eps, check_norm, gen, norm_param, norm_shape, norm_split, randn


def reference(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    """Eager tier and reference: torch's own rms_norm (computes in fp32 for low precision)."""
    return F.rms_norm(x, norm_shape(normalized_shape), weight, eps)


def validate(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> None:
    """The contract of a call (every tier): x floating, normalized_shape x's trailing dims, weight of that shape on
    x's device (any floating dtype: torch promotes), eps a float or None."""
    ns = check_norm("rms_norm", x, normalized_shape)
    norm_param("rms_norm", "weight", weight, x, ns)
    check_eps("rms_norm", eps, optional=True)


def _problem(shape: tuple[int, ...], normalized_shape: int | Sequence[int] | None = None, weight: bool = True
             ) -> Problem:
    ns = norm_shape(shape[-1:] if normalized_shape is None else normalized_shape, "rms_norm")
    if not 1 <= len(ns) <= len(shape) or tuple(shape[len(shape) - len(ns):]) != ns:
        raise ValueError(f"rms_norm: normalized_shape {list(ns)} must match the trailing dims of x, "
                         f"got x of shape {list(shape)}")
    return make_problem(shape, normalized_shape=ns, weight=bool(weight))


def _problem_of(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                eps: float | None = None) -> Problem:
    return _problem(tuple(x.shape), normalized_shape, weight is not None)


def _bucket(p: Problem) -> tuple:
    rows, n = norm_split(p)
    return pow2_ceil(rows), n, p.kw["weight"]


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    ns = p.kw["normalized_shape"]
    x = randn(p.shape, dtype, device, g)
    w = (1 + 0.5 * randn(ns, torch.float32, device, g)).to(dtype) if p.kw["weight"] else None
    return Inputs((x, ns, w, torch.finfo(dtype).eps))  # eps of x's dtype, also for the float64 reference


def _bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (2 * rows * n + (n if p.kw["weight"] else 0)) * dt.itemsize


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (3 * rows * n + (2 * n if p.kw["weight"] else 0)) * dt.itemsize


def default_eps(x: torch.Tensor) -> float:
    """torch's eps for eps=None: that of the compute dtype (float32 for float32, bfloat16 and float16 x)."""
    return torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps


def _eps(x: torch.Tensor, eps: float | None) -> float:
    return default_eps(x) if eps is None else float(eps)


def _kernel_args(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                 eps: float | None = None) -> tuple:
    """F.rms_norm's signature onto the kernel ops' schema (x, int[] normalized_shape, weight?, float eps)."""
    return x, list(norm_shape(normalized_shape)), weight, _eps(x, eps)


def _fake(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _bwd_fake(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else x.new_empty((0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), dw


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, ctx.normalized_shape, weight, ctx.eps = inputs
    ctx.save_for_backward(x, weight)


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        dx, dw = bwd(grad, x, ctx.normalized_shape, weight, ctx.eps)
        return dx, None, (dw if weight is not None else None), None

    return backward


SPEC = register_op(OpSpec(
    name="rms_norm", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes,
    bwd_bytes=_bwd_bytes, grad_args=(0, 2), autograd=(_setup, _backward_for),
    bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 4096)),  # 1 row
        _problem((4096, 1)),  # 1 column
        _problem((1823, 781)),  # no multiple of any block
        _problem((2, 20003)),  # a row longer than one block: the backward's looped kernels
        _problem((2, 40009)),  # longer than the forward's register-resident rows: looped kernels
        _problem((4, 6, 33), normalized_shape=(6, 33)),  # normalized over two trailing dims
        _problem((5, 64), weight=False),  # no weight
        _problem((0, 16)),  # empty
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (4096, 32768), (65536, 256), (32, 4096), (1, 4096), (12, 250000)] if dev == "cuda"
        else [(256, 1024), (8, 65536)])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
))

