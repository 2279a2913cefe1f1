"""muladd(a, b, c) = a * b + c elementwise; a, b, c of one shape, dtype and device.

Two eager implementations: the plain expression (two kernels, a rounding in between) and
torch.addcmul (one kernel): the registry measures both.
Bucket: (numel rounded up to a power of two,).
Bytes: 3 reads + 1 write per element. Backward: read g, a, b; write da, db (dc is g itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..registry import Impl, Inputs, OpSpec, Problem, Tier, make_problem, pow2_ceil, register_op
from ..select import _calls, dispatch, not_tensors
from ._tiers import gen, randn, standard_impls


def _check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    if not (a.shape == b.shape == c.shape):
        raise ValueError(f"muladd: a, b and c must have the same shape, got {list(a.shape)}, {list(b.shape)}, "
                         f"{list(c.shape)}")


def reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Eager tier and reference: the plain expression."""
    _check(a, b, c)
    return a * b + c


def addcmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    _check(a, b, c)
    return torch.addcmul(c, a, b)


def _problem(shape: tuple[int, ...]) -> Problem:
    return make_problem(shape)


def _problem_of(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Problem:
    _check(a, b, c)
    return _problem(tuple(a.shape))


def _numel(p: Problem) -> int:
    n = 1
    for d in p.shape:
        n *= d
    return n


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    return Inputs(tuple(randn(p.shape, dtype, device, g) for _ in range(3)))


def _fake(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _bwd_fake(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(a, memory_format=torch.contiguous_format),
            torch.empty_like(b, memory_format=torch.contiguous_format))


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        da, db = bwd(grad, a, b)
        return da, db, grad

    return backward


SPEC = register_op(OpSpec(
    name="muladd", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=lambda p: (pow2_ceil(_numel(p)),), bytes_moved=lambda p, dt: 4 * _numel(p) * dt.itemsize,
    flops=lambda p: 2 * _numel(p), bwd_bytes=lambda p, dt: 5 * _numel(p) * dt.itemsize, grad_args=(0, 1, 2),
    autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1,)),  # one element
        _problem((1823, 781)),  # tail of every block size
        _problem((3, 1, 5)),  # size-1 dim
        _problem((100003,)),  # several blocks plus a tail
        _problem((0, 4)),  # empty
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (65536, 256), (32, 4096), (1, 4096)] if dev == "cuda" else [(256, 1024), (4096, 1024)])],
    source=Path(__file__), fake=_fake,
))
standard_impls(SPEC, reference, lambda a, b, c: (a, b, c))
SPEC.add(Impl("eager_addcmul", Tier.EAGER, addcmul, (SPEC.source,), own_functions=((SPEC.source, "addcmul"),)))


def muladd(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c through the implementation selected for this shape, dtype and device."""
    try:  # inline, not a helper: the per-call hot path
        train = (a.requires_grad or b.requires_grad or c.requires_grad) and torch.is_grad_enabled()
    except AttributeError:
        raise not_tensors("muladd", a=a, b=b, c=c) from None
    key = ("muladd", a.shape, a.dtype, a.get_device(), train)
    sel = _calls.get(key)
    if sel is None:
        return dispatch(SPEC, key, a, (a, b, c), {}, train)
    return sel.fn(a, b, c)
