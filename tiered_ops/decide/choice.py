"""The choice among an op's stored rows under a policy, and the float64 gate of a choice read from another
dtype's measurements before it is returned; before it, the stored rows as a caller in each context pays them
(``registry.CONTEXTS``): measured inside a compiled caller where every implementation has such a row (read beside
the bucket's own rows by ``decide``, measured where missing by ``claimed.measure_compiled``), else the eager rows read
for the context (``in_context``, ``measured_compiled``).

Decisions made from timings taken on a busy machine: provisional until clean rows make them final.

A CPU timing taken while the machine was busy is stored with the reason ``contended: ...`` (``rows.CONTENDED``) and no
caller time, so no decision can use it. A choice among the other rows would be a choice by absence: the candidate
whose timing was spoiled may be the fastest, and where every row was spoiled the choice is "no correct timed
implementation: eager". So where any fresh candidate's newest row of a bucket is contended, the bucket's decision is
provisional: its record says why (``record["provisional"]``), the log says so once per process, and the bucket is
timed again once its back-off has passed (``envs.retime_s`` after the busy pass, doubling with each busy pass in a row,
up to ``BACKOFF_MAX`` x): by a later miss of this process (the cached decision is dropped then: ``schedule``), by
the background worker, or by the next process. A re-time measures every correct candidate again in one pass, one
after another under one claim (``claimed``), so the rows a final decision compares were taken side by side.
``packs.decisions`` lists a store's decisions with the provisional ones marked (``tiered-ops decisions list``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from .. import envs
from ..measure.gate import gate
from ..registry import DTYPE_NAMES, GRAD_MODES, Impl, OpSpec, Problem, Tier
from ..store.rows import UNGATED, caller_range, contended, from_pack, prune_bar, ungated, usable, waits_for_gate
from ..store.store import Store
from .policy import choose

log = logging.getLogger(__name__)
_busy_log = logging.getLogger(__package__ + ".provisional")  # a provisional decision's lines


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


def _decide(spec: OpSpec, rows: list[dict], dtype: torch.dtype, device: torch.device, policy: str,
            calls: int | None, store: Store, budget: int | None = None, fresh: dict[str, Impl] | None = None,
            runs: dict[str, str | None] | None = None) -> tuple[Impl, str, list]:
    """Choose among the correct fresh timed implementations under ``policy``; (impl, reason, candidates).
    ``fresh``: the rows' fresh implementations by name (``OpSpec.freshness``, one row per implementation) where the
    caller has them; ``runs``: ``Impl.why_not(device, dtype)`` of those among them that could be chosen
    (``runnable``), where the caller asked; the others are asked here."""
    cands, ok = [], []
    for r in rows:
        impl = spec.fresh_impl(r) if fresh is None else fresh.get(r["impl"])
        is_fresh = impl is not None
        c = {k: r.get(k) for k in ("impl", "tier", "caller_us", "p50_us", "p20_us", "p80_us", "host_us", "host_p80_us",
                                   "gbps", "frac_copy", "rel_error", "ok", "reason", "first_call_s", "peak_bytes")
             } | {"fresh": is_fresh}
        if r.get("predicted"):  # a time predicted at another shape: its kernel time there, for the policy's tie rule
            c |= {"predicted": True, "kernel_us": r.get("kernel_us")}
        if is_fresh and r["ok"] and r["caller_us"] is not None and not r.get("predicted"):
            c["lo"], c["hi"] = caller_range(r)  # a time predicted at another shape has no measured spread
        if is_fresh and impl.tier == Tier.CUDA and policy == "cold-start":
            meta = store.get_meta(spec.name, impl.name, r["device_key"], impl.source_hash) or {}
            c["build_s"] = meta.get("build_s_extension")
        cands.append(c)
        if (is_fresh and impl.tier != Tier.PEER and r["ok"] and r["caller_us"] is not None
                and (runs[impl.name] if runs is not None and impl.name in runs else impl.why_not(device, dtype))
                is None):
            ok.append(c)  # a peer is measured for comparison, never chosen
    best, reason, totals = choose(ok, policy, calls, budget=budget)
    for c in cands:
        c["policy_figure"] = totals.get(c["impl"]) if c in ok else None
    if best is None:
        return spec.impls["eager"], f"{reason}: eager", cands
    return spec.impls[best["impl"]], reason, cands


def _gated(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, rows: list[dict],
           how: tuple, decided: tuple[Impl, str, list], fresh: dict[str, Impl] | None = None,
           runs: dict[str, str | None] | None = None) -> tuple[Impl, str, list]:
    """A decision read from another dtype's measurements, gated at the requested dtype before it is returned.

    Nothing returns an implementation that never passed the float64 gate at the requested dtype: the choice is
    gated now at ``problem`` (the gate alone, no timing; cached per implementation, dtype and device like every
    gate), and one that fails is struck and the choice made again among the rest, eager last (``fresh`` as
    ``_decide``, and ``runs``)."""
    policy, calls, store, budget = how
    impl, reason, cands = decided
    failed: list[str] = []
    while True:
        _, why = gate(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES)
        if why is None:
            break
        failed.append(f"{impl.name} failed the gate at {DTYPE_NAMES[dtype]}: {why}")
        log.warning("%s %s %s: %s", spec.name, problem, DTYPE_NAMES[dtype], failed[-1])
        rows = [r for r in rows if r["impl"] != impl.name]
        if impl.name == "eager":
            break  # nothing left that passes: eager, with the failures on record
        impl, reason, cands = _decide(spec, rows, dtype, device, policy, calls, store, budget, fresh, runs)
    gated = f"gated at {DTYPE_NAMES[dtype]} on first use" + (f" ({'; '.join(failed)})" if failed else "")
    return impl, f"{reason}; {gated}", cands


def choose_gated(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
                 rows: list[dict], how: tuple, fresh: dict[str, Impl] | None, gate: bool,
                 runs: dict[str, str | None] | None = None) -> tuple[Impl, str, list]:
    """The policy's choice among ``rows`` (``_decide``; ``how``: policy, calls, store, budget; ``fresh`` and ``runs``
    as there), gated at ``problem`` first (``_gated``) where ``gate`` says so (rows of another bucket) or the chosen
    row came from a decision pack."""
    decided = _decide(spec, rows, dtype, device, *how, fresh, runs)
    if gate or any(from_pack(r) for r in rows if r["impl"] == decided[0].name):
        return _gated(spec, problem, dtype, device, mode, rows, how, decided, fresh, runs)
    return decided


def runnable(rows: list[dict], fresh: dict[str, Impl]) -> list[Impl]:
    """The implementations of ``rows`` that ``_decide`` could choose but for the device and dtype (fresh, no peer,
    correct and timed): those it asks ``Impl.why_not`` of, which its caller may ask first and pass as ``runs``."""
    return [impl for r in rows if r.get("ok") and r.get("caller_us") is not None  # a row missing either: not chosen
            and (impl := fresh.get(r["impl"])) is not None and impl.tier != Tier.PEER]


# The tiers timed before their gate, which then runs only where a choice would name the candidate (``next_gate``):
# their gate compiles a kernel per edge problem, seconds that a candidate slower than another correct one never needs.
GATED_LAST = {Tier.TRITON, Tier.COMPILE}
# The order a bucket's candidates are measured in: the tiers whose gate compiles nothing first, so a gated, timed
# choice is known within seconds (and sets the bar that prunes the slower candidates after it); the compiled tiers
# (their edge problems compile one kernel each) after.
MEASURE_ORDER = {Tier.EAGER: 0, Tier.CUDA: 1, Tier.PEER: 2, Tier.TRITON: 3, Tier.COMPILE: 4}


def pruning(impl: Impl, rows: list[dict], factor: float | None) -> dict[str, Any]:
    """How a blocking tune measures ``impl`` after ``rows`` (the bucket's stored rows and those measured so far), as
    background tuning and the sweep measure (successive halving): a short timing first, the rest skipped where it
    lies clearly above ``factor`` x the fastest full timing so far (``rows.prune_bar``), so a pruned candidate costs
    no gate; a compiled tier (``GATED_LAST``) is timed without its gate, which runs afterwards only where a choice
    would name it (``GateTurns``)."""
    bar = prune_bar(rows, factor)
    kw: dict[str, Any] = dict(prune_above_us=bar[0], best=bar[1], gate_first=False) if bar is not None else {}
    if impl.tier in GATED_LAST:
        kw.update(gated=False, gate_first=False)
    return kw


def busy_stamped(rows: list[dict], end: float) -> list[dict]:
    """``rows`` (one pass of a tune) with those timed on a busy machine stamped ``end``: a busy row's back-off counts
    from the end of its pass, not from its start."""
    return [dict(r, timestamp=end) if contended(r) else r for r in rows]

def next_gate(spec: OpSpec, rows: list[dict], dtype: torch.dtype, device: torch.device, store: Store,
              policies: tuple[str, ...] = ("fastest",)) -> tuple[Impl | None, str, dict[str, dict]]:
    """Which gate runs next among one case's newest ``rows``, counting each row timed without its gate as correct:
    (the first choice among ``policies`` that names one of those, its reason, the rows timed without their gate).
    Where no policy names one, the first policy's choice (a gated row, so nothing to gate); (None, "", {}) where no
    row waits for its gate."""
    waiting = {r["impl"]: r for r in rows if ungated(r) and r.get("caller_us") is not None
               and spec.fresh_impl(r) is not None}
    if not waiting:
        return None, "", waiting
    if_correct = [dict(r, ok=1) if r["impl"] in waiting else r for r in rows]
    first: tuple[Impl, str] | None = None
    for policy in policies:
        impl, reason, _ = _decide(spec, if_correct, dtype, device, policy, None, store)
        if impl.name in waiting:
            return impl, reason, waiting
        first = first or (impl, reason)
    assert first is not None, "next_gate: no policy given"
    return first[0], first[1], waiting


def never_chosen(row: dict, chosen: str) -> dict:
    """``row`` (timed without its gate) as stored once a choice passed it over: not ok, never gated."""
    return dict(row, ok=0, reason=f"{UNGATED}timed; {chosen}, correct, is chosen over it: its gate never ran "
                                  "(never chosen)")


class GateTurns:
    """The gates of one case, in turn: each candidate timed without its gate that a choice among ``policies`` would
    name if it were correct (``next_gate``). ``next(rows)``, given the case's newest rows (read again after each
    gate), says which to gate next, or None when done; a candidate is gated once (a gated row that comes back not
    fresh here, built in another environment, is not asked for again). Once every choice names a gated row, the rows
    still waiting are in ``passed_over``, as never chosen, for the caller to store. A caller that gates in its own
    loop asks this, and this never calls back into it."""

    def __init__(self, spec: OpSpec, dtype: torch.dtype, device: torch.device, store: Store,
                 policies: tuple[str, ...] = ("fastest",)) -> None:
        self.spec, self.dtype, self.device, self.store, self.policies = spec, dtype, device, store, policies
        self.tried: set[str] = set()
        self.passed_over: list[dict] = []

    def next(self, rows: list[dict]) -> tuple[Impl, dict, str, dict] | None:
        """(the implementation to gate, its row, the choice that names it, the rows waiting for their gate), or None
        when every choice names a gated row (``passed_over`` then holds the rows never chosen)."""
        impl, named_by, waiting = next_gate(self.spec, rows, self.dtype, self.device, self.store, self.policies)
        if impl is None or (impl.name in self.tried and impl.name in waiting):
            return None
        if impl.name not in waiting:
            self.passed_over = [dict(never_chosen(r, impl.name), timestamp=time.time())
                                for r in waiting.values() if waits_for_gate(r)]
            return None
        self.tried.add(impl.name)
        return impl, waiting[impl.name], named_by, waiting


def gate_in_turn(spec: OpSpec, rows: Callable[[], list[dict]], run_gate: Callable[[Impl, dict, str, dict], bool],
                 keep: Callable[[dict], None], dtype: torch.dtype, device: torch.device, store: Store,
                 policies: tuple[str, ...] = ("fastest",), stopping: Callable[[], bool] = lambda: False) -> bool:
    """``GateTurns`` driven by callbacks: ``rows()`` read before each turn, ``run_gate(impl, row, named_by, waiting)``
    gates and stores it, False to stop (the caller gave up on the case); each row passed over is given to ``keep``.
    True when done, False when stopped."""
    turns = GateTurns(spec, dtype, device, store, policies)
    while not stopping():
        turn = turns.next(rows())
        if turn is None:
            for r in turns.passed_over:
                keep(r)
            return True
        if not run_gate(*turn):
            return False
    return False


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
    _busy_log.warning("tiered_ops: %s %s %s %s: decision %s; %s", *key[:3], key[4], why, when)


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
