"""Whether a CPU timing ran on a busy machine, and the blocks it is taken in.

On the CPU a call is timed in at least ``CPU_MIN_SAMPLES`` blocks of back-to-back calls, each block long enough to
stand far above the clock's resolution (``cpu_blocks``). ``contention`` says whether the machine was busy meanwhile:
the thread's wait for a CPU (Linux schedstat), block times on multiples of a large quantum, a p80/p20 spread far
beyond a quiet machine's, or a copy-bandwidth probe far below the best copy bandwidth seen.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable


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
_clock = time.perf_counter  # the CPU timings' clock (tests replace it)


@functools.lru_cache(maxsize=None)
def clock_resolution_s() -> float:
    """The smallest step the CPU timings' clock is seen to take (its nominal resolution can be finer than its tick)."""
    steps = []
    for _ in range(20):
        t0 = t1 = _clock()
        while t1 == t0:
            t1 = _clock()
        steps.append(t1 - t0)
    return min(steps)


def _run_delay_s() -> float | None:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux schedstat); None where not exposed."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def cpu_blocks(fn: Callable[[], object], budget_s: float = CPU_BUDGET_S, min_samples: int = CPU_MIN_SAMPLES
               ) -> tuple[list[float], int, float | None]:
    """Time ``fn`` (already warmed up) in blocks of back-to-back calls: (each block's seconds, calls per block, the
    fraction of the timed wall time this thread waited for a CPU, None where unknown). The calls per block double
    until a block lasts twice ``CPU_MIN_BLOCK_S`` (and far above the clock's resolution: a warmer block can run
    faster than the first); then at least ``min_samples`` blocks, more while ``budget_s`` lasts."""
    block_s = 2 * max(CPU_MIN_BLOCK_S, CPU_BLOCK_RESOLUTIONS * clock_resolution_s())
    n = 1
    while True:
        t0 = _clock()
        for _ in range(n):
            fn()
        took = _clock() - t0
        if took >= block_s:
            break
        n *= 2 if took * 4 >= block_s else max(2, min(1 << 20, math.ceil(block_s / max(took, 1e-9))))
    blocks = max(min_samples, min(CPU_MAX_SAMPLES, int(budget_s / took)))
    wait0, wall0 = _run_delay_s(), _clock()
    out = []
    for _ in range(blocks):
        t0 = _clock()
        for _ in range(n):
            fn()
        out.append(_clock() - t0)
    wall, wait1 = _clock() - wall0, _run_delay_s()
    waited = (wait1 - wait0) / wall if wait0 is not None and wait1 is not None and wall > 0 else None
    return out, n, waited


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
