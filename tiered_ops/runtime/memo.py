"""What the call path derives from the decision table, per exact call signature, so that a hit computes nothing
but its key: ``_calls`` (key -> the ``Selection`` it runs), ``_traced`` (a compiled-context key -> the name of what a
trace calls, ``hot.trace_fn``), ``_traced_buckets`` (a bucket -> the same, for a trace whose sizes are symbolic) and
``_hot`` (an eager call's C++ key -> what it runs).

These follow the table (``follow``, told of each publication): an entry goes once the decision it was made from (its
``Selection.key``) names another implementation, or once a publication that drops decisions leaves it out (an entry
made from no decision of the table, such as the eager tier run while the store fails, goes then too); the two keyed by
what does not name its decision (a C++ key, a bucket) are made again once anything went. ``cache_state`` and
``keep_unchanged`` carry what ``tune`` leaves unchanged through the empty table it records under, so a compiled
caller's guards on it hold.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..decide import table
from ..decide.decide import Selection
from ..registry import OpSpec, Problem, symbolic_size
from .hot import _TRACE_IMPLS

_calls: dict[tuple, Selection] = {}  # exact call signature -> Selection (the per-call fast path)
# a compiled-context call signature -> the name of what a trace of it calls (dispatch.py: ``prime_trace``)
_traced: dict[tuple, str] = {}
# (op, bucket, dtype, device, mode, mixed) -> the same, for a trace whose sizes are symbolic (dynamic shapes)
_traced_buckets: dict[tuple, str] = {}
_hot: dict[bytes, Callable[..., Any]] = {}  # an eager call's C++ key -> what it runs (dispatch.py)


def _decided(sel: Selection, decisions: table.DecisionTable) -> bool:
    """Whether ``sel`` is still what ``decisions`` says for its key (the same implementation), or where it holds no
    decision for it, whether ``decisions`` was published without dropping any."""
    now = decisions.get(sel.key) if sel.key is not None else None
    return now.impl.name == sel.impl.name if now is not None else not decisions.pruned


def follow(old: table.DecisionTable, new: table.DecisionTable) -> None:
    """A table was published: keep of each memo what still derives from it."""
    dropped = new.pruned
    for k, sel in list(_calls.items()):
        if not _decided(sel, new):
            _calls.pop(k, None)
            dropped = True
    for k in [k for k in _traced if k not in _calls]:
        _traced.pop(k, None)
    if dropped:
        _hot.clear()  # learnt again from the Python keys kept
        _traced_buckets.clear()  # primed again by the next eager calls


table.subscribe(follow)


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
        if _decided(old, now):
            _calls[k] = old
            if k in traced:
                _traced[k] = traced[k]
    # decisions' keys: (op, bucket, dtype, device, policy, calls, budget, mode, context); ``bucket_key``'s:
    # (op, bucket, dtype, device, mode, mixed)
    compiled = {(k[0], k[1], k[2], k[3], k[7]): sel.name for k, sel in now.items() if k[8] == "compiled"}
    for k, name in buckets.items():
        impl = _TRACE_IMPLS[name].name  # what the traced name calls (``hot.trace_fn``)
        if compiled.get(k[:5], impl) == impl:
            _traced_buckets.setdefault(k, name)
