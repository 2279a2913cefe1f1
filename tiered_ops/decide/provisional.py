"""Decisions made from timings taken on a busy machine: provisional until clean rows make them final.

A CPU timing taken while the machine was busy is stored with the reason ``contended: ...`` (``rows.CONTENDED``) and no
caller time, so no decision can use it. A choice among the other rows would be a choice by absence: the candidate
whose timing was spoiled may be the fastest, and where every row was spoiled the choice is "no correct timed
implementation: eager". So where any fresh candidate's newest row of a bucket is contended, the bucket's decision is
provisional: its record says why (``record["provisional"]``), the log says so once per process, and the bucket is
timed again once its back-off has passed (``envs.retime_s`` after the busy pass, doubling with each busy pass in a row,
up to ``BACKOFF_MAX`` x): by a later miss of this process (the cached decision is dropped then: ``schedule``), by
the background worker, or by the next process. A re-time measures every correct candidate again in one pass, one
after another under one claim (``claimed``), so the rows a final decision compares were taken side by side.
``decisions`` lists a store's decisions with the provisional ones marked (``tiered-ops decisions list``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .. import envs
from ..registry import OPS, Impl, OpSpec, Tier
from ..store.rows import contended, usable
from ..store.store import Store
from .packs import KEY, decision_rows
from .policy import choose

log = logging.getLogger(__name__)

BACKOFF_MAX = 32  # the back-off doubles with each busy pass in a row, up to this many times its first step
_timers: dict[tuple, threading.Timer] = {}
_told: set[tuple] = set()
_lock = threading.Lock()


def _candidates(spec: OpSpec, rows: list[dict], fresh: dict[str, Impl] | None = None) -> list[dict]:
    """The rows of ``rows`` (newest per implementation) of current implementations of ours (no peer); ``fresh``:
    their fresh implementations by name (``OpSpec.freshness``) where the caller has them."""
    fresh = spec.freshness(rows)[0] if fresh is None else fresh
    return [r for r in rows if r["impl"] in fresh and fresh[r["impl"]].tier != Tier.PEER]


def busy_rows(spec: OpSpec, rows: list[dict], fresh: dict[str, Impl] | None = None) -> list[dict]:
    """The candidates' newest rows that were timed on a busy machine (``fresh`` as ``_candidates``)."""
    return [r for r in _candidates(spec, rows, fresh) if contended(r)]


def note(spec: OpSpec, rows: list[dict], fresh: dict[str, Impl] | None = None) -> str | None:
    """Why a decision from ``rows`` (one bucket's newest row per implementation) is provisional, or None where every
    candidate's newest row is a clean one (or a failure, which no re-time changes); ``fresh`` as ``_candidates``."""
    cands = _candidates(spec, rows, fresh)
    busy = [r for r in cands if contended(r)]
    if not busy:
        return None
    clean = [r["impl"] for r in cands if usable(r)]
    first = str(busy[0]["reason"])
    return (f"provisional: the timings of {len(busy)} of {len(busy) + len(clean)} candidate(s) were taken on a busy "
            f"machine ({', '.join(r['impl'] for r in busy)}; {first}); "
            + (f"chosen among the clean one(s) ({', '.join(clean)}) until they are timed again"
               if clean else "nothing timed clean, eager until they are timed again"))


def busy_streak(store: Store, spec: OpSpec, key: tuple[str, str, str, str, str]) -> int:
    """How many busy passes in a row the bucket ``key`` (op, bucket, dtype, device key, mode) has had: the most
    contended rows any current candidate has since its last clean row."""
    op, bucket, dtype, device_key, mode = key
    streak: dict[str, int] = {}
    for r in store.rows(op=op, bucket=bucket, dtype=dtype, device_key=device_key, mode=mode):
        if spec.fresh_impl(r) is None:
            continue
        streak[r["impl"]] = streak.get(r["impl"], 0) + 1 if contended(r) else 0
    return max(streak.values(), default=0)


def retime_at(store: Store, spec: OpSpec, key: tuple[str, str, str, str, str], rows: list[dict],
              fresh: dict[str, Impl] | None = None) -> float | None:
    """When the bucket's busy rows are to be timed again (epoch seconds), or None where none of ``rows`` is busy
    (``fresh`` as ``_candidates``)."""
    busy = busy_rows(spec, rows, fresh)
    if not busy:
        return None
    n = max(1, busy_streak(store, spec, key))
    return max(float(r["timestamp"]) for r in busy) + envs.retime_s() * min(BACKOFF_MAX, 2 ** (n - 1))


def to_measure(store: Store, spec: OpSpec, key: tuple[str, str, str, str, str], rows: list[dict],
               now: float | None = None, fresh: tuple[dict[str, Impl], list[Impl]] | None = None,
               ) -> tuple[list[Impl], bool]:
    """(the implementations to measure for the bucket ``key`` on a miss, whether it is a re-time): the candidates
    without a fresh row; once a busy bucket's back-off has passed, those and every candidate whose newest row is
    correct and timed (clean or busy: timed again side by side). A failed candidate, or one that cannot be timed
    here (Triton on the CPU's interpreter), keeps its row. ``fresh``: ``spec.freshness(rows)`` where the caller has
    it."""
    found, missing = spec.freshness(rows) if fresh is None else fresh
    have = {r["impl"]: r for r in rows if r["impl"] in found}
    at = retime_at(store, spec, key, rows, found)
    if at is None or (time.time() if now is None else now) < at:
        return missing, False
    return missing + [i for i in spec.impls.values() if i.name in have and i.tier != Tier.PEER
                      and (usable(have[i.name]) or contended(have[i.name]))], True


def tell(key: tuple, why: str, at: float | None) -> None:
    """Log once per process and bucket that its decision is provisional, and when it is timed again."""
    with _lock:
        if key in _told:
            return
        _told.add(key)
    when = f"timed again in {max(0.0, at - time.time()):.0f} s or later" if at is not None else "timed again later"
    log.warning("tiered_ops: %s %s %s %s: decision %s; %s", *key[:3], key[4], why, when)


def schedule(key: tuple, at: float, drop: Callable[[], None]) -> None:
    """Call ``drop`` (which forgets the bucket's cached decisions, so the next call decides again and re-times what
    is due) at ``at``, on a daemon timer; one timer per bucket at a time."""
    def fire() -> None:
        with _lock:
            _timers.pop(key, None)
            _told.discard(key)
        drop()

    with _lock:
        if key in _timers:
            return
        t = threading.Timer(max(0.0, at - time.time()), fire)
        t.daemon = True
        _timers[key] = t
    t.start()


def provisional_decision(store: Store, spec: OpSpec, key: tuple[str, str, str, str, str], rows: list[dict], why: str,
                         tuning: bool, drop: Callable[[], None]) -> None:
    """A provisional decision of the bucket ``key`` made from ``rows``: said once in the log, and where this process
    tunes (``tuning``), ``drop`` (which forgets its cached decisions) is called when the bucket is due to be timed
    again, so the next call re-times it; where nothing stored is busy (another process's claim outlasted the wait),
    after the back-off's first step."""
    at = (retime_at(store, spec, key, rows) or time.time() + envs.retime_s()) if tuning else None
    tell(key, why, at)
    if at is not None:
        schedule(key, at, drop)


def cancel_all() -> None:
    """Stop every pending re-time timer of this process (tests; a process about to change stores)."""
    with _lock:
        timers = list(_timers.values())
        _timers.clear()
        _told.clear()
    for t in timers:
        t.cancel()


def decisions(store: Store, gpu: str | None = None, only_provisional: bool = False) -> list[dict[str, Any]]:
    """The store's eager-caller decisions under the ``fastest`` policy, one per (op, bucket, dtype, device, mode):
    the chosen implementation (None where nothing correct was timed clean), its caller time, and ``provisional``
    (why, or None: final). ``gpu`` as ``packs.decision_rows``."""
    by_key: dict[tuple, list[dict]] = {}
    for r in decision_rows(store, gpu):
        by_key.setdefault(tuple(r[k] for k in KEY), []).append(r)
    out = []
    for key, group in sorted(by_key.items()):
        spec = OPS[key[0]]
        cands = [dict(impl=r["impl"], tier=r["tier"], caller_us=r["caller_us"], first_call_s=r["first_call_s"])
                 for r in group if usable(r) and r["tier"] != Tier.PEER.label]
        best, why, _ = choose(cands, "fastest")
        busy = note(spec, group)
        if only_provisional and busy is None:
            continue
        out.append(dict(zip(KEY, key), chosen=best["impl"] if best else None,
                        caller_us=best["caller_us"] if best else None, reason=why, provisional=busy))
    return out
