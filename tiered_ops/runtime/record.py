"""Recording the tiered_ops calls of a real step: which (op, problem, dtype, mode, device) a model asks for.

    with Recorder(context="eager") as rec:
        model(x)                      # every call signature that takes the dispatch slow path is noted
    rec.calls                         # [RecordedCall(op, problem, dtype, mode, device, context, count), ...]

The per-call dispatch (``select.dispatch``, the slow path taken once per exact call signature) calls ``note``
while a recorder is active; with none active it costs one truth test of a list. Clear the call cache first
(``tiered_ops.clear_cache()``) so that every signature takes the slow path once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..registry import DTYPE_NAMES, OpSpec, Problem

_active: list[Recorder] = []  # recorders in effect, innermost last
_lock = threading.Lock()


@dataclass
class RecordedCall:
    """One distinct call: the op, its problem (shape and parameters), dtype, mode, device and context."""

    op: str
    problem: Problem
    dtype: torch.dtype
    mode: str
    device: torch.device | None
    context: str | None
    count: int = 1  # how many times the slow path saw it (1 unless the call cache was cleared meanwhile)
    # the exact call signatures seen (``tiered_ops.<op>``'s key without its context, and whether the call mixes
    # floating dtypes): what a later trace of the same calls looks up
    signatures: set[tuple[tuple, bool]] = field(default_factory=set, compare=False, repr=False)

    @property
    def key(self) -> tuple:
        return self.op, self.problem, self.dtype, self.mode, self.device

    def __str__(self) -> str:
        return f"{self.op} {self.problem} {DTYPE_NAMES.get(self.dtype, self.dtype)} {self.mode}"


class Recorder:
    """Collects the distinct tiered_ops calls made while it is active (a context manager; nesting is allowed:
    every active recorder sees every call)."""

    def __init__(self, context: str | None = None) -> None:
        self.context = context
        self._calls: dict[tuple, RecordedCall] = {}

    @property
    def calls(self) -> list[RecordedCall]:
        return list(self._calls.values())

    def add(self, spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str,
            device: torch.device | None = None, context: str | None = None,
            signature: tuple[tuple, bool] | None = None) -> None:
        """One call; its context is the recorder's where it names one (the context the model will run in), else
        the one the call was made in."""
        call = RecordedCall(spec.name, problem, dtype, mode, device, self.context or context)
        seen = self._calls.get(call.key)
        if seen is None:
            self._calls[call.key] = seen = call
        else:
            seen.count += 1
        if signature is not None:
            seen.signatures.add(signature)

    def __enter__(self) -> Recorder:
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            if self in _active:
                _active.remove(self)


def active() -> bool:
    return bool(_active)


def note(spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str, device: torch.device | None = None,
         context: str | None = None, signature: tuple[tuple, bool] | None = None) -> None:
    """Tell every active recorder about one call made in ``context`` (the dispatch slow path calls this, with the
    call's exact ``signature``: its key without the context, and whether it mixes floating dtypes)."""
    if torch.compiler.is_compiling():
        return  # a traced call is no call of a real step
    for rec in list(_active):
        rec.add(spec, problem, dtype, mode, device, context, signature)
