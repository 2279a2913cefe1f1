"""cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0): the semantics of
torch.nn.functional.cross_entropy for logits [N, V] (float32, bfloat16, float16) and int64 class indices [N].

loss_i = lse_i - (1 - s) * x[i, t_i] - s / V * sum_j x[i, j]   (lse_i = log sum_j exp x[i, j], s = label_smoothing)
for a row whose target t_i is not ignore_index, 0 for an ignored row. reduction "none": the [N] losses; "sum": their
sum; "mean": the sum over the number of non-ignored targets (NaN when every target is ignored, as in torch).
Output: 0-dim (mean, sum) or [N] (none), in the logits' dtype, as torch returns it (so a float16 sum past 65504 is
inf at every tier, as in torch); with ``dtype=torch.float32`` (keyword only, as torch.softmax's ``dtype``: the result
as if the logits were cast to float32 first) a float32 loss from bfloat16/float16 logits without that cast: the
kernels compute in float32 anyway, so only the last rounding is left out, and the logits' gradient comes back in
their dtype (what the cast's backward would give). Only logits are differentiable:
dlogits[i, j] = (softmax(x_i)_j - s / V - (1 - s) [j == t_i]) * g_i, with g_i the output gradient (divided by the
count of non-ignored targets for "mean"); 0 for an ignored row (also when every target is ignored).

Tiers. Eager (the reference) casts bfloat16/float16 logits to float32 and calls F.cross_entropy: it materializes
the float32 log-probabilities [N, V] (and in training, float32 gradients of the same size). The Triton and CUDA
kernels never do: one pass over each row keeps a running max and sum of exp (online softmax), reads the target's
logit, and writes one float32 loss and the row's log-sum-exp (lse); the reduction over rows runs on those [N] floats.

Training memory. The kernel tiers save the logits and the [N] float32 lse, and the backward kernel recomputes
softmax from them (one read of the logits, one write of the gradient). They do not compute the gradient in the
forward (as Liger does): that saves memory only when the gradient is written over the logits, and these logits
belong to the caller (a model may still use them, the harness re-runs calls on them); in a separate buffer it is
one [N, V] write more for the same peak (logits + gradient: both designs hold two [N, V] tensors at their peak).

Targets outside [0, V) that are not ignore_index: on the CPU (eager and the Triton interpreter) a ValueError
naming target, the row and the value; eager on CUDA asserts on the device (asynchronously, like torch's own
kernel); the Triton and CUDA kernels on a GPU do not check (it would cost a device sync): such a row's loss and
gradient are NaN, so the mean or sum is NaN, and nothing is read out of bounds.

Bucket: (rows rounded up to a power of two, V, reduction, label_smoothing > 0).
Problem parameter ``ignored``: the fraction of the benchmark's targets set to ignore_index (data, not a call
argument: a call's problem says 0, and the bucket leaves it out).
Bytes: read logits and targets, write the loss. Backward: read logits, targets, lse, write the gradient.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import call, gen, values

REDUCTIONS = ("mean", "sum", "none")
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _check_args(reduction: str, label_smoothing: float) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")


def validate(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
             label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None) -> None:
    """The contract of a call (every tier): shapes, dtypes, devices and options (errors name the argument)."""
    check(logits, target, reduction, label_smoothing)
    if dtype is not None and dtype not in (torch.float32, logits.dtype):
        raise ValueError(f"cross_entropy: dtype must be None, torch.float32 or the logits' dtype ({logits.dtype}), "
                         f"got {dtype!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"cross_entropy: ignore_index must be an int, got {ignore_index!r} "
                        f"({type(ignore_index).__name__})")


def check_values(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None) -> None:
    """Targets in [0, V) or ignore_index, read where that costs no device sync (CPU, outside a compiled trace)."""
    if target.device.type == "cpu" and not torch.compiler.is_compiling():
        check_targets(target, logits.shape[1], ignore_index)


def check(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean", label_smoothing: float = 0.0) -> None:
    """Shapes, dtypes, devices and options of a call (errors name the argument)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"cross_entropy: logits must have a floating dtype (float32, bfloat16, float16), got {got}")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"cross_entropy: logits must have shape [N, V] with V >= 1, got {list(logits.shape)}")
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64:
        got = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        raise TypeError(f"cross_entropy: target must have dtype int64 (class indices), got {got}")
    if tuple(target.shape) != (logits.shape[0],):
        raise ValueError(f"cross_entropy: target must have shape [N] = [{logits.shape[0]}] for logits of shape "
                         f"{list(logits.shape)}, got {list(target.shape)}")
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target must be on {logits.device} like logits, got {target.device}")
    _check_args(reduction, label_smoothing)


def check_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """On the CPU: every target in [0, V) or ignore_index, else a ValueError naming the first bad one."""
    bad = ((target < 0) | (target >= n_classes)) & (target != ignore_index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"cross_entropy: target[{i}] = {int(target[i])} is outside [0, {n_classes}) and is not "
                         f"ignore_index ({ignore_index})")


def reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
              label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Eager tier and reference: F.cross_entropy on float32 logits (float64 stays float64), in ``dtype`` (None: the
    logits' dtype; float64 logits, the gate's, stay float64).
    (Targets on the CPU are checked before it runs: ``check_values``.)"""
    if target.device.type != "cpu" or torch.compiler.is_compiling():
        # no sync: a device-side assert on CUDA (torch's own kernel asserts there too)
        bad = ((target < 0) | (target >= logits.shape[1])) & (target != ignore_index)
        torch._assert_async(~bad.any(), "cross_entropy: a target is outside [0, V) and is not ignore_index")
    x = logits.float() if logits.dtype in LOW_PRECISION else logits
    out = logits.dtype if dtype is None or logits.dtype == torch.float64 else dtype
    return F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing).to(out)


def _problem(shape: tuple[int, ...], reduction: str = "mean", label_smoothing: float = 0.0, ignored: float = 0.0
             ) -> Problem:
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"cross_entropy: the shape is logits' [N, V] with V >= 1, got {list(shape)}")
    _check_args(reduction, label_smoothing)
    if not 0.0 <= float(ignored) <= 1.0:
        raise ValueError(f"cross_entropy: ignored (the fraction of ignored targets) must be in [0, 1], got {ignored}")
    return make_problem(shape, reduction=reduction, label_smoothing=float(label_smoothing), ignored=float(ignored))


def _problem_of(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None) -> Problem:
    return _problem(tuple(logits.shape), reduction, label_smoothing)


def _bucket(p: Problem) -> tuple:
    return pow2_ceil(p.shape[0]), p.shape[1], p.kw["reduction"], p.kw["label_smoothing"] > 0


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    n, v = p.shape
    # logits of a spread like a trained model's (std 2: a few classes stand out, none dominates every row)
    logits = (2 * torch.randn((n, v), generator=g, device=device, dtype=torch.float32)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g, device=device, dtype=torch.int64)
    k = round(p.kw["ignored"] * n)
    if k:
        target[torch.randperm(n, generator=g, device=device)[:k]] = -100
    return Inputs((logits, target, -100, p.kw["reduction"], p.kw["label_smoothing"]))


def _out_elems(p: Problem) -> int:
    return p.shape[0] if p.kw["reduction"] == "none" else 1


def _bytes(p: Problem, dt: torch.dtype) -> int:
    n, v = p.shape
    return n * v * dt.itemsize + 8 * n + _out_elems(p) * dt.itemsize


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    n, v = p.shape
    return 2 * n * v * dt.itemsize + (8 + 4) * n + _out_elems(p) * dt.itemsize


def _kernel_args(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None) -> tuple:
    """The op's signature onto the kernel ops' schema (logits, target, int ignore_index, str reduction, float,
    ScalarType? dtype)."""
    return logits, target, operator.index(ignore_index), reduction, float(label_smoothing), dtype


def _fake(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
          dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == "none" else (), dtype=dtype or logits.dtype)
    return loss, logits.new_empty((n,), dtype=torch.float32)


def _bwd_fake(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
              reduction: str, label_smoothing: float) -> torch.Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    logits, target, ctx.ignore_index, ctx.reduction, ctx.label_smoothing, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, target, output[1])


def _backward_for(bwd: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor, _glse: Any) -> tuple:
        logits, target, lse = ctx.saved_tensors
        dx = bwd(grad, logits, target, lse, ctx.ignore_index, ctx.reduction, ctx.label_smoothing)
        return dx, None, None, None, None, None

    return backward


def _target(*classes: int) -> torch.Tensor:
    return torch.tensor(classes, dtype=torch.int64)


def _out_of_range(rows: int, n: int, target: tuple[int, ...], good: tuple[int, ...], i: int) -> BadInput:
    """A target outside [0, V): refused where targets are read (on the host), after a good call of the same shapes."""
    return BadInput(f"target {target[i]} of {n} classes", call(values(rows, n), _target(*target)), ValueError,
                    rf"target\[{i}\] = {target[i]} is outside \[0, {n}\)", good=call(values(rows, n), _target(*good)),
                    devices=("cpu",))


BAD_INPUTS = (
    *(_out_of_range(4, 10, (1, bad, -100, 3), (1, 2, -100, 3), 1) for bad in (10, -1, -7)),
    _out_of_range(3, 5, (0, 7, 2), (0, 1, 2), 1),
    BadInput("target of 3 rows", call(values(4, 10), _target(1, 2, 3)), ValueError,
             r"cross_entropy: target must have shape \[N\] = \[4\]"),
    BadInput("target int32", call(values(4, 10), _target(1, 2, 3, 4).int()), TypeError,
             r"cross_entropy: target must have dtype int64"),
    BadInput("target float", call(values(4, 10), _target(1, 2, 3, 4).float()), TypeError,
             r"cross_entropy: target must have dtype int64"),
    BadInput("logits 3-D", call(values(2, 2, 10), _target(1, 2, 3, 4)), ValueError,
             r"cross_entropy: logits must have shape \[N, V\]"),
    BadInput("unknown reduction", call(values(4, 10), _target(1, 2, 3, 4), -100, "avg"), ValueError,
             r"cross_entropy: reduction must be"),
    BadInput("unknown reduction by keyword", call(values(4, 10), _target(1, 2, 3, 4), reduction="avg"), ValueError,
             r"cross_entropy: reduction must be"),
    BadInput("label_smoothing above 1", call(values(4, 10), _target(1, 2, 3, 4), -100, "mean", 1.5), ValueError,
             r"cross_entropy: label_smoothing must be in \[0, 1\]"),
    BadInput("a loss dtype neither float32 nor the logits'",
             call(values(4, 10, dtype=torch.bfloat16), _target(1, 2, 3, 4), dtype=torch.float16), ValueError,
             r"cross_entropy: dtype must be None, torch.float32 or the logits' dtype",
             good=call(values(4, 10, dtype=torch.bfloat16), _target(1, 2, 3, 4), dtype=torch.float32)),
)

SPEC = register_op(OpSpec(
    name="cross_entropy", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes, bwd_bytes=_bwd_bytes, grad_args=(0,), autograd=(_setup, _backward_for),
    bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 1000)),  # one row
        _problem((2, 20003)),  # a row longer than one Triton block: the looped path
        _problem((3, 1001)),  # V no multiple of any block or pack: masked tails, scalar CUDA path
        _problem((9, 64), ignored=1.0),  # every target ignored: mean is NaN, the gradient 0
        _problem((16, 100), ignored=0.25),  # some ignored
        _problem((7, 129), label_smoothing=0.1, ignored=0.25),  # label smoothing, with ignored rows
        _problem((6, 33), reduction="none", ignored=0.25),  # per-row losses
        _problem((6, 33), reduction="sum", label_smoothing=0.2),  # summed
        _problem((0, 16)),  # empty: mean NaN
    ],
    default_problems=lambda dev: [
        _problem((8192, 128256)), _problem((4096, 32000)), _problem((16384, 32000)), _problem((2048, 262144)),
        _problem((4096, 128256), reduction="none", label_smoothing=0.1, ignored=0.25),
    ] if dev == "cuda" else [_problem((64, 4096)), _problem((256, 32000), ignored=0.25)],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, first_output=True,
    validate=validate, check_values=check_values, bad_inputs=BAD_INPUTS,
    variants=({}, {"reduction": "none"}, {"reduction": "none", "label_smoothing": 0.1}),
))
