"""The stored rows as a caller in each context pays them (``registry.CONTEXTS``): measured inside a compiled
caller where every implementation has such a row (read beside the bucket's own rows by ``decide``, measured where
missing by ``claimed.measure_compiled``), else the eager rows read for the context."""

from __future__ import annotations

from ..registry import GRAD_MODES, Tier

# The tiers whose code a compiled caller's graph takes in (Inductor fuses it with the op's neighbours there); the
# kernel tiers are opaque to Inductor, a launch of their own between the neighbours' kernels.
TRACED = (Tier.EAGER, Tier.COMPILE)
_TRACED_LABELS = frozenset(t.label for t in TRACED)


def in_context(rows: list[dict], context: str) -> tuple[list[dict], str]:
    """The rows as a caller in ``context`` pays them, and what that means for the record. ``eager``: the larger of
    kernel and host time (the launch path from Python), as measured. ``graphed`` (inside CUDA-graph capture or
    reduce-overhead): nothing is launched from Python on replay, so the kernel time with its p20-p80. ``compiled``
    (traced into a caller's torch.compile graph) without a measurement of the op amid its decoder neighbours in a
    compiled function: the traced tiers' rows alone (``TRACED``: a kernel tier's own time says nothing of what
    Inductor's fusion of the op with its neighbours saves, and measured there a traced tier is the fastest nearly
    everywhere), priced by their kernel time; every row where none of them has one. The record says which."""
    if context == "eager" or not rows:
        return rows, ""
    why = ("graphed caller (CUDA-graph replay): kernel times; " if context == "graphed" else
           "compiled caller: kernel times (no compiled-context measurement stored); ")
    if context == "compiled":
        traced = [r for r in rows if r.get("tier") in _TRACED_LABELS]
        if traced:
            rows, why = traced, ("compiled caller, no compiled-context measurement stored: the tiers traced into its "
                                 "graph (eager, compile), by kernel time; ")
    return by_kernel_time(rows), why


def by_kernel_time(rows: list[dict]) -> list[dict]:
    """The rows priced by their kernel time and its p20-p80 (no host figure); a CPU row keeps its time."""
    out = []
    for r in rows:
        kernel = r.get("kernel_us") if r.get("predicted") else r.get("p50_us")
        if kernel is None or r.get("device_key", "").startswith("cpu") or not r.get("ok"):
            out.append(r)  # a CPU row: its time is the call's, there is no launch path apart from it
            continue
        out.append(dict(r, caller_us=kernel, host_us=None, host_p80_us=None))
    return out


def measured_compiled(rows: list[dict], mode: str) -> tuple[list[dict], str]:
    """The compiled-context rows (each implementation measured in a small compiled function, amid the neighbours the op
    has in a decoder: ``measure.DECODER_NEIGHBOURS``) as a compiled caller pays them, and what that means for the
    record. Inference: as measured, the larger of kernel and host time (a decode step's graph is launch-bound, and a
    kernel tier adds launches that Inductor's fusion does not). Training (``GRAD_MODES``): by kernel time. The host
    work of a compiled training step is one forward and one backward call per graph (guards, the autograd wrapper,
    the backward's engine), running ahead of a GPU busy with the step; measured around one op, that per-graph work
    (hundreds of microseconds) is the whole host figure and hides the kernel times the step pays (tens)."""
    why = "compiled caller (measured in a compiled function amid its decoder neighbours): "
    if mode in GRAD_MODES:
        return by_kernel_time(rows), why + "training, by kernel time (the graph's host work is per step, not per op); "
    return rows, why
