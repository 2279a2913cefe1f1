"""muladd(a, b, c) = a * b + c elementwise, broadcasting like the expression; a, b, c of one dtype and device.

Two eager implementations: the plain expression (two kernels, a rounding in between) and
torch.addcmul (one kernel): the registry measures both. The Triton and CUDA kernels take operands of one shape:
broadcast operands reach them expanded and made contiguous (a copy the eager tiers do not pay), and autograd
sums their gradients back to each operand's shape.
Problem: the output shape, plus ``operands`` ("4x1,1x5,4x5") when the three shapes differ.
Bucket: (numel rounded up to a power of two, whether the operands broadcast).
Bytes: each operand read once + the output written. Backward: read g, a, b; write da, db (dc is g summed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..registry import BadInput, Impl, Inputs, OpSpec, Problem, Tier, make_problem, pow2_ceil, register_op
from ._common import call, floating, gen, randn, same_device, values


def _shape_str(shape: tuple[int, ...] | torch.Size) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def _out_shape(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[int, ...]:
    """The shape ``a * b + c`` has; a clear error when the operands do not broadcast or do not share a dtype."""
    if not (a.dtype == b.dtype == c.dtype):
        raise TypeError(f"muladd: a, b and c must share one dtype (no type promotion), got {a.dtype}, {b.dtype}, "
                        f"{c.dtype}")
    if a.shape == b.shape == c.shape:
        return tuple(a.shape)
    try:
        return tuple(torch.broadcast_shapes(a.shape, b.shape, c.shape))
    except RuntimeError:
        raise ValueError(f"muladd: a, b and c must broadcast to one shape as in a * b + c, got {list(a.shape)}, "
                         f"{list(b.shape)}, {list(c.shape)}") from None


def _operands(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' operands: a, b, c as they are when of one shape, else expanded to the broadcast shape."""
    if a.shape == b.shape == c.shape:
        return a, b, c
    shape = _out_shape(a, b, c)
    return a.expand(shape), b.expand(shape), c.expand(shape)


def validate(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """The contract of a call (every tier): a, b, c floating tensors of one dtype (no promotion) and one device that
    broadcast to one shape."""
    for name, t in (("a", a), ("b", b), ("c", c)):
        floating("muladd", name, t)
    for name, t in (("b", b), ("c", c)):
        same_device("muladd", name, t, a, "a")
    _out_shape(a, b, c)


def reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Eager tier and reference: the plain expression."""
    return a * b + c


def addcmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(c, a, b)


def _parse_operands(operands: str) -> list[tuple[int, ...]]:
    try:
        shapes = [tuple(int(d) for d in part.split("x")) if part != "scalar" else () for part in operands.split(",")]
    except ValueError:
        shapes = []
    if len(shapes) != 3 or any(d < 0 for s in shapes for d in s):
        raise ValueError(f"muladd: operands: expected the shapes of a, b and c like 4x1,1x5,4x5, got {operands!r}")
    return shapes


def _problem(shape: tuple[int, ...], operands: str | None = None) -> Problem:
    """``shape``: the output's; ``operands``: the shapes of a, b and c ("4x1,1x5,4x5") when they broadcast."""
    if operands is None:
        return make_problem(shape)
    shapes = _parse_operands(operands)
    out = tuple(torch.broadcast_shapes(*shapes))
    if out != tuple(shape):
        raise ValueError(f"muladd: operands {operands} broadcast to {list(out)}, not to the shape {list(shape)}")
    if all(s == out for s in shapes):
        return make_problem(shape)
    return make_problem(shape, operands=",".join(_shape_str(s) for s in shapes))


def _problem_of(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Problem:
    shape = _out_shape(a, b, c)
    if a.shape == b.shape == c.shape:
        return make_problem(shape)
    return make_problem(shape, operands=",".join(_shape_str(t.shape) for t in (a, b, c)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shapes(p: Problem) -> list[tuple[int, ...]]:
    """The shapes of a, b and c."""
    operands = p.kw.get("operands")
    return _parse_operands(operands) if operands else [p.shape] * 3


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    return Inputs(tuple(randn(s, dtype, device, g) for s in _shapes(p)))


def _bytes(p: Problem, dt: torch.dtype) -> int:
    """Each operand read once, the output written once."""
    return (sum(_numel(s) for s in _shapes(p)) + _numel(p.shape)) * dt.itemsize


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    """g read; a and b read; da and db written (at their own shapes)."""
    a, b, _ = _shapes(p)
    return (_numel(p.shape) + 2 * _numel(a) + 2 * _numel(b)) * dt.itemsize


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


BAD_INPUTS = (
    BadInput("shapes that do not broadcast", call(values(4, 5), values(4, 5), values(5, 4)), ValueError,
             r"muladd: a, b and c must broadcast to one shape"),
    # after a call of broadcast operands: a call with another b shape is not served from the first one's fast path
    BadInput("b does not broadcast", call(values(6, 5), values(4), values(6, 1)), ValueError, r"must broadcast",
             good=call(values(6, 5), values(5), values(6, 1))),
    BadInput("b of bfloat16", call(values(4, 8), values(4, 8, dtype=torch.bfloat16), values(4, 8)), TypeError,
             r"muladd: a, b and c must share one dtype"),
    BadInput("b of float64", call(values(6, 5), values(5, dtype=torch.float64), values(6, 1)), TypeError,
             r"share one dtype", good=call(values(6, 5), values(5), values(6, 1))),
)

SPEC = register_op(OpSpec(
    name="muladd", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=lambda p: (pow2_ceil(_numel(p.shape)), "operands" in p.kw), bytes_moved=_bytes,
    bwd_bytes=_bwd_bytes, grad_args=(0, 1, 2),
    autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1,)),  # one element
        _problem((1823, 781)),  # tail of every block size
        _problem((3, 1, 5)),  # size-1 dim
        _problem((100003,)),  # several blocks plus a tail
        _problem((0, 4)),  # empty
        _problem((4, 5), "4x1,1x5,4x5"),  # every operand broadcast along another dim
        _problem((3, 7), "1,3x7,7"),  # a scalar-like operand and a row vector
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (65536, 256), (32, 4096), (1, 4096)] if dev == "cuda" else [(256, 1024), (4096, 1024)])]
    + [_problem((16384, 4096) if dev == "cuda" else (256, 1024), "16384x4096,4096,4096" if dev == "cuda"
                else "256x1024,1024,1024")],  # a scale and a shift per column
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_operands, validate=validate,
    bad_inputs=BAD_INPUTS,
))
SPEC.add(Impl("eager_addcmul", Tier.EAGER, addcmul, (SPEC.source,), own_functions=((SPEC.source, "addcmul"),)))

