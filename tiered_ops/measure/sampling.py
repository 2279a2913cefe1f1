"""What a timing is made of apart from any device and any call: the figures (``Timing``) and their statistics, the
clock and the signals that the machine was busy while a CPU timing ran (``contention``), the GPU timing's sample counts
(``gpu_samples``), and the window without garbage collection every timing runs in. ``timing`` runs the calls on a
device and makes its figures of them (these names are importable there too).

A CPU call is timed in at least ``CPU_MIN_SAMPLES`` blocks of back-to-back calls, each long enough to stand far above
the clock's resolution; the blocks say whether the machine was busy while they ran: the thread's wait for a CPU (Linux
schedstat), block times on multiples of a large quantum, a p80/p20 spread far beyond a quiet machine's, or a
copy-bandwidth probe far below the best copy bandwidth seen.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import dataclass
from typing import Iterator


def quantile(sorted_values: list[float], f: float) -> float:
    """The ``f`` quantile of already sorted values, nearest rank below (as the timings' p20/p80)."""
    return sorted_values[min(len(sorted_values) - 1, int(f * len(sorted_values)))]


CPU_MIN_SAMPLES = 10  # blocks per CPU timing: p20 and p80 are order statistics over at least this many
CPU_MAX_SAMPLES = 200
CPU_MIN_BLOCK_S = 1e-3  # a block lasts at least this long, and CPU_BLOCK_RESOLUTIONS x the clock's resolution
CPU_BLOCK_RESOLUTIONS = 1000
CPU_BUDGET_S = 0.2  # more blocks, up to CPU_MAX_SAMPLES, while the budget lasts
WAIT_LIMIT = 0.3  # the timing thread waited for a CPU longer than this fraction of the timing: the cores were busy
SPREAD_LIMIT = 2.0  # p80 / p20 of the blocks beyond this: a quiet machine's blocks of >= 1 ms are within a few %
QUANTUM_MIN_S = 1e-3  # block times all on multiples of a step this large are the scheduler's, not the op's
COPY_PROBE_LIMIT = 0.5  # a copy probe below this fraction of the best copy bandwidth seen: the memory system is shared
clock = time.perf_counter  # the CPU timings' clock


@functools.lru_cache(maxsize=None)
def clock_resolution_s() -> float:
    """The smallest step the CPU timings' clock is seen to take (its nominal resolution can be finer than its tick)."""
    steps = []
    for _ in range(20):
        t0 = t1 = clock()
        while t1 == t0:
            t1 = clock()
        steps.append(t1 - t0)
    return min(steps)


def _run_delay_s() -> float | None:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux schedstat); None where not exposed."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def quantum_s(blocks_s: list[float]) -> float | None:
    """The step all block times sit on when they sit on multiples of one at least ``QUANTUM_MIN_S`` long (a coarse
    clock, or a busy scheduler handing out whole slices), else None. Block times on a fine clock spread continuously."""
    if len(blocks_s) < 3:
        return None
    vals = sorted(blocks_s)
    tol = max(2e-5, 0.01 * vals[0])
    levels = [vals[0]] + [b for a, b in zip(vals, vals[1:]) if b - a > tol]
    steps = [b - a for a, b in zip(levels, levels[1:])]
    if not steps:
        return None  # all blocks alike: a quiet machine's
    q = min(steps + [vals[0]])
    if q < QUANTUM_MIN_S:
        return None
    if all(abs(v / q - round(v / q)) * q <= max(tol, 0.03 * q) for v in vals):
        return q
    return None


def contention(blocks_s: list[float], calls: int, waited: float | None, probe_gbps: float | None = None,
               best_copy_gbps: float | None = None) -> str | None:
    """Why a CPU timing cannot be trusted as an idle machine's, or None: the timing thread waited for a CPU, the
    blocks sit on a large quantum, or their p80/p20 spread is far beyond a quiet machine's (a copy probe taken with
    it far below the best copy bandwidth seen is added to the reason, never the reason alone)."""
    why = []
    if waited is not None and waited > WAIT_LIMIT:
        why.append(f"the timing thread waited for a CPU {waited:.0%} of the time (limit {WAIT_LIMIT:.0%})")
    q = quantum_s(blocks_s)
    if q is not None:
        why.append(f"block times on multiples of {q * 1e3:.1f} ms ({calls} call(s) per block)")
    vals = sorted(blocks_s)
    lo, hi = quantile(vals, 0.2), quantile(vals, 0.8)
    if lo > 0 and hi / lo > SPREAD_LIMIT:
        why.append(f"p80/p20 = {hi / lo:.1f} over {len(vals)} blocks (limit {SPREAD_LIMIT:g})")
    # A copy probe alone says nothing: on an idle 2-core VM it reads half the best copy seen from one probe to the
    # next (a default CPU sweep flagged rows so). It corroborates a busy machine another signal found.
    if why and probe_gbps is not None and best_copy_gbps and probe_gbps < COPY_PROBE_LIMIT * best_copy_gbps:
        why.append(f"copy probe {probe_gbps:.1f} GB/s < {COPY_PROBE_LIMIT:g} x the best copy bandwidth seen "
                   f"{best_copy_gbps:.1f} GB/s")
    return "; ".join(why) or None


@dataclass
class Timing:
    p20_us: float
    p50_us: float
    p80_us: float
    host_us: float  # per call, issuing back-to-back calls (CUDA), fastest batch; equals p50 on the CPU
    host_p20_us: float | None = None  # the spread of the host batches (CUDA); None on the CPU
    host_p80_us: float | None = None
    samples: int | None = None  # the CPU's blocks (each a per-call time); None on CUDA
    contended: str | None = None  # the CPU: why the machine looked busy while this was timed (see ``contention``)

    @property
    def caller_us(self) -> float:
        """What a caller sees per call: bound by the GPU for big work, by the launch path for small."""
        return max(self.p50_us, self.host_us)


@dataclass(frozen=True)
class RowFigures:
    """What a measurement's row takes from its timing (``timing.time_row``). ``timing`` None: the step between the quick
    look and the full timing ended the row, nothing timed after it."""

    timing: Timing | None
    long: bool = False  # a long GPU call (``timing.long_call``, asked where there is a bar): timed in full at once
    pruned_at_us: float | None = None  # the quick look's caller p20, above the bar: the figures are that look's
    peaked: bool = False  # the peak was taken (not where a quick look before the step between ended the row)
    peak_bytes: int | None = None
    copy_gbps: float | None = None
    gbps: float | None = None  # the bytes given over the timing's p50 (the op's own bandwidth where it runs alone)
    busy: str = ""  # why every try of the full timing looked taken on a busy machine ("" once one did not)


LONG_CALL_MS = 50.0  # a call at least this long (synchronized): its timing is bounded by time, not by sample counts
LONG_PROBES = 2  # a long call's probe calls (the enqueue time, the estimate); a short call's: 5
LONG_MIN_SAMPLES = {100.0: 5, 10.0: 3}  # a long call's fewest timed samples, by rep_ms (the full timing's, the quick)
GPU_BUDGET_MS = 1000.0  # the timed repetitions' GPU time, at most (a short call's floor of 20 samples comes first)


def gpu_samples(est_ms: float, per_rep_ms: float, rep_ms: float, long: bool = False) -> int:
    """The timed calls of ``gpu_times_ms``: ``rep_ms`` of kernel time, at most 300 and ``GPU_BUDGET_MS`` of
    repetitions (flush and sleep counted), at least 20. For a long call the budget comes first: the floor of 20
    made a 0.5 s call time 20 samples (10 s) in each of a measurement's two timings, its quick look as many as
    its full timing; it takes ``GPU_BUDGET_MS / per_rep_ms`` samples (the quick look a tenth of that), at least
    ``LONG_MIN_SAMPLES``. A call shorter than ``LONG_CALL_MS`` takes what it took before (the same method)."""
    if not long:
        return max(20, min(int(rep_ms / est_ms), 300, int(GPU_BUDGET_MS / per_rep_ms)))
    floor = LONG_MIN_SAMPLES.get(rep_ms, 5)
    return max(floor, min(300, int(GPU_BUDGET_MS * rep_ms / 100.0 / per_rep_ms)))


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection inside a timed window (as timeit): a collection pause is the caller's, not the op's.
    Nothing is collected before the window either: with Inductor and Triton loaded a process holds ~0.5-1 M objects,
    and a full collection took 0.3 s per timing in a sweep on an H100 (more than the timing itself)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
