"""Launch-bound candidates of one case timed again side by side, so that their host times compare.

A GPU row's caller time is the larger of its kernel time and its host time per call, and the host time of a
launch-bound call moves with the state of the host: in fresh processes one after another on an H100 machine, every
implementation of a case read 1.5-1.7x slower in one process than in the next (and so did all of them while other
processes kept the cores busy), while their ratios held within a few percent. Candidates timed one after another
(a sweep, a tuning) can meet the host in different states, and where the host time decides, the choice follows the
state, not the implementation. When a case's fastest rows are launch-bound, its correct rows are timed again here in
one process, in interleaved rounds (each round every candidate, in turn; the order rotated), and each gets its host
figures from these rounds: min, p20 and p80 over them. The rows come back as new rows (``origin`` says so) with
their caller time again the larger of kernel and host time.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import torch

from ..registry import OpSpec, Problem
from ..store.rows import (
    HOST_SWING,
    WAITING,
    caller_range,
    contended,
    launch_sensitive,
    prune_bar,
    pruned,
    seconds_apart,
    ungated,
    usable,
)
from .measure import PRUNE_FACTOR
from .timing import batch_times_us, no_gc, quantile, sync

log = logging.getLogger(__name__)


def rotated(names: list[str], rounds: int) -> Iterator[str]:
    """``names`` once per round over ``rounds`` rounds, the order rotated each round (ABC, BCA, CAB, ...): a host's
    drift during the rounds falls on every candidate alike."""
    for r in range(rounds):
        k = r % len(names)
        yield from names[k:] + names[:k]


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, measure: Callable[[Callable[[], object]], float]
                ) -> dict[str, list[float]]:
    """``measure`` of each of ``calls`` once per round, in ``rotated`` order: the samples per name."""
    out: dict[str, list[float]] = {n: [] for n in calls}
    for n in rotated(list(calls), rounds):
        out[n].append(measure(calls[n]))
    return out

ORIGIN = "host timed side by side with "  # the origin of a row whose host figures come from here
WITHIN = 1.5  # a launch-sensitive row this close to the fastest (caller time) asks for the case's rows to be re-timed
# A rival timed but never gated, or pruned after a short timing, this close to the fastest is re-timed with them: the
# reports and the territories' check compare a CUDA kernel with such rows, and one timed in another run (a sweep
# resumed after a source changed re-times only that implementation) can be on a host 1.5-1.9x slower or faster.
REACH = WITHIN * HOST_SWING
ROUNDS = 7
BATCH_S = 0.004  # host time of one candidate's batch in a round


def candidates(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of one case (fresh, the newest per implementation) to time again side by side: every usable eager
    caller's GPU row (``usable``, timed in full: not pruned, with host spread), when at least two exist and one asks
    for it (``_asks``: launch-sensitive, close to the fastest or timed in another run); with them the rivals timed
    but not gated or pruned (correct where gated, not flagged as contended) within ``REACH`` of the fastest; else
    none. None either where they were all timed side by side already (their origin says so)."""
    eager = [r for r in rows if r.get("host_p80_us") is not None and (r.get("context") or "eager") == "eager"]
    full = [r for r in eager if usable(r) and not pruned(r)]
    if len(full) < 2:
        return []
    fastest = min(full, key=lambda r: r["caller_us"])
    best = fastest["caller_us"]
    if not any(_asks(r, fastest) for r in full):
        return []
    near = [r for r in eager if r not in full and (pruned(r) or ungated(r)) and not contended(r)
            and r.get("caller_us") is not None and r["caller_us"] <= REACH * best]
    again = full + near
    return [] if all(str(r.get("origin") or "").startswith(ORIGIN) for r in again) else again


def _asks(r: dict[str, Any], fastest: dict[str, Any]) -> bool:
    """Whether a usable row asks for its case to be re-timed: launch-sensitive and within ``WITHIN`` of the fastest
    caller time; or, timed in another run than the fastest (``seconds_apart``), within ``REACH`` of it by caller time
    and ``WITHIN`` by kernel time: its caller time is that run's host's, and on the fastest's host it may be the
    faster."""
    best = fastest["caller_us"]
    if not launch_sensitive(r):
        return False
    if r["caller_us"] <= WITHIN * best:
        return True
    return (r["caller_us"] <= REACH * best and r.get("p50_us") is not None and r["p50_us"] <= WITHIN * best
            and seconds_apart(r, fastest) is not None)


def side_by_side(spec: OpSpec, names: list[str], problem: Problem, dtype: torch.dtype, device: torch.device,
                 mode: str, rounds: int = ROUNDS, batch_s: float = BATCH_S) -> dict[str, list[float]]:
    """Host time per call (us) of each implementation in ``names``, one batch per round over ``rounds`` interleaved
    rounds in this process (the call a measurement times, ``measure.timed_call``, on one set of inputs). One that
    raises here is left out from then on, with a warning: its row stays as it was timed."""
    from .measure import timed_call

    inp = spec.make_inputs(problem, dtype, device, 0)
    calls: dict[str, Callable[[], Any]] = {}
    out: dict[str, list[float]] = {}

    def attempt(n: str, run: Callable[[], Any]) -> None:
        try:
            run()
        except Exception as e:  # noqa: BLE001 - one candidate's failure leaves the others' rounds going
            log.warning("tiered_ops: %s %s %s: %s raised while timed side by side (%s: %s); its row stays as timed",
                        spec.name, problem, mode, n, type(e).__name__, e)
            calls.pop(n, None)
            out.pop(n, None)

    for n in names:
        calls[n] = timed_call(spec, spec.impls[n], inp, mode)
        out[n] = []
        attempt(n, lambda n=n: (calls[n](), sync(device)))  # warm: a compiled tier's graph, a first launch
    with no_gc():
        for n in rotated(names, rounds):
            if n in calls:
                attempt(n, lambda n=n: out[n].extend(batch_times_us(calls[n], device, batch_s, batches=1)))
    return out


def retimed(rows: list[dict[str, Any]], hosts: dict[str, list[float]]) -> list[dict[str, Any]]:
    """New rows: each of ``rows`` whose implementation ``hosts`` timed, its host figures (min, p20, p80) from there
    and its caller time again max(kernel p50, host). A pruned row whose caller p20 is now under the pruning bar of the
    rows timed beside it (``prune_bar``: the bar that pruned it came from another host's rows) is pruned no longer:
    usable where its gate passed, else waiting for its gate (``WAITING``: gated where it would be chosen)."""
    names = sorted(n for n in hosts if hosts[n])
    out = []
    for r in rows:
        times = sorted(hosts.get(r["impl"]) or [])
        if not times:
            continue
        row = {k: v for k, v in r.items() if k != "id"}
        row.update(host_us=times[0], host_p20_us=quantile(times, 0.2), host_p80_us=quantile(times, 0.8),
                   caller_us=max(r["p50_us"], times[0]), timestamp=time.time(),
                   origin=ORIGIN + ", ".join(n for n in names if n != r["impl"]))
        out.append(row)
    bar = prune_bar(out, PRUNE_FACTOR)
    for row in out:
        if bar is not None and pruned(row) and caller_range(row)[0] <= bar[0]:
            row["reason"] = None if row.get("ok") else WAITING
    return out


def retime(spec: OpSpec, rows: list[dict[str, Any]], problem: Problem, dtype: torch.dtype, device: torch.device,
           mode: str, run: Callable[[list[str]], tuple[Any, str | None]] | None = None
           ) -> tuple[list[dict[str, Any]], str | None]:
    """The case's rows that ``candidates`` names (of ``rows``, those of the current sources; none on the CPU), timed
    again side by side: (new rows, None), or ([], why) where ``run`` (names -> (hosts, why): a worker's ``host`` task)
    could not time them. Without ``run``, in this process."""
    again = candidates([r for r in rows if spec.fresh_impl(r) is not None]) if device.type == "cuda" else []
    if not again:
        return [], None
    names = [r["impl"] for r in again]
    hosts, why = run(names) if run is not None else (side_by_side(spec, names, problem, dtype, device, mode), None)
    return ([], why) if why else (retimed(again, hosts), None)


def summary(rows: list[dict[str, Any]]) -> str:
    """One line: each row's caller time (host time) as re-timed."""
    return "; ".join(f"{r['impl']} {r['caller_us']:.1f} us (host {r['host_us']:.1f})"
                     for r in sorted(rows, key=lambda r: r["caller_us"]))
