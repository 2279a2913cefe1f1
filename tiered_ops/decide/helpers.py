"""Gate helpers: worker processes beside background tuning's measuring worker on one device, kept warm with it, that
take shares of a gate's edge checks. A compiled tier's edge gate compiles one kernel per edge problem (on an H100,
about 0.7 s each, most of it Triton's own compilation, one process at a time): split over the helpers and the worker,
the checks run at once, and the bucket's decision lands seconds sooner. While the worker times a bucket's first
candidates, the helpers make the first calls of its compiled ones (``FirstCalls``: their compilation, into the
compilers' on-disk caches, which the worker then reads); nothing else runs in them while candidates are timed."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from ..measure.worker import Pool

log = logging.getLogger("tiered_ops.decide.background")


class Helpers:
    """``n`` pools on ``device``: their processes spawned by the constructing thread (the runner's: they die with it),
    their starts awaited on threads of their own, all at once; ``ready`` lists those up."""

    def __init__(self, device: str, modules: list[str], n: int, timeout_s: float, say: Callable[[str], object]):
        # a GPU helper's start compiles a tiny function, as a warm worker's does (on the CPU that costs a C++ build)
        self.pools = [Pool(device, modules, timeout_s, warm_up=device.startswith("cuda"), log=say) for _ in range(n)]
        self._up: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads: dict[int, threading.Thread] = {}
        for i in range(n):
            self._start(i)

    def _start(self, i: int) -> None:
        self.pools[i].spawn()  # the process here (the runner's thread, which it dies with); its answer awaited aside
        t = threading.Thread(target=self._bring_up, args=(i,), name=f"tiered_ops-gate-helper-{i}", daemon=True)
        self._threads[i] = t
        t.start()

    def _bring_up(self, i: int) -> None:
        pool = self.pools[i]
        try:
            pool.start()
        except RuntimeError as e:
            log.warning("tiered_ops: background tuning: a gate helper did not start (%s); gates run without it", e)
            return
        with self._lock:
            if not self._closed:
                self._up.add(i)
                return
        pool.close()  # closed while it started

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the starts under way; how many helpers are up."""
        for t in list(self._threads.values()):
            t.join(timeout)
        return len(self.ready())

    def ready(self) -> list[Pool]:
        with self._lock:
            return [self.pools[i] for i in sorted(self._up) if self.pools[i].worker is not None]

    def revive(self) -> None:
        """Start again the helpers whose worker died (a share that killed it): off the caller's path."""
        with self._lock:
            if self._closed:
                return
            dead = [i for i in range(len(self.pools)) if i in self._up and self.pools[i].worker is None]
            self._up.difference_update(dead)
        for i in dead:
            self._start(i)

    def kill(self) -> None:
        """Kill every helper's worker now, started or still starting (``shutdown``: a share in flight ends at once)."""
        for p in self.pools:
            p.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            up, self._up = self._up, set()
        for i in up:
            self.pools[i].close()


def split_edges(main: Pool, helpers: list[Pool], task: tuple, checks: int, what: str) -> tuple[float | None, str]:
    """Run ``checks`` edge checks (``task`` + the numbers of a share: the worker's "edges" task) split round-robin
    over ``main`` and ``helpers`` at once. The worst error where every share passed, else None, and what happened
    (a share that failed or whose worker died: the caller's own gate then runs every check and says why)."""
    pools = [main, *helpers][:checks]
    shares = [list(range(k, checks, len(pools))) for k in range(len(pools))]
    replies: list[tuple] = [(None, "not run")] * len(pools)

    def one(k: int) -> None:
        try:
            replies[k] = pools[k].run((*task, shares[k]), f"{what} (edge checks {shares[k]})")
        except RuntimeError as e:  # the harness failed in that worker: the caller's gate meets it again
            replies[k] = (None, str(e).splitlines()[0])

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(1, len(pools))]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join()
    worst = 0.0
    for reply, died in replies:
        if died or reply is None:
            return None, f"a worker died ({died})"
        err, why = reply
        if why:
            return None, why
        worst = max(worst, err)
    return worst, f"{checks} edge checks in {len(pools)} processes"


class FirstCalls:
    """The first calls of a bucket's compiled candidates (``names``), started at once in the gate helpers, one helper
    each in turn: ``task`` + (name,) + ``args`` is the worker's "first_call" task. ``wait(name)`` joins that call and
    gives its seconds (its compilation, cold: the figure a first call in the worker would have recorded), None where
    it raised, its helper died or no helper ran it. ``join`` before the helpers take other work (a pool serves one
    task at a time)."""

    def __init__(self, helpers: list[Pool], task: tuple, args: tuple, names: list[str], what: str):
        self._seconds: dict[str, float | None] = {}
        self._done: dict[str, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        for k in range(len(helpers)):
            mine = names[k::len(helpers)]
            self._done.update((n, threading.Event()) for n in mine)
            t = threading.Thread(target=self._run, args=(helpers[k], task, args, mine, what), daemon=True,
                                 name=f"tiered_ops-first-calls-{k}")
            self._threads.append(t)
            t.start()

    def _run(self, pool: Pool, task: tuple, args: tuple, names: list[str], what: str) -> None:
        for name in names:
            reply: object = None
            try:
                reply, died = pool.run((*task, name, *args), f"{what} {name} first call")
            except RuntimeError:  # it raised there: the worker's own first call meets it again and records why
                pass
            except Exception as e:  # never leave a waiter hanging: the worker makes the call itself
                log.warning("tiered_ops: background tuning: %s %s's first call in a gate helper failed (%s: %s); "
                            "the worker makes it", what, name, type(e).__name__, e)
            else:
                reply = reply if died is None else None
            finally:
                self._seconds[name] = reply if isinstance(reply, float) else None
                self._done[name].set()

    def wait(self, name: str) -> float | None:
        done = self._done.get(name)
        if done is None:
            return None
        done.wait()
        return self._seconds.get(name)

    def join(self) -> None:
        for t in self._threads:
            t.join()
