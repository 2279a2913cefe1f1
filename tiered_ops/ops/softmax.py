"""softmax(x, dim=-1): torch.softmax semantics (output in x's dtype), any dim, any row length.

Bucket: (rows rounded up to a power of two, the length n of `dim`, whether `dim` is the last dim).
Bytes: read x once + write y once (the floor; a looped kernel may read twice). Backward: read y and dy,
write dx. Autograd of the kernel ops: save y, dx = y * (dy - sum(dy * y)) in the tier's backward kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import call, floating, gen, randn, values


def reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Eager tier and reference (torch computes low-precision softmax in fp32; float64 in the gate)."""
    return torch.softmax(x, dim)


def validate(x: torch.Tensor, dim: int = -1) -> None:
    """The contract of a call (every tier): x floating, dim an integer in range."""
    floating("softmax", "x", x)
    _dim(x.dim(), dim)


def _dim(ndim: int, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"softmax: dim must be an int, got {dim!r} ({type(dim).__name__})")
    nd = max(ndim, 1)
    if not -nd <= dim < nd:
        raise IndexError(f"softmax: dim out of range (expected to be in range of [{-nd}, {nd - 1}], but got {dim})")
    return dim if dim < 0 else dim - nd


def _problem(shape: tuple[int, ...], dim: int = -1) -> Problem:
    return make_problem(shape, dim=_dim(len(shape), dim))


def _problem_of(x: torch.Tensor, dim: int = -1) -> Problem:
    return _problem(tuple(x.shape), dim)


def _split(p: Problem) -> tuple[int, int]:
    if not p.shape:
        return 1, 1
    n = p.shape[p.kw["dim"]]
    numel = 1
    for d in p.shape:
        numel *= d
    return (numel // n if n else 0), n


def _bucket(p: Problem) -> tuple:
    rows, n = _split(p)
    return pow2_ceil(rows), n, p.kw["dim"] == -1


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    return Inputs((randn(p.shape, dtype, device, gen(device, seed)), p.kw["dim"]))


def _numel(p: Problem) -> int:
    rows, n = _split(p)
    return rows * n


def _kernel_args(x: torch.Tensor, dim: int = -1) -> tuple:
    """This op's Python signature onto the kernel ops' schema (x, int dim)."""
    return x, dim


def _fake(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.dim() == 0:
        return torch.empty_like(x)
    # The kernels write rows along `dim` contiguously and return them moved back into place.
    return torch.empty_like(x.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(-1, dim)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _backward_for(bwd: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (y,) = ctx.saved_tensors
        return bwd(grad, y, ctx.dim), None

    return backward


BAD_INPUTS = (
    BadInput("dim out of range", call(values(3, 4), dim=2), IndexError, r"softmax: dim out of range"),
    BadInput("dim not an int", call(values(3, 4), dim=1.0), TypeError, r"softmax: dim must be an int"),
)

SPEC = register_op(OpSpec(
    name="softmax", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=lambda p, dt: 2 * _numel(p) * dt.itemsize,
    bwd_bytes=lambda p, dt: 3 * _numel(p) * dt.itemsize, grad_args=(0,), autograd=(_setup, _backward_for),
    bwd_fake=lambda dy, y, dim: _fake(y, dim),
    edge_problems=lambda: [
        _problem((1, 4096)),  # 1 row
        _problem((4096, 1)),  # 1 column
        _problem((1823, 781)),  # sizes that are no multiple of any block
        _problem((3, 20003)),  # a row longer than one block: the backward's looped kernels
        _problem((2, 40009)),  # longer than the forward's register-resident rows: looped kernels
        _problem((5, 33), dim=0),  # softmax over a non-last dim
        _problem((0, 16)),  # empty
        _problem((7,)),  # 1-D
        _problem((3, 1, 5), dim=1),  # a size-1 softmax dim: y = 1, dx = 0
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (4096, 32768), (65536, 256), (512, 393216), (32, 4096), (1, 4096), (12, 250000)]
        if dev == "cuda"
        else [(256, 1024), (8, 65536)])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
    bad_inputs=BAD_INPUTS,
))

