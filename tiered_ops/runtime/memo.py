"""What the call path derives from the decision table, per exact call signature, so that a hit computes nothing
but its key: ``_calls`` (key -> the ``Selection`` it runs), ``_traced`` (a compiled-context key -> the name of what a
trace calls, ``hot.trace_fn``), ``_traced_buckets`` (a bucket -> the same, for a trace whose sizes are symbolic) and
``_hot`` (an eager call's C++ key -> what it runs).

These are derived from the table (``table.derived``: kept by its rules at each publication): an entry goes once
the decision it was made from (its ``Selection.key``) names another implementation, or once a publication that drops
decisions leaves it out (an entry made from no decision of the table, such as the eager tier run while the store
fails, goes then too); the two keyed by what does not name its decision (a C++ key, a bucket) are made again once
anything went. The two a trace reads (``_traced``, ``_traced_buckets``) keep a key that went, as None: another
thread's publication may land between a trace's read and the guard dynamo builds on it. A memo past its bound starts
over (``remember``). ``cache_state`` and ``keep_unchanged`` carry what
``tune`` leaves unchanged through the empty table it records under, so a compiled caller's guards on it hold.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..decide import table
from ..decide.decide import Selection
from ..registry import OpSpec, Problem, symbolic_size
from .hot import _TRACE_IMPLS

_hot: dict[bytes, Callable[..., Any]] = {}  # an eager call's C++ key -> what it runs (dispatch.py)
# (op, bucket, dtype, device, mode, mixed) -> the name of what a trace calls, for a trace whose sizes are symbolic
_traced_buckets: dict[tuple, str | None] = {}
# a compiled-context call signature -> the name of what a trace of it calls (dispatch.py: ``prime_trace``); None: no
# longer primed (the key stays for a trace building its guard on it: ``table.derived``)
_traced: dict[tuple, str | None] = {}
# exact call signature -> Selection (the per-call fast path); the others are made from its entries
_calls: dict[tuple, Selection] = table.derived("impl", clear=(_hot,), blank=(_traced_buckets,), trim=(_traced,))


def remember(key: tuple, sel: Selection) -> None:
    """A call signature's selection, kept for its next calls (``table.put``: the memos made from the call
    signatures start over with it past the bound)."""
    table.put(_calls, key, sel, _hot, _traced)


def symbolic_key(key: tuple) -> bool:
    """Whether a traced call's key holds a size that dynamo keeps symbolic (a dynamic dimension). Such a key is never
    looked up (hashing it would specialize each size, so each new shape would compile a graph of its own): the
    decision is found by the call's bucket, whose computation dynamo turns into range guards (``dispatch``)."""
    return any(symbolic_size(d) for part in key if isinstance(part, torch.Size) for d in part)


def bucket_key(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, mixed: bool
               ) -> tuple:
    """The key of ``_traced_buckets``: what an eager call primes and a trace with symbolic sizes reads."""
    return spec.name, spec.bucket(problem), dtype, device, mode, mixed


_State = tuple[table.DecisionTable, dict[tuple, Selection], dict[tuple, str], dict[tuple, str]]


def cache_state() -> _State:
    """The table in force and copies of the per-call memos, for ``keep_unchanged`` after an empty table."""
    return table.current(), dict(_calls), dict(_traced), dict(_traced_buckets)


def keep_unchanged(state: _State) -> None:
    """After an empty table was published and some decisions made again (``tune``): the decisions not made again are
    published back, and each call selection whose decision still names the same implementation comes back as the
    same object (with its traced name), so a compiled caller's guards on it hold (its next call would recompile
    otherwise); so does each traced bucket whose compiled decision names the implementation it calls."""
    decisions, calls, traced, buckets = state
    now = table.current()
    now = table.publish(add={k: sel for k, sel in decisions.items() if k not in now})
    for k, old in calls.items():
        if table.decided(old, now, "impl"):
            _calls[k] = old
            if traced.get(k) is not None:
                _traced[k] = traced[k]
    # decisions' keys: (op, bucket, dtype, device, mode, context); ``bucket_key``'s: (op, bucket, dtype, device, mode,
    # mixed)
    compiled = {k[:5]: sel.name for k, sel in now.items() if k[5] == "compiled"}
    for k, name in buckets.items():
        if name is None:
            continue
        impl = _TRACE_IMPLS[name].name  # what the traced name calls (``hot.trace_fn``)
        if compiled.get(k[:5], impl) == impl and _traced_buckets.get(k) is None:
            _traced_buckets[k] = name
