"""linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
F.cross_entropy(hidden @ weight.T + bias, target, ...) for hidden [N, H], weight [V, H] (an LM head), bias [V] or
None (one floating dtype for all three: float32, bfloat16, float16) and int64 class indices target [N].

The loss is cross_entropy's (``tiered_ops/ops/cross_entropy.py``): reductions "mean" (over the non-ignored targets;
NaN when every target is ignored), "sum", "none"; label smoothing as torch's. Output in hidden's dtype, as torch gives
``F.cross_entropy(F.linear(...))``, or with ``dtype=torch.float32`` (keyword only, as cross_entropy's) a float32 loss
(transformers' loss upcasts the logits): the kernels compute it in float32 anyway. hidden, weight and bias are
differentiable.

Tiers. Eager (the reference) is F.linear then F.cross_entropy on float32 logits: it materializes the [N, V] logits
(and their float32 copy, and in training a gradient of the same size). The Triton and CUDA tiers never hold [N, V]:
they walk the tokens in chunks of ``chunk`` rows; per chunk the logits [chunk, V] come from one GEMM accumulated and
written in float32 (``torch.mm`` / cuBLAS: the tier is the fused loss around the GEMM, not the GEMM), and a kernel
makes each row's log-sum-exp by an online softmax and its loss. A scalar loss ("mean", "sum") called with a
gradient wanted (grad mode on, an input requiring grad) gets its gradients in the forward, as Liger's fused linear
cross-entropy does: per chunk, a kernel turns the logits at hand into dlogits for an output gradient of 1, and two
GEMMs write dhidden's rows and add the chunk's share of dweight (float32 accumulator); dbias sums dlogits' rows: 3
GEMMs a chunk. The forward then holds dhidden [N, H] (hidden's dtype), the float32 dweight [V, H] (and dbias [V])
until the backward, which only scales them by the output gradient (double backward is refused, as before). Otherwise
(reduction "none"; inference, which computes and holds nothing more) only the float32 lse [N] is saved, and the
backward recomputes each chunk's logits (one GEMM more), makes the dlogits and the same two GEMMs. Peak memory beyond
the inputs and gradients: the float32 dweight accumulator and dhidden, with, recomputing, the float32 logits and the
dlogits of one chunk; with the gradients in the forward, the chunk's float32 logits (its dlogits written over them,
where V % 8 == 0) and one eighth of a float32 [V, H] product.
The chunk (rows per GEMM) is the tier's tuned parameter: ``triton`` and ``cuda`` run chunks of ``CHUNK`` rows, and
each of ``CHUNK_VARIANTS`` is one more registered candidate of both tiers (``triton_c1024``, ...), so the measurement
(or the ``memory`` policy under a budget) picks the chunk. The vocabulary is not split: a chunk's rows are whole.

Targets outside [0, V) that are not ignore_index: a ValueError naming target on the CPU; NaN loss (and gradients) on
a GPU, as cross_entropy's kernels give.

Problem: hidden's shape [N, H] and the parameters ``vocab`` (V; 128 unless given), ``head_bias`` (whether the head has
a bias), ``reduction``, ``label_smoothing`` and ``ignored`` (the fraction of ignored targets: data, not a call
argument).
Bucket: (tokens rounded up to a power of two, H, V, bias?, reduction, label_smoothing > 0).
Bytes: read hidden, weight (and bias) and targets once, write the loss (the GEMM's flops dominate; bytes are the
floor). Backward: read hidden, weight, targets, lse, write dhidden and dweight (and dbias).
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch._C import _functions

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import LOW_PRECISION, call, floating, gen, randn, same_device, tensor, values
from .cross_entropy import REDUCTIONS, check_targets

OP = "linear_cross_entropy"
VOCAB = 128  # a problem's vocabulary where none is given (small: the generic tests' problems are [N, H] shapes)
CHUNK = 4096  # rows per chunk of the standard triton and cuda candidates
CHUNK_VARIANTS = (("c1024", {"chunk": 1024}), ("c16384", {"chunk": 16384}))


def validate(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
             ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
             dtype: torch.dtype | None = None) -> None:
    """The contract of a call (every tier): shapes, dtypes, devices and options (errors name the argument)."""
    floating(OP, "hidden", hidden)
    floating(OP, "weight", weight)
    floating(OP, "bias", bias, optional=True)
    if hidden.dim() != 2:
        raise ValueError(f"{OP}: hidden must have shape [N, H], got {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{OP}: weight must have shape [V, H] = [V, {hidden.shape[1]}] with V >= 1 for hidden of "
                         f"shape {list(hidden.shape)}, got {list(weight.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{OP}: {name} must have hidden's dtype {hidden.dtype}, got {t.dtype}")
        if t is not None:
            same_device(OP, name, t, hidden, "hidden")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{OP}: bias must have shape [V] = [{weight.shape[0]}], got {list(bias.shape)}")
    tensor(OP, "target", target)
    if target.dtype != torch.int64:
        raise TypeError(f"{OP}: target must have dtype int64 (class indices), got {target.dtype}")
    if tuple(target.shape) != (hidden.shape[0],):
        raise ValueError(f"{OP}: target must have shape [N] = [{hidden.shape[0]}] for hidden of shape "
                         f"{list(hidden.shape)}, got {list(target.shape)}")
    same_device(OP, "target", target, hidden, "hidden")
    _check_args(reduction, label_smoothing)
    if dtype is not None and dtype not in (torch.float32, hidden.dtype):
        raise ValueError(f"{OP}: dtype must be None, torch.float32 or hidden's dtype ({hidden.dtype}), got {dtype!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{OP}: ignore_index must be an int, got {ignore_index!r} ({type(ignore_index).__name__})")


def _check_args(reduction: str, label_smoothing: float) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{OP}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{OP}: label_smoothing must be in [0, 1], got {label_smoothing}")


def check_values(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 dtype: torch.dtype | None = None) -> None:
    """Targets in [0, V) or ignore_index, read where that costs no device sync (CPU, outside a compiled trace)."""
    if target.device.type == "cpu" and not torch.compiler.is_compiling():
        try:
            check_targets(target, weight.shape[0], ignore_index)
        except ValueError as e:
            raise ValueError(str(e).replace("cross_entropy:", f"{OP}:", 1)) from None


def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
              ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """Eager tier and reference: the logits by F.linear (materialized, [N, V]), then F.cross_entropy on them in
    float32 (float64 stays float64), the loss in ``dtype`` (None: hidden's; float64, the gate's, stays float64)."""
    if target.device.type != "cpu" or torch.compiler.is_compiling():
        bad = ((target < 0) | (target >= weight.shape[0])) & (target != ignore_index)
        torch._assert_async(~bad.any(), f"{OP}: a target is outside [0, V) and is not ignore_index")
    out = hidden.dtype if dtype is None or hidden.dtype == torch.float64 else dtype
    logits = F.linear(hidden, weight, bias)
    x = logits.float() if logits.dtype in LOW_PRECISION else logits
    return F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing).to(out)


def _problem(shape: tuple[int, ...], vocab: int = VOCAB, head_bias: bool = False, reduction: str = "mean",
             label_smoothing: float = 0.0, ignored: float = 0.0) -> Problem:
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"{OP}: the shape is hidden's [N, H] with H >= 1, got {list(shape)}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{OP}: vocab (V, the LM head's outputs) must be an int >= 1, got {vocab!r}")
    _check_args(reduction, label_smoothing)
    if not 0.0 <= float(ignored) <= 1.0:
        raise ValueError(f"{OP}: ignored (the fraction of ignored targets) must be in [0, 1], got {ignored}")
    return make_problem(shape, vocab=vocab, head_bias=bool(head_bias), reduction=reduction,
                        label_smoothing=float(label_smoothing), ignored=float(ignored))


def _problem_of(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                dtype: torch.dtype | None = None) -> Problem:
    return _problem(tuple(hidden.shape), int(weight.shape[0]), bias is not None, reduction, label_smoothing)


def _bucket(p: Problem) -> tuple:
    n, h = p.shape
    return pow2_ceil(n), h, p.kw["vocab"], p.kw["head_bias"], p.kw["reduction"], p.kw["label_smoothing"] > 0


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    (n, h), v = p.shape, p.kw["vocab"]
    hidden = randn((n, h), dtype, device, g)
    # logits of std ~2, like a trained LM head's: a few classes stand out, none dominates every row
    weight = (randn((v, h), torch.float32, device, g) * (2.0 / h ** 0.5)).to(dtype)
    bias = (0.5 * randn((v,), torch.float32, device, g)).to(dtype) if p.kw["head_bias"] else None
    target = torch.randint(0, v, (n,), generator=g, device=device, dtype=torch.int64)
    k = round(p.kw["ignored"] * n)
    if k:
        target[torch.randperm(n, generator=g, device=device)[:k]] = -100
    return Inputs((hidden, weight, target, bias, -100, p.kw["reduction"], p.kw["label_smoothing"]))


def _bytes(p: Problem, dt: torch.dtype) -> int:
    (n, h), v = p.shape, p.kw["vocab"]
    out = n if p.kw["reduction"] == "none" else 1
    return (n * h + v * h + v * p.kw["head_bias"] + out) * dt.itemsize + 8 * n


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    (n, h), v = p.shape, p.kw["vocab"]
    return 2 * (n * h + v * h + v * p.kw["head_bias"]) * dt.itemsize + (8 + 4) * n


def _wants_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reduction: str) -> bool:
    """Whether the forward makes the gradients itself: a scalar loss whose inputs autograd records."""
    return reduction != "none" and torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))


def _kernel_args(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 dtype: torch.dtype | None = None, chunk: int = CHUNK) -> tuple:
    """The op's signature onto the kernel ops' schema (hidden, weight, target, bias?, int ignore_index, str reduction,
    float label_smoothing, ScalarType? dtype, int chunk, bool grads); ``chunk``, the rows per GEMM, is set by the
    registered candidate; ``grads`` (the gradients made in the forward) where the loss is a scalar and a gradient is
    wanted."""
    return (hidden, weight, target, bias, operator.index(ignore_index), reduction, float(label_smoothing), dtype,
            chunk, _wants_grads(hidden, weight, bias, reduction))


def _fake(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
          ignore_index: int, reduction: str, label_smoothing: float, dtype: torch.dtype | None, chunk: int,
          grads: bool) -> tuple[torch.Tensor, ...]:
    n, v = hidden.shape[0], weight.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=dtype or hidden.dtype)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    if not grads:
        none = hidden.new_empty((0,))
        return loss, lse, none, none.clone(), none.clone()
    return (loss, lse, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape, dtype=torch.float32),
            weight.new_empty((v,) if bias is not None else (0,), dtype=torch.float32))


def _bwd_fake(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
              bias: torch.Tensor | None, lse: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
              chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    db = weight.new_empty((weight.shape[0],) if bias is not None else (0,))
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format), db)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, weight, target, bias, ctx.ignore_index, ctx.reduction, ctx.label_smoothing, _, ctx.chunk, grads = inputs
    ctx.has_bias, ctx.grads = bias is not None, grads
    ctx.mark_non_differentiable(*output[1:])
    # no zeros made for the outputs without a gradient: the backward reads the loss's alone, and the zeros of the
    # forward's float32 dweight (with grads) would be one more [V, H] float32 at the step's peak
    ctx.set_materialize_grads(False)
    if grads:  # the gradients of an output gradient of 1, made by the forward: nothing else is needed
        ctx.save_for_backward(*output[2:])
    else:
        ctx.save_for_backward(hidden, weight, target, bias, output[1])


def _scaled(grad: torch.Tensor, dh: torch.Tensor, dw: torch.Tensor, db: torch.Tensor, has_bias: bool) -> tuple:
    """The forward's gradients times the output gradient, each rounded once to its input's dtype (dweight and dbias
    from their float32 accumulators). Double backward is not supported: with create_graph the results carry a
    gradient function that says so when reached (the recomputing path's backward op has no formula either)."""
    g = grad.float()
    out = [dh * g, torch.mul(dw, g, out=dw.new_empty(dw.shape, dtype=dh.dtype))]  # no float32 [V, H] product
    if has_bias:
        out.append(torch.mul(db, g).to(dh.dtype))
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        err = _functions.DelayedError(b"linear_cross_entropy: double backward is not supported by the triton and "
                                      b"cuda tiers (their gradients come from kernels, without a graph)", len(out))
        out = list(err(*[t.detach().requires_grad_() for t in out]))
    return tuple(out) if has_bias else (*out, None)


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor, *_stats: Any) -> tuple:
        if ctx.grads:
            dh, dw, db = _scaled(grad, *ctx.saved_tensors, ctx.has_bias)
        else:
            hidden, weight, target, bias, lse = ctx.saved_tensors
            dh, dw, db = bwd(grad, hidden, weight, target, bias, lse, ctx.ignore_index, ctx.reduction,
                             ctx.label_smoothing, ctx.chunk)
        return dh, dw, None, (db if ctx.has_bias else None), None, None, None, None, None, None

    return backward


def _target(*classes: int) -> torch.Tensor:
    return torch.tensor(classes, dtype=torch.int64)


BAD_INPUTS = (
    BadInput("target outside [0, V)", call(values(4, 8), values(10, 8), _target(1, 10, -100, 3)), ValueError,
             r"linear_cross_entropy: target\[1\] = 10 is outside \[0, 10\)",
             good=call(values(4, 8), values(10, 8), _target(1, 2, -100, 3)), devices=("cpu",)),
    BadInput("weight of another hidden size", call(values(4, 8), values(10, 7), _target(1, 2, 3, 4)), ValueError,
             r"linear_cross_entropy: weight must have shape \[V, H\] = \[V, 8\]"),
    BadInput("hidden 3-D", call(values(2, 2, 8), values(10, 8), _target(1, 2, 3, 4)), ValueError,
             r"linear_cross_entropy: hidden must have shape \[N, H\]"),
    BadInput("weight of another dtype", call(values(4, 8), values(10, 8, dtype=torch.float16), _target(1, 2, 3, 4)),
             TypeError, r"linear_cross_entropy: weight must have hidden's dtype"),
    BadInput("bias of another shape", call(values(4, 8), values(10, 8), _target(1, 2, 3, 4), values(9)), ValueError,
             r"linear_cross_entropy: bias must have shape \[V\] = \[10\]"),
    BadInput("target of 3 rows", call(values(4, 8), values(10, 8), _target(1, 2, 3)), ValueError,
             r"linear_cross_entropy: target must have shape \[N\] = \[4\]"),
    BadInput("target int32", call(values(4, 8), values(10, 8), _target(1, 2, 3, 4).int()), TypeError,
             r"linear_cross_entropy: target must have dtype int64"),
    BadInput("unknown reduction", call(values(4, 8), values(10, 8), _target(1, 2, 3, 4), None, -100, "avg"),
             ValueError, r"linear_cross_entropy: reduction must be"),
    BadInput("a loss dtype neither float32 nor hidden's",
             call(values(4, 8, dtype=torch.bfloat16), values(10, 8, dtype=torch.bfloat16), _target(1, 2, 3, 4),
                  dtype=torch.float16), ValueError, r"linear_cross_entropy: dtype must be None, torch.float32"),
    BadInput("label_smoothing above 1", call(values(4, 8), values(10, 8), _target(1, 2, 3, 4), label_smoothing=1.5),
             ValueError, r"linear_cross_entropy: label_smoothing must be in \[0, 1\]"),
)

SPEC = register_op(OpSpec(
    name=OP, reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes, bwd_bytes=_bwd_bytes, grad_args=(0, 1, 3), autograd=(_setup, _backward_for),
    bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 64), 1000),  # one token
        _problem((3, 33), 1001),  # odd H and V: masked tails
        _problem((2, 16), 20003),  # a row longer than one Triton block: the looped path
        _problem((9, 16), 64, ignored=1.0),  # every target ignored: mean NaN, gradients 0
        _problem((16, 32), 100, head_bias=True, ignored=0.25),  # a head with a bias, some ignored
        _problem((7, 16), 129, label_smoothing=0.1, ignored=0.25),  # label smoothing with ignored rows
        _problem((6, 16), 33, reduction="none", ignored=0.25),  # per-row losses
        _problem((6, 16), 33, reduction="sum", label_smoothing=0.2),  # summed
        _problem((0, 16), 16),  # empty: mean NaN
    ],
    default_problems=lambda dev: [
        _problem((8192, 4096), 128256), _problem((4096, 2048), 151936), _problem((8192, 2304), 256000, ignored=0.25),
    ] if dev == "cuda" else [_problem((64, 64), 4096), _problem((256, 128), 8000, ignored=0.25)],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, first_output=True,
    validate=validate, check_values=check_values, bad_inputs=BAD_INPUTS,
    variants=({}, {"reduction": "none"}, {"reduction": "none", "label_smoothing": 0.1}),
    kernel_variants=CHUNK_VARIANTS,
))
