"""What a call inside a CUDA-graph capture may run: an implementation is warm once it was called outside capture
at that problem with the call's flavour of tensors (a first call inside a capture may compile, autotune or
synchronize, which capture forbids). What is warm is published in the decision table (``table.current().warm``), like a
decision, and never dropped: it is what the process has compiled and loaded."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..registry import DTYPE_NAMES, GRAD_MODES, Impl, OpSpec, Problem, Tier
from . import table

log = logging.getLogger(__name__)


def capturable(device: torch.device) -> bool:
    """Whether calls on ``device`` can be captured into a CUDA graph (only there is warming needed)."""
    return device.type == "cuda"


def flavor(args: tuple, kwargs: dict[str, Any] | None = None) -> tuple:
    """What a compiled implementation's guards see of a call's tensors besides their shapes and dtypes: each one's
    type (a Parameter is not a Tensor to dynamo), requires_grad and strides. A warm-up with other flavours than the
    captured call (a copy of a weight that does not require grad) leaves the compile tier to recompile, and so to
    autotune and synchronize, inside the capture."""
    return tuple((type(a).__name__, a.requires_grad, tuple(a.stride())) for a in (*args, *(kwargs or {}).values())
                 if isinstance(a, torch.Tensor))


def is_warm(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
            how: tuple = ()) -> bool:
    return impl.tier == Tier.EAGER or (spec.name, impl.name, problem, dtype, device, mode, how) in table.current().warm


def mark_warm(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
              mode: str, how: tuple = ()) -> None:
    if capturable(device) and not is_warm(spec, impl, problem, dtype, device, mode, how):
        table.publish(warm=(spec.name, impl.name, problem, dtype, device, mode, how))


def warm(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
         args: tuple | None = None, kwargs: dict[str, Any] | None = None) -> None:
    """Call ``impl`` once outside capture (and its backward in a gradient mode) on copies of ``args``, or on the
    op's inputs at ``problem``, so that a later call inside a CUDA-graph capture finds it compiled and loaded.
    Only where capture exists (``capturable``); a failure is logged and leaves it cold (a capture then runs
    what is warm)."""
    grad = mode in GRAD_MODES
    if args is None:  # the op's own inputs, its differentiable ones requiring grad in a gradient mode
        args, kwargs = (lambda i: (i.args, i.kwargs))(spec.make_inputs(problem, dtype, device, 0))
        args = tuple(a.requires_grad_(grad and i in spec.grad_args and a.is_floating_point())
                     if isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
    else:
        kwargs = dict(kwargs or {})  # the call's keyword arguments too: a Triton constexpr (a norm form) is one
        if grad:  # copies (a backward into them leaves the caller's tensors alone), with the call's flavour
            args = tuple(_like(a) if isinstance(a, torch.Tensor) else a for a in args)
    how = flavor(args, kwargs)
    if (is_warm(spec, impl, problem, dtype, device, mode, how) or not capturable(device)
            or torch.compiler.is_compiling()
            or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        return
    try:
        with torch.set_grad_enabled(grad):
            out = impl.fn(*args, **kwargs)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)
                    and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 (a cold implementation is not run in capture; the call itself will say)
        log.warning("tiered_ops.%s: warming %s at %s %s failed (%s: %s); a CUDA-graph capture will not run it",
                    spec.name, impl.name, problem, DTYPE_NAMES[dtype], type(e).__name__, e)
        return
    mark_warm(spec, impl, problem, dtype, device, mode, how)


def _like(a: torch.Tensor) -> torch.Tensor:
    """A copy of ``a`` that a compiled implementation's guards cannot tell from it: same strides, requires_grad and
    Parameter-ness."""
    c = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a.detach())
    if isinstance(a, torch.nn.Parameter):
        return torch.nn.Parameter(c, requires_grad=a.requires_grad)
    return c.requires_grad_(a.requires_grad)
