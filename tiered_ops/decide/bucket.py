"""One queued bucket's measurement in background tuning's worker (``tune``): its candidates in an order that lands a
gated choice within seconds, each timed in the worker, the pruning bar of successive halving, the compiled tiers
gated only where they would be chosen, and each decision handed to the callers as it changes (``Job.landed_hook``).
The thread, its queue and its worker pool are ``background``'s; this module reaches them through the runner it is
given (``pool_for``, ``requeue``, ``queued``, ``stopping``, ``stores``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from .. import envs
from ..measure import recheck
from ..measure.case import EdgeGates
from ..measure.fingerprint import fingerprint
from ..measure.gate import edge_checks
from ..measure.measure import PRUNE_FACTOR, base_row
from ..measure.verdict import EDGES
from ..measure.worker import Pool
from ..registry import GRAD_MODES, Impl, OpSpec, Problem
from ..store.rows import prune_bar
from ..store.store import Store
from .choice import GATED_LAST, MEASURE_ORDER, _decide, gate_in_turn
from .helpers import FirstCalls, split_edges

log = logging.getLogger("tiered_ops.decide.background")  # one logger for background tuning, as its users expect

TRIES = 2  # a candidate whose worker dies or hangs this many times in a bucket is recorded as crashed or hung


@dataclass(eq=False)
class Job:
    """One queued bucket: (op, bucket, dtype name, device key, mode) and the call that asked first (its problem is
    the one measured, as blocking tuning measures the requested shape)."""

    key: tuple[str, str, str, str, str]
    spec: OpSpec
    problem: Problem
    dtype: torch.dtype
    device: torch.device
    mode: str
    impls: list[str]  # the implementations without a fresh row when it was queued
    target: str | None  # the store's path or URL for a connection of the thread's own; None: a store in memory
    landed_hook: Callable[[Job], None]
    calls: int = 0  # calls through its provisional selection (``counting``): the hottest is measured first
    deaths: dict[str, int] = field(default_factory=dict)
    measured: list[dict] = field(default_factory=list)  # every row measured, for a store in memory
    handed: int = 0  # how many of ``measured`` a landing handed to the caller's store (``unsaved``)
    landed: bool = False  # the last landing: every candidate measured
    took_s: float = 0.0
    landings: int = 0  # decisions handed to the callers so far (the last one when ``landed``)
    chosen: str | None = None  # what the last landing chose
    queued_at: float = field(default_factory=time.perf_counter)
    waited: bool = False  # a blocking call waits for it (``background.wait_for_job``): measured before the others
    failed: str | None = None  # why its measurement failed in the harness (it is not queued again)

    def unsaved(self) -> list[dict]:
        """The rows measured for a store in memory since the last call: the caller's thread adds them."""
        new, self.handed = self.measured[self.handed:], len(self.measured)
        return new

    def __str__(self) -> str:
        op, _, dname, _, mode = self.key
        return f"{op} {self.problem} {dname} {mode}"


class Runner(Protocol):
    """What ``tune`` needs of background tuning's runner."""

    stopping: bool
    pool: Pool | None
    stores: dict[str, Store]

    def pool_for(self, job: Job) -> Pool: ...

    def helpers_for(self, job: Job) -> list[Pool]: ...

    def requeue(self, job: Job) -> None: ...

    def queued(self) -> int: ...


CANDIDATE = "tiered_ops_candidate"  # the attribute of a candidate's log record that holds its figures (a dict)
LANDING = "tiered_ops_landing"  # the attribute of a landing's log record: op, problem, impl, seconds, final
WORKER_START = "(worker start)"  # the ``impl`` of the record that says how long the measurement worker took to start
GATE = " (gate)"  # appended to a candidate's name in the record of its gate run after its timing (``_gate_winner``)
EDGE_SHARES = " (edge checks)"  # ... and of its edge checks split over the gate helpers (``_split_edges``)
FIRST_ASIDE = " (first call aside)"  # ... and of its first call made in a gate helper beside the timings
def _said(job: Job, name: str, seconds: float, reply: Any, why: str | None) -> None:
    """Log one candidate's measurement: how long it took in the worker (its first call, compilation included, apart)
    and its outcome; the figures ride on the record as ``CANDIDATE`` for a handler that collects them."""
    first = reply.get("first_call_s") if isinstance(reply, dict) else None
    _say(job, name, seconds, first, why or (reply.get("reason") if isinstance(reply, dict) else None) or "timed")


def _say(job: Job, name: str, seconds: float, first: float | None, outcome: str) -> None:
    log.info("tiered_ops: background tuning of %s: %s took %.1f s (first call %s): %s", job, name, seconds,
             "-" if first is None else f"{first:.1f} s", outcome,
             extra={CANDIDATE: dict(op=job.key[0], problem=str(job.problem), impl=name, seconds=seconds,
                                    first_call_s=first, outcome=outcome)})


def said_start(job: Job | None, pool: Pool, seconds: float) -> None:
    """Log the worker's start, part by part (``Pool.start``); for ``job`` where a bucket waited for it."""
    parts = pool.info.get("start_parts", {}) if isinstance(pool.info, dict) else {}
    said = ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())
    if job is not None:
        _said(job, WORKER_START, seconds, None, f"started ({said})" if said else "started")
    else:
        log.info("tiered_ops: background tuning: a measurement worker on %s started in %.1f s (%s), before any "
                 "bucket was queued", pool.device, seconds, said,
                 extra={CANDIDATE: dict(op=None, problem=None, impl=WORKER_START, seconds=seconds, first_call_s=None,
                                        outcome=f"started before any bucket ({said})")})


def tune(me: Runner, job: Job) -> None:
    """Measure ``job``'s candidates not yet stored, land its decision as it changes, and the last time at the end."""
    spec, (op, bkey, dname, fkey, mode) = job.spec, job.key
    store, gates = None, None
    if job.target is not None:
        store = me.stores.get(job.target) or me.stores.setdefault(job.target, Store(job.target))
        have = {r["impl"] for r in store.latest(op, bkey, dname, fkey, mode) if spec.fresh_impl(r) is not None}
        gates = EdgeGates(store, spec, job.dtype, job.device, mode)  # the bucket's edge gates: one read, for all
    else:
        have = {r["impl"] for r in job.measured}
    todo = sorted((n for n in job.impls if n not in have and n in spec.impls),
                  key=lambda n: MEASURE_ORDER[spec.impls[n].tier])
    log.info("tiered_ops: background tuning %s on %s: measuring %s in a worker process; %d more queued", job,
             job.device, ", ".join(todo) or "nothing (measured meanwhile)", me.queued())
    t0 = time.perf_counter()
    started = me.pool_for(job).start() if todo else None  # said apart: not the first candidate's time
    if started is not None:
        said_start(job, me.pool, started)
    compiled = [n for n in todo if spec.impls[n].tier in GATED_LAST] if envs.first_calls_aside() else []
    aside = FirstCalls(me.helpers_for(job) if compiled else [], ("first_call", op), (job.problem, dname, mode),
                       compiled, str(job))
    try:
        if not _time_candidates(me, job, store, gates, todo, aside, t0):
            return
    finally:
        aside.join()  # the helpers serve the gates next
    if not _gate_winner(me, job, store, gates):
        return  # stopping, or the worker died during a gate: the bucket is queued again (its rows are kept)
    t1 = time.perf_counter()
    new, why = recheck.retime(spec, _rows(job, store), job.problem, job.dtype, job.device, mode,
                              lambda names: me.pool_for(job).run(("host", op, names, job.problem, dname, mode),
                                                                 f"{job} host side by side"))
    for row in new:  # launch-bound: the bucket's host times taken again side by side
        _keep(job, gates, row)
    if new or why:
        _say(job, "host side by side", time.perf_counter() - t1, None, why or recheck.summary(new))
    job.took_s += time.perf_counter() - t0
    _land(job, store, final=True)


def _time_candidates(me: Runner, job: Job, store: Store | None, gates: EdgeGates | None, todo: list[str],
                     aside: FirstCalls, t0: float) -> bool:
    """Time ``todo`` in the worker, in turn, landing the decision as it changes; False where the thread stops or the
    bucket was queued again (a candidate killed its worker). ``gates``: the bucket's edge gates (None: no store)."""
    spec, (op, _, dname, _, mode), fp = job.spec, job.key, fingerprint(job.device)
    for name in todo:
        if me.stopping:
            return False
        first = aside.wait(name)  # its compilation, made in a helper while the candidates before it were timed
        if first is not None:
            _say(job, name + FIRST_ASIDE, first, first, "first call in a gate helper, beside the timings")
        t1 = time.perf_counter()
        bar = prune_bar(_rows(job, store), PRUNE_FACTOR)
        kw = dict(prune_above_us=bar[0], best=bar[1], gate_first=False) if bar is not None else {}
        if spec.impls[name].tier in GATED_LAST:
            kw["gated"] = False
        edges = gates.known(spec.impls[name]) if gates is not None else None
        if edges is not None:
            kw["edges"] = edges  # a pass the store recorded: the worker does not check the edge problems again
        reply, why = me.pool_for(job).run(("measure", op, name, job.problem, dname, mode, kw), f"{job} {name}")
        if first is not None and isinstance(reply, dict) and reply.get("first_call_s") is not None:
            reply["first_call_s"] = max(reply["first_call_s"], first)  # a cold first call's cost, not the cache's
        _said(job, name, time.perf_counter() - t1, reply, why)
        if why:
            if me.stopping:
                return False
            job.deaths[name] = job.deaths.get(name, 0) + 1
            if job.deaths[name] < TRIES:
                log.warning("tiered_ops: background tuning of %s: %s %s (try %d of %d); the bucket is queued again",
                            job, name, why, job.deaths[name], TRIES)
                job.took_s += time.perf_counter() - t0
                me.requeue(job)
                return False
            reply = dict(base_row(spec, spec.impls[name], job.problem, job.dtype, mode, fp),
                         reason=f"crashed or hung: {why}")
        _keep(job, gates, reply)
        if name != todo[-1]:
            _land(job, store, final=False)
    return True


def _keep(job: Job, gates: EdgeGates | None, row: dict) -> None:
    """Store ``row``, the newest of its implementation, in the store of ``gates`` (the bucket's edge gates), and
    its implementation's edge gate where the row says it passed; None: the store is in memory, the row kept with the
    job."""
    if gates is not None:
        gates.store.add([gates.keep(job.spec.impls[row["impl"]], row)])
    else:
        row.pop(EDGES, None)
        job.measured[:] = [r for r in job.measured if r["impl"] != row["impl"]] + [row]


def _gate_winner(me: Runner, job: Job, store: Store | None, gates: EdgeGates | None) -> bool:
    """Gate the candidates timed without it (``GATED_LAST``) in the order the decision would choose them: while the
    fastest-correct choice, counting each of them as correct, names one, its gate runs in the worker and its row is
    stored again, ok or failed. Once the choice names a gated row, each still waiting is stored as never chosen. The
    bucket's decision is then the one a gate of every candidate would give, and only the winner's gate (and those of
    faster ones that failed) ran. False where the thread stops or the bucket was queued again (a gate killed its
    worker)."""
    spec, (op, _, dname, _, mode) = job.spec, job.key

    def run_gate(impl: Impl, row: dict, named_by: str, waiting: dict[str, dict]) -> bool:
        t1 = time.perf_counter()
        edges = gates.known(impl) if gates is not None else None
        if edges is None:
            edges = _split_edges(me, job, impl, gates)
        reply, why = me.pool_for(job).run(("gate", op, impl.name, job.problem, dname, mode, row, edges),
                                          f"{job} {impl.name} gate")
        timed = ", ".join(f"{n} {r['caller_us']:.1f} us" for n, r in sorted(waiting.items()))
        _say(job, impl.name + GATE, time.perf_counter() - t1, None,
             f"{why or ('passed' if reply.get('ok') else reply.get('reason'))} (named: {named_by}; waiting: {timed})")
        if why:
            if me.stopping:
                return False
            job.deaths[impl.name] = job.deaths.get(impl.name, 0) + 1
            if job.deaths[impl.name] < TRIES:
                log.warning("tiered_ops: background tuning of %s: %s's gate %s (try %d of %d); the bucket is queued "
                            "again", job, impl.name, why, job.deaths[impl.name], TRIES)
                me.requeue(job)
                return False
            reply = dict(row, ok=0, reason=f"gate crashed or hung: {why}")
        _keep(job, gates, dict(reply, timestamp=time.time()))
        return True

    return gate_in_turn(spec, lambda: _rows(job, store), run_gate, lambda r: _keep(job, gates, r), job.dtype,
                        job.device, store, stopping=lambda: me.stopping)


def _split_edges(me: Runner, job: Job, impl: Impl, gates: EdgeGates | None) -> float | None:
    """``impl``'s edge checks split over the worker and the gate helpers up beside it, run at once: their worst error
    where all passed (recorded in the store as the gate's own pass would be), else None (none up, or a share failed:
    the worker's gate then runs every check, one after another, and records why)."""
    helpers = me.helpers_for(job)
    if not helpers:
        return None
    spec, (op, _, dname, _, mode) = job.spec, job.key
    t = time.perf_counter()
    worst, said = split_edges(me.pool_for(job), helpers, ("edges", op, impl.name, dname, mode in GRAD_MODES),
                              edge_checks(spec), f"{job} {impl.name} gate")
    _say(job, impl.name + EDGE_SHARES, time.perf_counter() - t, None,
         f"passed: {said}" if worst is not None else f"not passed ({said}): the gate runs them in the worker")
    if worst is not None and gates is not None:
        gates.record(impl, worst)
    return worst


def _rows(job: Job, store: Store | None) -> list[dict]:
    op, bkey, dname, fkey, mode = job.key
    return list(store.latest(op, bkey, dname, fkey, mode) if store is not None else job.measured)


def _land(job: Job, store: Store | None, final: bool) -> None:
    """Hand the bucket's decision to the callers: at the end (``final``), and before it whenever the rows stored so
    far choose a correct implementation other than the one landed last (the cheap-to-gate tiers are measured first,
    so calls leave their prediction within seconds; each landing's choice is gated and timed)."""
    rows = _rows(job, store)
    impl, reason, _ = _decide(job.spec, rows, job.dtype, job.device, "fastest", None, store)
    if not final and (impl.name == job.chosen or not any(r.get("ok") and r["impl"] == impl.name for r in rows)):
        return
    job.chosen = impl.name
    job.landings += 1
    if final:
        job.landed = True
    job.landed_hook(job)
    seconds = time.perf_counter() - job.queued_at
    said = (f"landed in {job.took_s:.1f} s ({seconds:.1f} s after it was queued)" if final else
            f"decided {seconds:.1f} s after it was queued, measuring on")
    log.info("tiered_ops: background tuning of %s %s: %s (%s) - %s", job, said, impl.name, impl.tier.label, reason,
             extra={LANDING: dict(op=job.key[0], problem=str(job.problem), impl=impl.name, seconds=seconds,
                                  final=final)})
