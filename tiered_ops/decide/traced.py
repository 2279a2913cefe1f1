"""What traces of ``tiered_ops.<op>`` read beyond the per-call key: whether a call's sizes are symbolic (dynamic
shapes: its selection is then found by bucket, ``_traced_buckets``), and what ``tune`` keeps of the traced selections
through its clear (``cache_state``, ``keep_unchanged``). The priming itself is ``dispatch.prime_trace``."""

from __future__ import annotations

import torch

from ..registry import OpSpec, Problem, symbolic_size
from . import decide as _decide
from .decide import Selection, _calls, _traced, _traced_buckets
from .hot import _TRACE_IMPLS


def symbolic_key(key: tuple) -> bool:
    """Whether a traced call's key holds a size that dynamo keeps symbolic (a dynamic dimension). Such a key is never
    looked up (hashing it would specialize each size, so each new shape would compile a graph of its own): the
    decision is found by the call's bucket, whose computation dynamo turns into range guards (``dispatch``)."""
    return any(symbolic_size(d) for part in key if isinstance(part, torch.Size) for d in part)


def bucket_key(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, mixed: bool
               ) -> tuple:
    """The key of ``_traced_buckets``: what an eager call primes and a trace with symbolic sizes reads."""
    return spec.name, spec.bucket(problem), dtype, device, mode, mixed


_State = tuple[dict[tuple, Selection], dict[tuple, Selection], dict[tuple, str], dict[tuple, str]]


def cache_state() -> _State:
    """Copies of the decisions, the per-call cache, the traced names and the traced buckets, for ``keep_unchanged``
    after a clear."""
    return dict(_decide._decisions), dict(_calls), dict(_traced), dict(_traced_buckets)


def _decision_of(sel: Selection) -> tuple:
    r = sel.record
    return tuple(r.get(k) for k in ("op", "bucket", "dtype", "device", "mode", "context", "policy", "budget", "calls"))


def keep_unchanged(state: _State) -> None:
    """After the caches were cleared and some decisions made again (``tune``): the decisions not made again come
    back, and each cached call selection whose decision still names the same implementation comes back as the same
    object (with its traced name), so a compiled caller's guards on it hold (its next call would recompile
    otherwise); so does each traced bucket whose compiled decision names the implementation it calls."""
    decisions, calls, traced, buckets = state
    with _decide._lock:
        for k, old in decisions.items():
            _decide._decisions.setdefault(k, old)
        chosen = {_decision_of(sel): sel.name for sel in _decide._decisions.values()}
        for k, old in calls.items():
            if chosen.get(_decision_of(old), old.name) == old.name:
                _calls[k] = old
                if k in traced:
                    _traced[k] = traced[k]
        # decisions' keys: (op, bucket, dtype, device, policy, calls, budget, mode, context); ``bucket_key``'s:
        # (op, bucket, dtype, device, mode, mixed)
        compiled = {(k[0], k[1], k[2], k[3], k[7]): sel.name for k, sel in _decide._decisions.items()
                    if k[8] == "compiled"}
        for k, name in buckets.items():
            impl = _TRACE_IMPLS[name].name  # what the traced name calls (``hot.trace_fn``)
            if compiled.get(k[:5], impl) == impl:
                _traced_buckets.setdefault(k, name)
