"""segment_sum(values, offsets): out[s, :] = values[offsets[s]:offsets[s + 1], :].sum(0), a CSR segment sum.

values is [E, D] float (fp32, bf16, fp16; float64 for the reference), offsets [S + 1] int64, sorted, offsets[0] == 0
and offsets[-1] == E (empty segments allowed: their sum is 0). The sums accumulate in fp32 (float64 for float64
values) and out [S, D] has values' dtype. Backward: dvalues[e] = dout[segment of e]; offsets get no gradient.

Two eager implementations: ``eager`` (the reference) scatters with index_add into an fp32 buffer, the rows' segment
ids found with searchsorted; ``eager_segment_reduce`` is torch.segment_reduce on the fp32 values. The reference is the
index_add one: index_add and searchsorted are stable torch ops with float64 and autograd on every device, ids clamped
to [0, S) keep even malformed offsets in bounds on the GPU; torch.segment_reduce accumulates in the input dtype on the
CPU and the GPU (a 5000-row bf16 segment is 14 % off: it needs the same fp32 copy), names no argument for unsorted
offsets, sums a prefix silently when offsets[-1] < E, and its CUDA kernel has one thread walk a whole segment, so one
giant segment runs serially. Both are measured; the gate holds both to the float64 math.

Validation (``validate``, before any tier runs): values 2-D float and offsets 1-D int64 on values' device, everywhere.
Offsets' values (offsets[0] == 0, offsets[-1] == E, sorted: ``check_values``) are read on the host only where that
costs no sync: CPU offsets outside a torch.compile trace, on every call of every tier and of tiered_ops.segment_sum.
On a GPU, and inside a compiled graph, offsets are
never read on the host: malformed offsets give unspecified sums but every access stays in bounds (the kernels clamp
each boundary to [0, E] and each segment id to [0, S); the eager tiers clamp the ids, or the offsets).
Problem: values' shape (E, D), ``segments`` S (default: mean length 16) and ``lengths``, how make_inputs draws the
boundaries: "uniform" (S - 1 uniform cut points: lengths near E / S, some empty) or "powerlaw" (segment k of a random
order holds a share ~ k^-1.5: a few segments hold most rows, most are empty). A call's problem (problem_of) is that
of its sizes: its lengths are not read (a sync on the GPU), so it is the uniform problem of (E, D, S).
Bucket: (E rounded up to a power of two, D, S rounded up to a power of two); lengths are not part of it: the kernel
tiers are built to take the same time whatever the lengths, and the powerlaw problems of the sweep measure that.
Bytes: values read once, offsets read, out written. Backward: dout and offsets read, dvalues written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..registry import BadInput, Impl, Inputs, OpSpec, Problem, Tier, make_problem, pow2_ceil, register_op
from ._common import call, floating, gen, randn, tensor, values

LENGTHS = ("uniform", "powerlaw")
MEAN_LENGTH = 16  # default rows per segment
POWER = 1.5  # powerlaw: segment k of a random order holds a share ~ k^-POWER of the rows


def validate(values: torch.Tensor, offsets: torch.Tensor) -> None:
    """The contract of a call (every tier): shapes, dtypes and devices of the arguments."""
    tensor("segment_sum", "values", values)
    tensor("segment_sum", "offsets", offsets)
    floating("segment_sum", "values", values)
    if values.dim() != 2:
        raise ValueError(f"segment_sum: values must be 2-D [E, D], got shape {list(values.shape)}")
    if offsets.dtype != torch.int64:
        raise TypeError(f"segment_sum: offsets must be an int64 tensor of S + 1 boundaries, got dtype {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"segment_sum: offsets must be 1-D with S + 1 >= 1 boundaries, got shape "
                         f"{list(offsets.shape)}")
    if offsets.device != values.device:
        raise ValueError(f"segment_sum: offsets must be on values' device {values.device}, got {offsets.device}")


def check_values(values: torch.Tensor, offsets: torch.Tensor) -> None:
    """The offsets' values, where reading them costs no sync (CPU offsets outside a torch.compile trace)."""
    if offsets.device.type == "cpu" and not torch.compiler.is_compiling():
        check_boundaries(offsets, values.shape[0])


def check_boundaries(offsets: torch.Tensor, rows: int, op: str = "segment_sum") -> None:
    """offsets[0] == 0, offsets[-1] == rows and sorted: a ValueError naming the first entry that is not (and ``op``,
    the function that was called)."""
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise ValueError(f"{op}: offsets[0] must be 0, got {first}")
    if last != rows:
        raise ValueError(f"{op}: offsets[-1] must be values.shape[0] = {rows}, got {last}")
    down = (offsets[1:] < offsets[:-1]).nonzero()
    if down.numel():
        i = int(down[0, 0])
        raise ValueError(f"{op}: offsets must be sorted (non-decreasing), got offsets[{i}] = "
                         f"{int(offsets[i])} > offsets[{i + 1}] = {int(offsets[i + 1])}")


def _acc(values: torch.Tensor) -> torch.dtype:
    return torch.promote_types(values.dtype, torch.float32)  # fp32, or float64 for float64 values


def reference(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Eager tier and reference: index_add of the rows, at the segment ids searchsorted finds, into fp32 sums."""
    S = offsets.shape[0] - 1
    acc = _acc(values)
    if S == 0:  # no segment: an empty output, still in values' autograd graph
        return values[:0] * 0
    rows = torch.arange(values.shape[0], device=values.device)
    # searchsorted over all S + 1 boundaries, minus one: the same ids as over offsets[1:] (offsets[0] == 0 <= every
    # row), without a sliced sorted sequence (Inductor-compiled on the GPU, the sliced form gave wrong sums)
    ids = torch.searchsorted(offsets, rows, right=True).sub_(1).clamp_(0, S - 1)
    out = values.new_zeros((S, values.shape[1]), dtype=acc).index_add(0, ids, values.to(acc))
    return out.to(values.dtype)


def segment_reduce(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch.segment_reduce of the values in fp32 (it accumulates in its input's dtype). Off the CPU the offsets are
    clamped to [0, E] and made non-decreasing first (a no-op for valid ones): torch's GPU kernel reads rows at the
    offsets it is given, unchecked."""
    if offsets.device.type != "cpu":
        offsets = offsets.clamp(0, values.shape[0]).cummax(0).values
    return torch.segment_reduce(values.to(_acc(values)), "sum", offsets=offsets, axis=0).to(values.dtype)


def _problem(shape: tuple[int, ...], segments: int | None = None, lengths: str = "uniform") -> Problem:
    """``shape``: values' (E, D); ``segments``: S (default E / 16 rounded up, at least 1); ``lengths``: how
    make_inputs draws the boundaries (uniform, powerlaw)."""
    if len(shape) != 2 or min(shape) < 0:
        raise ValueError(f"segment_sum: values must be 2-D [E, D], got shape {list(shape)}")
    E = shape[0]
    S = max(1, math.ceil(E / MEAN_LENGTH)) if segments is None else int(segments)
    if S < 0 or (S == 0 and E > 0):
        raise ValueError(f"segment_sum: segments must be >= 1 (0 only for E = 0), got {S} for E = {E}")
    if lengths not in LENGTHS:
        raise ValueError(f"segment_sum: lengths must be one of {', '.join(LENGTHS)}, got {lengths!r}")
    extra = {} if lengths == "uniform" else {"lengths": lengths}
    return make_problem(shape, segments=S, **extra)


def _problem_of(values: torch.Tensor, offsets: torch.Tensor) -> Problem:
    return _problem(tuple(values.shape), offsets.shape[0] - 1)


def _sizes(p: Problem) -> tuple[int, int, int]:
    return p.shape[0], p.shape[1], p.kw["segments"]


def _bucket(p: Problem) -> tuple:
    E, D, S = _sizes(p)
    return pow2_ceil(E), D, pow2_ceil(S)


def offsets_for(rows: int, segments: int, lengths: str, seed: int) -> torch.Tensor:
    """Sorted int64 boundaries [segments + 1] from 0 to rows, drawn on the CPU from ``seed`` (the same on every
    device)."""
    if segments == 0:
        return torch.zeros(1, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    if lengths == "uniform":
        cuts = torch.randint(0, rows + 1, (segments - 1,), generator=g).sort().values
    else:
        share = torch.arange(1, segments + 1, dtype=torch.float64) ** -POWER
        share = share[torch.randperm(segments, generator=g)]
        cuts = torch.round(share.cumsum(0)[:-1] / share.sum() * rows).to(torch.int64).clamp_(0, rows)
    ends = torch.tensor([0, rows], dtype=torch.int64)
    return torch.cat([ends[:1], cuts, ends[1:]])


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    E, D, S = _sizes(p)
    values = randn((E, D), dtype, device, gen(device, seed))
    return Inputs((values, offsets_for(E, S, p.kw.get("lengths", "uniform"), seed).to(device)))


def _bytes(p: Problem, dt: torch.dtype) -> int:
    E, D, S = _sizes(p)
    return (E * D + S * D) * dt.itemsize + (S + 1) * 8


def _kernel_args(values: torch.Tensor, offsets: torch.Tensor) -> tuple:
    return values, offsets


def _fake(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return values.new_empty((offsets.shape[0] - 1, values.shape[1]))


def _bwd_fake(dout: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    return dout.new_empty((rows, dout.shape[1]))


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    values, offsets = inputs
    ctx.rows = values.shape[0]
    ctx.save_for_backward(offsets)


def _backward_for(bwd: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (offsets,) = ctx.saved_tensors
        return bwd(grad, offsets, ctx.rows), None

    return backward


def _offsets(*bounds: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(bounds, dtype=dtype)


def _data_error(what: str, rows: int, bad: tuple[int, ...], good: tuple[int, ...], match: str) -> BadInput:
    """Malformed offsets' values: refused where they are read (on the host), after a good call of the same shapes."""
    return BadInput(what, call(values(rows, 4), _offsets(*bad)), ValueError, match,
                    good=call(values(rows, 4), _offsets(*good)), devices=("cpu",))


BAD_INPUTS = (
    _data_error("unsorted", 10, (0, 6, 3, 10), (0, 2, 5, 10),
                r"offsets must be sorted .*offsets\[1\] = 6 > offsets\[2\] = 3"),
    _data_error("first not 0", 10, (2, 5, 10), (0, 5, 10), r"offsets\[0\] must be 0, got 2"),
    _data_error("last not E", 10, (0, 5, 9), (0, 5, 10), r"offsets\[-1\] must be values.shape\[0\] = 10, got 9"),
    _data_error("unsorted inside", 8, (0, 5, 3, 8), (0, 2, 5, 8), r"sorted.*offsets\[1\] = 5 > offsets\[2\] = 3"),
    _data_error("last short", 8, (0, 2, 5, 5), (0, 2, 5, 8), r"offsets\[-1\] must be values.shape\[0\] = 8, got 5"),
    _data_error("first 1", 8, (1, 2, 5, 8), (0, 2, 5, 8), r"offsets\[0\] must be 0"),
    BadInput("offsets int32", call(values(10, 4), _offsets(0, 5, 10, dtype=torch.int32)), TypeError,
             r"offsets must be an int64"),
    BadInput("offsets float", call(values(10, 4), torch.tensor([0.0, 5.0, 10.0])), TypeError,
             r"offsets must be an int64"),
    BadInput("offsets 2-D", call(values(10, 4), torch.tensor([[0, 5, 10]])), ValueError, r"offsets must be 1-D"),
    BadInput("offsets empty", call(values(0, 4), _offsets()), ValueError, r"offsets must be 1-D with S \+ 1 >= 1"),
    BadInput("values 1-D", call(values(10), _offsets(0, 5, 10)), ValueError, r"values must be 2-D"),
    BadInput("values int", call(values(10, 4, dtype=torch.int32), _offsets(0, 5, 10)), TypeError,
             r"values must be .*float"),
)

SPEC = register_op(OpSpec(
    name="segment_sum", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes, bwd_bytes=_bytes, grad_args=(0,),
    autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((301, 33), segments=20),  # D not a multiple of any vector width, odd E
        _problem((1000, 16), segments=1),  # one giant segment: split over row ranges, then combined
        _problem((777, 1), segments=37, lengths="powerlaw"),  # D = 1, skewed: long segments beside empty ones
        _problem((3001, 24), segments=64, lengths="powerlaw"),  # several long segments sharing row ranges
        _problem((50, 8), segments=400),  # many more segments than rows: most are empty
        _problem((0, 8), segments=3),  # E = 0: every segment empty
    ],
    default_problems=lambda dev: (  # mean length 16; on the GPU 2^22 rows at D = 64 and 128, and a small one
        [_problem((1 << 22, d), segments=1 << 18, lengths=dist) for d in (64, 128) for dist in LENGTHS]
        + [_problem((1 << 14, 64), segments=1 << 10)] if dev == "cuda"
        else [_problem((4096, 64), segments=256, lengths=dist) for dist in LENGTHS]),
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
    check_values=check_values, bad_inputs=BAD_INPUTS,
))
SPEC.add(Impl("eager_segment_reduce", Tier.EAGER, segment_reduce, (SPEC.source,),
              own_functions=((SPEC.source, "segment_reduce"),)))
