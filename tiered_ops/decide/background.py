"""Background tuning (``TIERED_OPS_TUNE=background``): a call with no stored decision returns at once through a
predicted implementation and queues its bucket; one daemon thread measures the queued buckets, hottest first,
stores them, and hands each landed bucket to ``decide`` so that its cached selections are dropped and the next call
decides from the stored rows.

Why a thread driving a worker process (``measure.worker.Pool``), not measuring in a thread of the caller's process
nor in a process of its own that owns the queue:

- A thread alone would run the candidates in the caller's interpreter: a kernel that crashes (an illegal address,
  a segfault) would take the application down, and the gate's float64 reference and the timing loops would hold
  the GIL against the caller's own Python. In the worker process a crash or a hang costs that candidate only (a
  dead worker is retried, then recorded as "crashed or hung", as a sweep records it).
- A process of its own would need the queue, the call counts and the landing sent back over IPC; the thread shares
  them with the caller for free and spends its time blocked in ``select`` (no GIL) while the worker measures.

One thread, one worker process, one measurement at a time per process. The thread writes through a store connection
of its own (a SQLite connection belongs to the thread that opened it; WAL lets both connections work at once); a
store kept in memory (read-only, unusable path) cannot be opened twice, so its rows go back with the landed job
(``Job.measured``, handed on by ``Job.unsaved``) and ``decide`` adds them on the caller's thread. The thread is a
daemon, stopped at exit (``shutdown``, registered with ``atexit``), which kills the worker: a bucket cut off is
measured again by a later process, and every measurement finished before is already stored (each is stored as it
completes). The worker is started from this thread with ``PR_SET_PDEATHSIG``, so it dies with the thread that
started it, never an orphan. On a GPU the worker measures beside the application's own work: its timings are as
contended as the device is.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..measure.fingerprint import fingerprint
from ..measure.measure import PRUNE_FACTOR, base_row, prune_bar
from ..measure.worker import Pool
from ..registry import Impl, OpSpec, Problem, Tier
from ..store.store import Store
from ..tiers.catalog import all_ops
from .choice import _decide

log = logging.getLogger(__name__)

QUEUE_MAX = 64  # buckets waiting at most; a call of another one runs its prediction, not queued (said once)
TRIES = 2  # a candidate whose worker dies or hangs this many times in a bucket is recorded as crashed or hung
TIMEOUT_S = 300.0  # per candidate, as a sweep's default
IDLE_S = 30.0  # the worker process is closed after this long with nothing queued


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

    def unsaved(self) -> list[dict]:
        """The rows measured for a store in memory since the last call: the caller's thread adds them."""
        new, self.handed = self.measured[self.handed:], len(self.measured)
        return new

    def __str__(self) -> str:
        op, _, dname, _, mode = self.key
        return f"{op} {self.problem} {dname} {mode}"


class _Runner:
    """One thread's own: its worker pool, its store connections, its stop flag (a thread stopped by ``shutdown`` that
    is still finishing leaves the next request a fresh runner, never two threads on one pool)."""

    def __init__(self) -> None:
        self.stopping = False
        self.pool: Pool | None = None
        self.stores: dict[str, Store] = {}
        self.thread = threading.Thread(target=_run, args=(self,), name="tiered_ops-background-tuning", daemon=True)

    def close_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()


class _State:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: dict[tuple, Job] = {}
        self.current: Job | None = None
        self.runner: _Runner | None = None
        self.given_up: set[tuple] = set()  # buckets whose measurement failed in the harness: not queued again
        self.full_told = False
        self.registered = False
        self.warm: list[str] = []  # devices whose worker ``warm_tuning`` asked to start before any bucket
        self.warmed: dict[str, float | str] = {}  # device -> its worker's start in seconds, or why it failed
        self.keep = False  # ``warm_tuning`` was called: the worker is kept for the process, not closed when idle


_s = _State()


def _forked() -> None:
    """A forked child has neither the parent's thread nor its worker (and the lock may have been held at the fork):
    it starts from an empty state."""
    global _s
    registered = _s.registered
    _s = _State()
    _s.registered = registered


os.register_at_fork(after_in_child=_forked)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


QUEUED = "queued for background tuning"
NOT_QUEUED = "not queued: "


def request(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, context: str,
            key: tuple[str, str, str, str, str], impls: list[str], store: Store,
            landed_hook: Callable[[Job], None]) -> tuple[Job | None, str]:
    """Queue ``key``'s bucket for measuring (unless it is queued or being measured already) for a caller in
    ``context`` deciding from ``store``; (the job, QUEUED) or (None, NOT_QUEUED + why): what the decision's record
    says. Nothing is queued while dynamo traces, from a compiled region (its call reaches the decision outside the
    trace, after a graph break: an eager call of the bucket queues it), nor inside a CUDA-graph capture."""
    job, why = _request(spec, problem, dtype, device, mode, context, key, impls, store, landed_hook)
    return job, QUEUED if job is not None else NOT_QUEUED + why


def _request(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, context: str,
             key: tuple[str, str, str, str, str], impls: list[str], store: Store,
             landed_hook: Callable[[Job], None]) -> tuple[Job | None, str]:
    if torch.compiler.is_compiling():
        return None, "inside a torch.compile trace"
    if context == "compiled":
        return None, "called from a compiled region"
    if _capturing(device):
        return None, "inside a CUDA-graph capture"
    target = None if not store.writable or str(store.path) == ":memory:" else (store.url or str(store.path))
    with _s.cond:
        if key in _s.given_up:
            return None, "its background measurement failed earlier in this process"
        job = _s.queue.get(key) or (_s.current if _s.current is not None and _s.current.key == key else None)
        if job is not None:
            return job, ""
        if len(_s.queue) >= QUEUE_MAX:
            if not _s.full_told:
                _s.full_told = True
                log.warning("tiered_ops: background tuning queue full (%d buckets): %s runs its prediction until "
                            "the queue has room", QUEUE_MAX, key)
            return None, f"the background tuning queue is full ({QUEUE_MAX} buckets)"
        job = Job(key, spec, problem, dtype, device, mode, impls, target, landed_hook)
        _s.queue[key] = job
        log.info("tiered_ops: background tuning: queued %s on %s (%d implementation(s): %s); %d queued", job, device,
                 len(impls), ", ".join(impls), len(_s.queue))
        _start_runner()
        _s.cond.notify_all()
        return job, ""


def _start_runner() -> None:
    """The thread, where none runs (``_s.cond`` held)."""
    if _s.runner is None:
        _s.runner = _Runner()
        _s.runner.thread.start()
        if not _s.registered:
            _s.registered = True
            atexit.register(shutdown)


def warm_tuning(device: torch.device | str | None = None, wait: bool = False,
                timeout: float | None = None) -> float | None:
    """Start background tuning's measurement worker for ``device`` now (default: the current CUDA device, else the
    CPU), so that the first bucket queued does not wait for its start (the imports, the CUDA context, the extension's
    load: seconds on a GPU host); call it at start-up, beside loading the model. The worker is then kept for the
    process (not closed after an idle spell): it holds a CUDA context of its own on that device.

    Returns at once (None), or with ``wait``, once the worker answers: the seconds its start took, None where
    ``timeout`` passed first. RuntimeError where it could not start (why, from the worker)."""
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    with _s.cond:
        _s.keep = True
        if key not in _s.warmed and key not in _s.warm:
            _s.warm.append(key)
        _start_runner()
        _s.cond.notify_all()
        if not wait or not _s.cond.wait_for(lambda: key in _s.warmed or _s.runner is None, timeout):
            return None
        took = _s.warmed.get(key)
    if took is None:  # stopped (shutdown) before it started
        return None
    if isinstance(took, str):
        raise RuntimeError(f"warm_tuning: the measurement worker for {key} could not start: {took}")
    return took


def _warm_next(me: _Runner, device: str) -> None:
    """Start the worker ``warm_tuning`` asked for (the runner's thread, nothing queued)."""
    try:
        pool = _pool_on(me, torch.device(device), set(), warm_up=True)
        took = pool.start()
        if took is not None:
            _said_start(None, pool, took)
        outcome: float | str = took if took is not None else 0.0
    except RuntimeError as e:
        log.warning("tiered_ops: background tuning: %s", e)
        outcome = str(e)
    with _s.cond:
        _s.warmed[device] = outcome
        _s.cond.notify_all()


def counting(job: Job, impl: Impl) -> Impl:
    """``impl`` with each call counted for ``job`` (the queue measures the hottest bucket first). A call after a
    landing that this selection did not see hands the job to its hook once more, as does the first call after the
    last landing: a selection cached after a landing dropped its cache."""
    seen = [job.landings - job.landed]  # made after the last landing: its first call hands the job on once more

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            job.calls += 1
            if job.landings != seen[0]:
                seen[0] = job.landings
                job.landed_hook(job)
            return fn(*args, **kwargs)
        return counted

    return replace(impl, fn=wrap(impl.fn), unchecked=None if impl.unchecked is None else wrap(impl.unchecked))


def pending() -> int:
    """Buckets queued or being measured now."""
    with _s.cond:
        return len(_s.queue) + (_s.current is not None)


def wait_for_tuning(timeout: float | None = None) -> bool:
    """Wait until background tuning (``TIERED_OPS_TUNE=background``) has no bucket queued or being measured.

    Returns True then (the next call of a bucket that landed uses its stored decision), False where ``timeout``
    seconds passed first; True at once where nothing was queued."""
    with _s.cond:
        return _s.cond.wait_for(lambda: not _s.queue and _s.current is None, timeout)


def shutdown(timeout: float = 10.0) -> None:
    """Stop the thread: queued buckets are dropped, a measurement in flight is killed with its worker (what was
    stored stays). The next request starts a thread again."""
    with _s.cond:
        runner, _s.runner = _s.runner, None
        dropped = len(_s.queue)
        _s.queue.clear()
        _s.warm.clear()
        _s.warmed.clear()
        _s.keep = False
        if runner is not None:
            runner.stopping = True
        _s.cond.notify_all()
    if dropped:
        log.info("tiered_ops: background tuning stopped with %d bucket(s) still queued (not measured)", dropped)
    if runner is None:
        return
    worker = runner.pool.worker if runner.pool is not None else None
    if worker is not None:
        worker.kill()  # the thread's wait for its reply ends now
    if runner.thread is not threading.current_thread():
        runner.thread.join(timeout)


def _run(me: _Runner) -> None:
    try:
        while True:
            with _s.cond:
                idle = not _s.cond.wait_for(lambda: _s.queue or _s.warm or me.stopping, IDLE_S)
                if me.stopping:
                    return
                job = None if idle or not _s.queue else max(_s.queue.values(), key=lambda j: j.calls)
                warm = _s.warm.pop(0) if job is None and _s.warm else None
                if job is not None:
                    del _s.queue[job.key]
                    _s.current = job
            if warm is not None:
                _warm_next(me, warm)
                continue
            if job is None:
                if not _s.keep:
                    me.close_pool()  # outside the lock: a request never waits for a worker to exit
                continue
            try:
                _tune(me, job)
            except Exception as e:  # noqa: BLE001 (a harness or store failure: said, the bucket is not queued again)
                if not me.stopping:
                    log.warning("tiered_ops: background tuning of %s failed (%s: %s); it keeps its prediction in "
                                "this process", job, type(e).__name__, e)
                    with _s.cond:
                        _s.given_up.add(job.key)
            finally:
                with _s.cond:
                    if _s.current is job:
                        _s.current = None
                    _s.cond.notify_all()
    finally:
        me.close_pool()
        for st in me.stores.values():
            st.close()
        with _s.cond:
            if _s.runner is me:
                _s.runner = None
            _s.cond.notify_all()


def _pool_for(me: _Runner, job: Job) -> Pool:
    return _pool_on(me, job.device, {job.spec.reference.__module__})


def _pool_on(me: _Runner, device: torch.device, extra: set[str], warm_up: bool = False) -> Pool:
    """The runner's pool on ``device``, whose worker has every catalogued op's module and ``extra`` (``warm_up``: its
    start also compiles a tiny function, ``Pool``)."""
    modules = sorted({s.reference.__module__ for s in all_ops()} | extra)
    if me.pool is None or me.pool.device != str(device) or not set(me.pool.modules) >= set(modules):
        me.close_pool()
        me.pool = Pool(device, modules, TIMEOUT_S, warm_up=warm_up,
                       log=lambda s: me.stopping or log.warning("tiered_ops: background tuning: %s", s))
    return me.pool


CANDIDATE = "tiered_ops_candidate"  # the attribute of a candidate's log record that holds its figures (a dict)
LANDING = "tiered_ops_landing"  # the attribute of a landing's log record: op, problem, impl, seconds, final
WORKER_START = "(worker start)"  # the ``impl`` of the record that says how long the measurement worker took to start
# The order a bucket's candidates are measured in: the tiers whose gate compiles nothing first, so a gated, timed
# choice lands within seconds; the compiled tiers (their edge problems compile one kernel each) after.
_ORDER = {Tier.EAGER: 0, Tier.CUDA: 1, Tier.PEER: 2, Tier.TRITON: 3, Tier.COMPILE: 4}


def _said(job: Job, name: str, seconds: float, reply: Any, why: str | None) -> None:
    """Log one candidate's measurement: how long it took in the worker (its first call, compilation included, apart)
    and its outcome; the figures ride on the record as ``CANDIDATE`` for a handler that collects them."""
    first = reply.get("first_call_s") if isinstance(reply, dict) else None
    outcome = why or (reply.get("reason") if isinstance(reply, dict) else None) or "timed"
    log.info("tiered_ops: background tuning of %s: %s took %.1f s (first call %s): %s", job, name, seconds,
             "-" if first is None else f"{first:.1f} s", outcome,
             extra={CANDIDATE: dict(op=job.key[0], problem=str(job.problem), impl=name, seconds=seconds,
                                    first_call_s=first, outcome=outcome)})


def _said_start(job: Job | None, pool: Pool, seconds: float) -> None:
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


def _tune(me: _Runner, job: Job) -> None:
    spec, (op, bkey, dname, fkey, mode) = job.spec, job.key
    store = None
    if job.target is not None:
        store = me.stores.get(job.target) or me.stores.setdefault(job.target, Store(job.target))
        have = {r["impl"] for r in store.latest(op, bkey, dname, fkey, mode) if spec.fresh_impl(r) is not None}
    else:
        have = {r["impl"] for r in job.measured}
    todo = sorted((n for n in job.impls if n not in have and n in spec.impls), key=lambda n: _ORDER[spec.impls[n].tier])
    log.info("tiered_ops: background tuning %s on %s: measuring %s in a worker process; %d more queued", job,
             job.device, ", ".join(todo) or "nothing (measured meanwhile)", len(_s.queue))
    t0 = time.perf_counter()
    started = _pool_for(me, job).start() if todo else None  # said apart: not the first candidate's time
    if started is not None:
        _said_start(job, me.pool, started)
    for name in todo:
        if me.stopping:
            return
        t1 = time.perf_counter()
        bar = prune_bar(_rows(job, store), PRUNE_FACTOR)
        kw = dict(prune_above_us=bar[0], best=bar[1], gate_first=False) if bar is not None else {}
        reply, why = _pool_for(me, job).run(("measure", op, name, job.problem, dname, mode, kw), f"{job} {name}")
        _said(job, name, time.perf_counter() - t1, reply, why)
        if why:
            if me.stopping:
                return
            job.deaths[name] = job.deaths.get(name, 0) + 1
            if job.deaths[name] < TRIES:
                log.warning("tiered_ops: background tuning of %s: %s %s (try %d of %d); the bucket is queued again",
                            job, name, why, job.deaths[name], TRIES)
                job.took_s += time.perf_counter() - t0
                with _s.cond:
                    if not me.stopping:
                        _s.queue[job.key] = job
                return
            reply = dict(base_row(spec, spec.impls[name], job.problem, job.dtype, mode, fingerprint(job.device)),
                         reason=f"crashed or hung: {why}")
        if store is not None:
            store.add([reply])
        else:
            job.measured.append(reply)
        if name != todo[-1]:
            _land(job, store, final=False)
    job.took_s += time.perf_counter() - t0
    _land(job, store, final=True)


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
