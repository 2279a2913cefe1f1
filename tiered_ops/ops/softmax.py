"""softmax(x, dim=-1): torch.softmax semantics (output in x's dtype), any dim, any row length.

Bucket: (rows rounded up to a power of two, the length n of `dim`, whether `dim` is the last dim).
Bytes: read x once + write y once (the floor; a looped kernel may read twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..registry import Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ..select import _calls, dispatch
from ._tiers import gen, randn, standard_impls


def reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Eager tier and reference (torch computes low-precision softmax in fp32; float64 in the gate)."""
    return torch.softmax(x, dim)


def _problem(shape: tuple[int, ...], dim: int = -1) -> Problem:
    nd = max(len(shape), 1)
    if not -nd <= dim < nd:
        raise IndexError(f"softmax: dim out of range (expected to be in range of [{-nd}, {nd - 1}], but got {dim})")
    return make_problem(shape, dim=dim if dim < 0 else dim - nd)


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


def _adapt(kernel_op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """This op's Python signature onto a kernel tier's schema (x, dim)."""
    return lambda x, dim=-1: kernel_op(x, dim)


def _fake(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.dim() == 0:
        return torch.empty_like(x)
    # The kernels write rows along `dim` contiguously and return them moved back into place.
    return torch.empty_like(x.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(-1, dim)


SPEC = register_op(OpSpec(
    name="softmax", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=lambda p, dt: 2 * _numel(p) * dt.itemsize, flops=lambda p: 5 * _numel(p),
    edge_problems=lambda: [
        _problem((1, 4096)),  # 1 row
        _problem((4096, 1)),  # 1 column
        _problem((1823, 781)),  # sizes that are no multiple of any block
        _problem((3, 20003)),  # a row longer than one block: looped kernels
        _problem((5, 33), dim=0),  # softmax over a non-last dim
        _problem((0, 16)),  # empty
        _problem((7,)),  # 1-D
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (4096, 32768), (65536, 256), (512, 393216), (32, 4096), (1, 4096)] if dev == "cuda"
        else [(256, 1024), (8, 65536)])],
    source=Path(__file__), fake=_fake,
))
standard_impls(SPEC, reference, _adapt)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax of ``x`` along ``dim`` through the implementation selected for this shape, dtype and device."""
    key = ("softmax", x.shape, x.dtype, x.get_device(), dim)
    sel = _calls.get(key)
    if sel is None:
        return dispatch(SPEC, key, x, (x, dim), {})
    return sel.fn(x, dim)
