"""What a blocking tune says while the caller waits: one WARNING line the first time a process measures (the op, the
problem, the implementations and an estimate of the wait), INFO lines after that, and a progress line whenever a tune
has gone on for ``PROGRESS_EVERY_S`` since its last line.

The wait is an estimate, not a measurement: a figure per tier (``ESTIMATE_S``) summed over the implementations that
can run on the device (one that cannot is stored as unavailable at once).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ..registry import Impl, Tier

log = logging.getLogger(__package__ + ".decide")  # the tuning lines keep select_problem's logger

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
