"""Blocking tuning through background tuning's worker: a call that waits for its bucket's measurement (blocking
tuning) hands the bucket to the background machinery (its thread, its measuring worker and the gate helpers beside it,
``background``) and waits for it to land, then decides from the store as it would have after measuring in its own
process. On a GPU that is faster: the helpers make the compiled candidates' first calls while the worker times the
others, and split the winner's edge checks, all at once, where the calling process compiles one kernel after another.

The bucket is measured under the same claims as in the caller's process (``claimed``: the bucket's, then the device's
measuring slot on this host, renewed while it waits), so processes sharing a store still measure it once. Where the
worker cannot measure it (the queue is full, a worker that does not start, a failure in the harness, background tuning
stopped, ``envs.blocking_wait_s`` passed), one log line says why and the call measures the bucket in its own process
(``claimed.tune_bucket``), never deciding provisionally for that reason. A bucket whose timings were taken on a busy
machine is timed again in the caller's process too (the worker measures only what has no fresh row).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from .. import envs
from ..measure.fingerprint import fingerprint
from ..measure.measure import bucket_str, check_fits
from ..registry import DTYPE_NAMES, OpSpec, Problem
from ..store.store import Store
from . import background, claimed
from .bucket import Job

log = logging.getLogger(__package__ + ".decide")  # the tuning lines keep the logger of select_problem's log

Tuned = tuple[list[dict], float | None, str | None]  # as ``claimed.tune_bucket``: rows, seconds measuring, why busy
IN_WORKER = "measured in background tuning's worker, the call waits for it"


def tune_aside(store: Store, spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
               context: str, landed: Callable[[Job], None],
               progress: Callable[[str], None] | None = None) -> Tuned | None:
    """Have background tuning's worker measure what the bucket of ``problem`` lacks, under the bucket's claim, and
    wait for it: as ``claimed.tune_bucket`` returns (the bucket's newest rows, seconds measuring or None where nothing
    was measured, why not where another process's claim outlasted the wait); None where the worker could not measure
    it (said in one line): the caller then measures it itself. ``landed`` is the job's hook (``background.request``)."""
    fp, dname = fingerprint(device), DTYPE_NAMES[dtype]
    key5 = (spec.name, bucket_str(spec.bucket(problem)), dname, fp.key, mode)
    what = f"{spec.name} {problem} {dname} {mode} on {device}"
    lease, wait_s = envs.claim_lease_s(), envs.claim_wait_s()
    claim, rows, todo, again, early = claimed.open_bucket(store, spec, key5, what, wait_s, lease)
    if early is not None:
        return early
    slot, have_slot = claimed.slot_key(device), False
    try:
        if again:
            log.info("tiered_ops: %s: its timings were taken on a busy machine; timing them again side by side in "
                     "this process", what)
            return None
        check_fits(spec, problem, dtype, device, mode)
        have_slot, _ = claimed.wait_for(store, slot, f"the measuring slot of {device}", wait_s, lease)
        job, why = background.request(spec, problem, dtype, device, mode, context, key5, [i.name for i in todo],
                                      store, landed, waited=True)
        if job is None:
            log.warning("tiered_ops: %s: background tuning's worker cannot measure it (%s); measuring it in this "
                        "process", what, why.removeprefix(background.NOT_QUEUED))
            return None
        where = f"stored in {store.path}" if store.writable else f"not saved: {store.kept_in_memory}"
        said = claimed.Announce(f"{spec.name} {problem} {dname} {mode} {context} on {device}", todo, device)
        said.start(f"{IN_WORKER}; {where}")
        if progress:
            progress(f"measuring {spec.name} {problem} {dname} {mode} in background tuning's worker")
        renewed, t0 = time.monotonic(), time.perf_counter()

        def tick() -> None:  # the leases renewed while the worker measures; a progress line now and then
            nonlocal renewed
            if time.monotonic() - renewed >= lease / 4:
                renewed = time.monotonic()
                store.claim(claim, lease)
                if have_slot:
                    store.claim(slot, lease)
            said.waiting("measuring in background tuning's worker")

        why = background.wait_for_job(job, envs.blocking_wait_s(), tick)
        if why is not None:
            log.warning("tiered_ops: %s: background tuning's worker did not measure it (%s); measuring it in this "
                        "process", what, why)
            return None
        return store.latest(*key5), time.perf_counter() - t0, None
    finally:
        if have_slot:
            store.release(slot)
        store.release(claim)
