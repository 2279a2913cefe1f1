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
from dataclasses import replace
from typing import Any, Callable

import torch

from .. import envs
from ..measure.worker import Pool
from ..registry import Impl, OpSpec, Problem
from ..store.store import Store
from ..tiers.catalog import all_ops
from .bucket import CANDIDATE, EDGE_SHARES, GATE, LANDING, WORKER_START, Job, said_start, tune  # noqa: F401 (log keys)
from .helpers import Helpers

log = logging.getLogger(__name__)

QUEUE_MAX = 64  # buckets waiting at most; a call of another one runs its prediction, not queued (said once)
TIMEOUT_S = 300.0  # per candidate, as a sweep's default
IDLE_S = 30.0  # the worker process is closed after this long with nothing queued


class _Runner:
    """One thread's own: its worker pool, its store connections, its stop flag (a thread stopped by ``shutdown`` that
    is still finishing leaves the next request a fresh runner, never two threads on one pool)."""

    def __init__(self) -> None:
        self.stopping = False
        self.pool: Pool | None = None
        self.helpers: Helpers | None = None  # beside ``pool``, on its device: they share its gates' edge checks
        self.stores: dict[str, Store] = {}
        self.thread = threading.Thread(target=_run, args=(self,), name="tiered_ops-background-tuning", daemon=True)

    def close_pool(self) -> None:
        pool, self.pool = self.pool, None
        helpers, self.helpers = self.helpers, None
        if pool is not None:
            pool.close()
        if helpers is not None:
            helpers.close()

    def pool_for(self, job: Job) -> Pool:
        """The worker pool that measures ``job`` (started where none runs)."""
        return _pool_for(self, job)

    def helpers_for(self, job: Job) -> list[Pool]:
        """The gate helpers up beside ``job``'s pool (none where it has none)."""
        pool = _pool_for(self, job)
        helpers = self.helpers if self.helpers is not None and pool is self.pool else None
        if helpers is None:
            return []
        helpers.revive()
        return helpers.ready()

    def requeue(self, job: Job) -> None:
        """Queue ``job`` again (its worker died during a candidate: a fresh one retries it), unless stopping."""
        with _s.cond:
            if not self.stopping:
                _s.queue[job.key] = job

    def queued(self) -> int:
        """Buckets waiting behind the one measured."""
        return len(_s.queue)


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
            landed_hook: Callable[[Job], None], waited: bool = False) -> tuple[Job | None, str]:
    """Queue ``key``'s bucket for measuring (unless it is queued or being measured already) for a caller in
    ``context`` deciding from ``store``; (the job, QUEUED) or (None, NOT_QUEUED + why): what the decision's record
    says. Nothing is queued while dynamo traces (a trace's miss queues through ``compiled.trace_choice``, which dynamo
    runs for real), nor inside a CUDA-graph capture. ``context`` is the asking caller's (any: a compiled one's bucket
    is measured as an eager one's, its compiled decision made from the same rows). ``waited``: a blocking call waits
    for it (``wait_for_job``): it is measured before the buckets of calls that do not wait."""
    job, why = _request(spec, problem, dtype, device, mode, context, key, impls, store, landed_hook, waited)
    return job, QUEUED if job is not None else NOT_QUEUED + why


def _request(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, context: str,
             key: tuple[str, str, str, str, str], impls: list[str], store: Store,
             landed_hook: Callable[[Job], None], waited: bool) -> tuple[Job | None, str]:
    if torch.compiler.is_compiling():
        return None, "inside a torch.compile trace"
    if _capturing(device):
        return None, "inside a CUDA-graph capture"
    target = None if not store.writable or str(store.path) == ":memory:" else (store.url or str(store.path))
    with _s.cond:
        if key in _s.given_up:
            return None, "its background measurement failed earlier in this process"
        job = _s.queue.get(key) or (_s.current if _s.current is not None and _s.current.key == key else None)
        if job is not None:
            job.waited = job.waited or waited
            return job, ""
        if len(_s.queue) >= QUEUE_MAX:
            if not _s.full_told:
                _s.full_told = True
                log.warning("tiered_ops: background tuning queue full (%d buckets): %s runs its prediction until "
                            "the queue has room", QUEUE_MAX, key)
            return None, f"the background tuning queue is full ({QUEUE_MAX} buckets)"
        job = Job(key, spec, problem, dtype, device, mode, impls, target, landed_hook, waited=waited)
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
            said_start(None, pool, took)
        if me.helpers is not None:  # started beside it: the first bucket's gate finds them up
            t = time.perf_counter()
            up = me.helpers.wait()
            log.info("tiered_ops: background tuning: %d of %d gate helpers up on %s (%.1f s more)", up,
                     len(me.helpers.pools), device, time.perf_counter() - t)
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


def wait_for_job(job: Job, timeout: float, tick: Callable[[], object] | None = None) -> str | None:
    """Wait until ``job``'s last landing (every candidate measured and stored; a job queued ``waited`` is measured
    before the buckets of calls that do not wait); ``tick`` is called about once a second meanwhile. None once it
    landed, else why not: its measurement failed in the harness (a worker that could not start), background tuning
    stopped, or ``timeout`` seconds passed (the job is then taken out of the queue where it still waits there)."""
    deadline = time.monotonic() + timeout
    while True:
        with _s.cond:
            # done once the thread is through with it (its landing's hook has run: rows of a store kept in memory)
            _s.cond.wait_for(lambda: (job.landed or job.failed is not None) and _s.current is not job
                             or _s.runner is None, max(0.0, min(1.0, deadline - time.monotonic())))
            if job.landed and _s.current is not job:
                return None
            if job.failed is not None and _s.current is not job:
                return f"its measurement in the worker failed ({' '.join(job.failed.split())[:300]})"
            if _s.runner is None:
                return "background tuning stopped"
            if time.monotonic() >= deadline:
                if _s.queue.get(job.key) is job:
                    del _s.queue[job.key]
                return f"not measured within {timeout:.0f} s"
        if tick is not None:
            tick()


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
    if runner.pool is not None:
        runner.pool.kill()  # the thread's wait for its reply ends now
    if runner.helpers is not None:
        runner.helpers.kill()
    if runner.thread is not threading.current_thread():
        runner.thread.join(timeout)


def _run(me: _Runner) -> None:
    try:
        while True:
            with _s.cond:
                idle = not _s.cond.wait_for(lambda: _s.queue or _s.warm or me.stopping, IDLE_S)
                if me.stopping:
                    return
                job = None if idle or not _s.queue else max(_s.queue.values(), key=lambda j: (j.waited, j.calls))
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
                tune(me, job)
            except Exception as e:  # noqa: BLE001 (a harness or store failure: said, the bucket is not queued again)
                if not me.stopping:
                    job.failed = f"{type(e).__name__}: {e}"
                    if not job.waited:  # a blocking caller says it, as it measures the bucket itself
                        log.warning("tiered_ops: background tuning of %s failed (%s); it keeps its prediction in "
                                    "this process", job, job.failed)
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
        say = lambda s: me.stopping or log.warning("tiered_ops: background tuning: %s", s)  # noqa: E731
        n = envs.gate_helpers(device.type)
        me.helpers = Helpers(str(device), modules, n, TIMEOUT_S, say) if n else None  # they start at once
        me.pool = Pool(device, modules, TIMEOUT_S, warm_up=warm_up, log=say)
    return me.pool
