"""Measuring a bucket on a miss when processes share one store: the first claims it, the others wait for its rows.

The ranks of a job on one host start together with one store and miss the same buckets at once. Each measuring them
would time every bucket N times, each timing against the others' (on a CPU, every row contended). So a miss claims
its bucket in the store's ``claims`` table (the same table and rules as a sweep's claims, SQLite and PostgreSQL
alike: one row, its ``impl`` column ``BUCKET``, its ``problem`` column the bucket), with a lease
(``envs.claim_lease_s``) renewed before each candidate. A process that finds the bucket claimed polls for the claim
for at most ``envs.claim_wait_s``; when it gets it, it reads again what the owner stored and measures only what is
still to measure (``choice.to_measure``): nothing, when the owner finished. One that waited in vain decides
from what is stored, provisionally. A claim whose owner is a dead process of this host is taken over at once (a rank
killed mid-measurement blocks nobody), one of another host at the end of its lease.

While it measures, the owner also holds the device's measuring slot on this host (one claim per host and device, its
``impl`` column ``SLOT``), so that processes measuring different buckets take turns rather than spoil each other's
timings; a slot not had within the wait is measured without (its rows may then be flagged busy: provisional).

What a blocking tune says while the caller waits (``Announce``): one WARNING line the first time a process measures
(the op, the problem, the implementations and an estimate of the wait), INFO lines after that, and a progress line
whenever a tune has gone on for ``PROGRESS_EVERY_S`` since its last line. The wait is an estimate, not a
measurement: a figure per tier (``ESTIMATE_S``) summed over the implementations that can run on the device (one that
cannot is stored as unavailable at once).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from typing import Any, Callable

import torch

from .. import envs
from ..measure.case import EdgeGates, Plan, measure_kept, measure_planned
from ..measure.fingerprint import fingerprint
from ..measure.measure import PRUNE_FACTOR, bucket_str, check_fits
from ..measure.verdict import Settings
from ..registry import DTYPE_NAMES, Impl, OpSpec, Problem, Tier
from ..store.store import Store
from .choice import MEASURE_ORDER, GateTurns, busy_stamped, pruning, to_measure

log = logging.getLogger(__package__ + ".decide")  # the tuning lines keep the logger of select_problem's log

BUCKET = "(bucket)"  # the impl column of a bucket's claim
SLOT = "(measuring)"  # the impl column of a device's measuring slot on a host
POLL_S = 0.1

# Rough seconds to gate and time one implementation on first use, chosen so that an op with eager, compile and
# Triton tiers on a 2-core CPU comes to about the 12 s its first call takes there; a GPU usually takes less, a first
# CUDA extension build more. Estimates for the message, never used to decide anything.
ESTIMATE_S = {Tier.EAGER: 1.0, Tier.COMPILE: 8.0, Tier.TRITON: 3.0, Tier.CUDA: 3.0, Tier.PEER: 3.0}
PROGRESS_EVERY_S = 10.0  # a tune that runs longer says how far it is every this many seconds

_first = threading.Event()  # set once this process has announced a tune


def estimate_s(impls: list[Impl], device: torch.device) -> float:
    """The estimated seconds to measure ``impls`` on ``device`` (those that cannot run there cost nothing)."""
    return sum(ESTIMATE_S.get(i.tier, 3.0) for i in impls if i.why_not(device) is None)


class Announce:
    """The lines of one blocking tune: ``start`` before it measures, ``step`` before each implementation."""

    def __init__(self, what: str, impls: list[Impl], device: torch.device):
        self.what, self.impls, self.device = what, impls, device
        waits = estimate_s(impls, device) > 0  # only implementations that cannot run here: nothing to wait for
        self.level = logging.INFO if _first.is_set() or not waits else logging.WARNING
        if waits:
            _first.set()
        self.t0 = self.last = time.perf_counter()
        self.done = 0

    def start(self, where: str, why: str = "no stored decision") -> None:
        """The opening line: what is measured and ``why``, on first use also the expected wait and how never to
        wait."""
        names = ", ".join(i.name for i in self.impls)
        first = (f" on first use, ~{estimate_s(self.impls, self.device):.0f} s (an estimate); "
                 "TIERED_OPS_TUNE=background to never wait" if self.level == logging.WARNING else "")
        log.log(self.level, "tiered_ops: tuning %s: %s, measuring %d implementation(s) (%s)%s; %s",
                self.what, why, len(self.impls), names, first, where)

    def step(self, impl: Impl) -> None:
        """Before measuring ``impl``: a progress line when the tune has gone on long since its last line."""
        now = time.perf_counter()
        if self.done and now - self.last >= PROGRESS_EVERY_S:
            log.log(self.level, "tiered_ops: still tuning %s: %d of %d measured, %.0f s so far; next %s", self.what,
                    self.done, len(self.impls), now - self.t0, impl.name)
            self.last = now
        self.done += 1

    def waiting(self, where: str) -> None:
        """While the implementations are measured elsewhere (``where``): a progress line when the tune has gone on
        long since its last line."""
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            log.log(self.level, "tiered_ops: still tuning %s: %.0f s so far, %s", self.what, now - self.t0, where)
            self.last = now


def bucket_key(spec: OpSpec, key: tuple[str, str, str, str, str]) -> tuple[str, ...]:
    """The claim of the bucket ``key`` (op, bucket, dtype, device key, mode) for the op's current sources."""
    op, bucket, dtype, device_key, mode = key
    sources = sorted(i.source_hash for i in spec.impls.values() if i.tier != Tier.PEER)
    return (op, BUCKET, bucket, dtype, mode, device_key, hashlib.sha1("|".join(sources).encode()).hexdigest()[:16])


def slot_key(device: torch.device) -> tuple[str, ...]:
    """The measuring slot of ``device`` on this host: a GPU by its UUID (processes that see it under different
    indices share it), the CPU as one."""
    gpu = getattr(torch.cuda.get_device_properties(device), "uuid", None) if device.type == "cuda" else None
    return ("*", SLOT, socket.gethostname(), "", "", str(gpu or device), "")


def wait_for(store: Store, key: tuple[str, ...], what: str, wait_s: float, lease_s: float) -> tuple[bool, float]:
    """Take the claim ``key``, polling for at most ``wait_s`` while another owner holds it: (had it, seconds waited)."""
    t0 = time.perf_counter()
    told = False
    while not store.claim(key, lease_s):
        waited = time.perf_counter() - t0
        if waited >= wait_s:
            return False, waited
        if not told:
            told = True
            log.info("tiered_ops: %s: another process sharing the store holds it; waiting up to %.0f s", what, wait_s)
        time.sleep(POLL_S)
    return True, time.perf_counter() - t0


def open_bucket(store: Store, spec: OpSpec, key5: tuple[str, str, str, str, str], what: str, wait_s: float,
                lease: float) -> tuple[tuple[str, ...], list[dict], list[Impl], bool, tuple | None]:
    """Take the claim of the bucket ``key5`` (waiting for another owner's as ``wait_for``), then read what it holds:
    (the claim, the bucket's newest rows, what is still to measure, whether those are timed again, ``early``).
    ``early`` is the result to return at once, the claim not held: the rows, provisional, where another process's
    claim outlasted the wait; the rows, where nothing is left to measure (another process measured it)."""
    claim = bucket_key(spec, key5)
    had, waited = wait_for(store, claim, f"measuring {what}", wait_s, lease)
    if not had:
        return claim, [], [], False, (store.latest(*key5), None, "provisional: another process sharing the store is "
                                      f"measuring it (waited {waited:.0f} s)")
    try:
        rows = store.latest(*key5)
        todo, again = to_measure(store, spec, key5, rows, fresh=spec.freshness(rows))
    except BaseException:
        store.release(claim)
        raise
    if not todo:
        store.release(claim)
        if waited:
            log.info("tiered_ops: %s measured by another process sharing the store (waited %.1f s)", what, waited)
        return claim, rows, todo, again, (rows, None, None)
    return claim, rows, todo, again, None


def measure_compiled(store: Store, spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device,
                     mode: str, key5: tuple[str, str, str, str, str], missing: list[Impl]) -> list[dict]:
    """Measure ``missing`` inside a compiled caller (``measure_kept``, context ``compiled``, given the call's one
    ``EdgeGates`` as ``gates``: the store's edge-gate passes read once for all of them, as ``tune_bucket`` does for a
    bucket) and store them: the bucket ``key5``'s compiled-context rows after. A miss reads those rows beside the
    bucket's own and asks this where some are missing (once: then every implementation has one)."""
    log.info("tiered_ops: %s %s %s %s: measuring %d implementations inside a compiled caller (once)", spec.name,
             problem, key5[2], mode, len(missing))
    gates = EdgeGates(store, spec, dtype, device, mode)  # the store's passes read once for every implementation
    store.add([measure_kept(store, spec, impl, problem, dtype, device, mode, gates=gates, context="compiled",
                            bucket=key5[1])
               for impl in missing])
    return store.latest(*key5, context="compiled")


def tune_bucket(store: Store, spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
                context: str, progress: Callable[[str], None] | None = None,
                measure_one: Callable[..., dict[str, Any]] = measure_kept, *,
                key5: tuple[str, str, str, str, str] | None = None, claim_s: tuple[float, float] | None = None,
                settings: Settings | None = None) -> tuple[list[dict], float | None, str | None]:
    """Measure what the bucket of ``problem`` lacks under its claim, as this plans it (``case.Plan``: the tiers whose
    gate compiles nothing first, each candidate pruned against the fastest so far, the gates the choice names in
    turn, ``choice.GateTurns``) and ``case.measure_planned`` runs and stores it, each candidate by ``measure_one`` (as
    ``measure_kept``): (the bucket's newest rows, seconds spent measuring or None where nothing was measured here, why
    not where another process's claim outlasted the wait). ``key5`` (the bucket in the store's terms) and ``claim_s``
    (the claim's lease and wait, ``envs.claim_lease_s``/``claim_wait_s``): as a caller that has them made them
    (``select_problem``), else made here; ``settings`` (``verdict.Settings``): as that caller read them, given to each
    measurement and gate, else read by those."""
    dname = DTYPE_NAMES[dtype]
    if key5 is None:
        key5 = (spec.name, bucket_str(spec.bucket(problem)), dname, fingerprint(device).key, mode)
    what = f"{spec.name} {problem} {dname} {mode} on {device}"
    lease, wait_s = claim_s if claim_s is not None else (envs.claim_lease_s(), envs.claim_wait_s())
    claim, rows, todo, again, early = open_bucket(store, spec, key5, what, wait_s, lease)
    if early is not None:
        return early
    try:
        check_fits(spec, problem, dtype, device, mode)
        where = f"stored in {store.path}" if store.writable else f"not saved: {store.kept_in_memory}"
        said = Announce(f"{spec.name} {problem} {dname} {mode} {context} on {device}", todo, device)
        said.start(where, "its timings were taken on a busy machine, timing them again side by side" if again
                   else "no stored decision")
        turns = GateTurns(spec, dtype, device, store)
        slot = slot_key(device)
        have_slot, _ = wait_for(store, slot, f"the measuring slot of {device}", wait_s, lease)

        def before(impl: Impl) -> None:
            said.step(impl)
            store.claim(claim, lease)  # the lease renewed: a long candidate (a compile) keeps the bucket
            if have_slot:
                store.claim(slot, lease)
            if progress:
                progress(f"measuring {spec.name} {impl.name} {problem} {dname} {mode}")

        plan = Plan(sorted(todo, key=lambda i: MEASURE_ORDER[i.tier]),
                    lambda impl, seen: pruning(impl, seen, PRUNE_FACTOR), turns, before,
                    lambda new: busy_stamped(new, time.time()))
        t0 = time.perf_counter()
        try:
            rows = measure_planned(store, spec, problem, dtype, device, mode, key5, rows, plan, measure_one, settings)
        finally:
            if have_slot:
                store.release(slot)
        return rows, time.perf_counter() - t0, None
    finally:
        store.release(claim)
