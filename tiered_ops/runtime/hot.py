"""What a call signature runs once it is selected: ``hot_fn`` for the per-call paths of ``tiered_ops.<op>`` and of a
``select_backend`` callable, and the table of what a trace calls by name (``trace_fn``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..registry import Impl, OpSpec, run_promoted


def hot_fn(spec: OpSpec, impl: Impl, device: torch.device, mixed: bool) -> Callable[..., Any]:
    """What the hot path of ``tiered_ops.<op>`` calls for one call signature, validated on the slow path: the tier
    alone (``impl.unchecked``), and only what the key cannot hold on every call: the data checks where they cost no
    sync (``spec.check_values``, CPU tensors), a mix of floating dtypes promoted as torch does (``run_promoted``)."""
    fn = impl.unchecked
    if fn is None:
        return impl.fn
    values = spec.check_values if device.type == "cpu" else None
    if mixed:
        def promoted(*args: Any, **kwargs: Any) -> Any:
            if values is not None:
                values(*args, **kwargs)
            return run_promoted(spec, fn, args, kwargs)
        return promoted
    if values is not None:
        def checked_values(*args: Any, **kwargs: Any) -> Any:
            values(*args, **kwargs)
            return fn(*args, **kwargs)
        return checked_values
    return fn


# what a trace of a compiled-context call signature calls, by name (dispatch.py: ``prime_trace``)
_TRACE_FNS: dict[str, Callable[..., Any]] = {}
_TRACE_IMPLS: dict[str, Impl] = {}


def trace_fn(spec: OpSpec, impl: Impl, device: torch.device, mixed: bool) -> str:
    """The name under which ``_TRACE_FNS`` keeps what a trace calls for ``impl`` (``hot_fn``'s function, made once
    per op, implementation, CPU or not, and dtype mix; again where the op's implementation of that name changed)."""
    name = f"{spec.name}:{impl.name}:{'cpu' if device.type == 'cpu' else 'gpu'}:{int(mixed)}"
    if _TRACE_IMPLS.get(name) is not impl:
        _TRACE_FNS[name], _TRACE_IMPLS[name] = hot_fn(spec, impl, device, mixed), impl
    return name


# the tiers whose code in a trace is the op's plain torch decomposition: eager, and compile (``tiers.Compiled`` calls
# the eager function while dynamo traces: the caller's graph takes it in)
DECOMPOSED = ("eager", "compile")


def decomposition(name: str) -> bool:
    """Whether the traced name ``trace_fn`` gave runs the op's plain torch decomposition with no promotion."""
    parts = name.split(":")
    return parts[1] in ("eager", "compile") and parts[3] == "0"  # DECOMPOSED, a literal: traced, no guard reads it
