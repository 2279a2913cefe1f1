"""Copy-bandwidth ceiling and the two timings of a call, on a device (what a timing is made of apart from the device:
``sampling``, whose names are importable here too).

On CUDA a call gets two numbers: the kernel time (median and p20/p80 over calls timed with CUDA events,
L2 flushed between repetitions as ``triton.testing.do_bench`` does, the GPU kept ahead of the host: see
``gpu_times_ms``) and the host time per call: what issuing back-to-back calls costs the host, the GPU not
waited for, which is the launch path a model pays (torch.compile's guards, Triton's launcher, autograd). The
time a caller sees is the larger of the two: a big kernel is bound by the GPU, a tiny one by its launch path.
Both come with a p20-p80 spread, so a decision between two timings can tell a margin from noise.

On the CPU a call is timed in at least ``CPU_MIN_SAMPLES`` blocks of back-to-back calls, each block long enough to
stand far above the clock's resolution (``cpu_blocks``); p20/p50/p80 are taken over the blocks, and the timing says
whether the machine was busy while it ran (``contention``): the thread's wait for a CPU (Linux schedstat), block times
on multiples of a large quantum, a p80/p20 spread far beyond a quiet machine's, or a copy-bandwidth probe far below
the best copy bandwidth seen. Interference only ever adds time, so the copy bandwidth the results are compared with
is the best seen in the process.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from typing import Callable

import torch

from ..envs import contention_check
from .sampling import (
    CPU_BLOCK_RESOLUTIONS,
    CPU_BUDGET_S,
    CPU_MAX_SAMPLES,
    CPU_MIN_BLOCK_S,
    CPU_MIN_SAMPLES,
    GPU_BUDGET_MS,
    LONG_CALL_MS,
    LONG_MIN_SAMPLES,
    LONG_PROBES,
    WAIT_LIMIT,
    RowFigures,
    Timing,
    _run_delay_s,
    clock,
    clock_resolution_s,
    contention,
    gpu_samples,
    no_gc,
    quantile,
)

__all__ = [  # the timing's own names, and those of ``sampling`` that callers and tests import from here
    "COPY_BYTES", "CPU_BUDGET_S", "CPU_MIN_BLOCK_S", "CPU_MIN_SAMPLES", "FLUSH_BYTES", "FULL", "GPU_BUDGET_MS",
    "LONG_CALL_MS", "LONG_MIN_SAMPLES", "QUICK", "WAIT_LIMIT", "batch_times_us", "contention", "copy_bandwidth_gbps",
    "_copy_best", "copy_probe_gbps", "cpu_blocks", "cpu_timing", "cuda_index", "_cycles_per_us", "default_device",
    "gpu_samples", "gpu_times_ms", "host_time_per_call", "no_gc", "one_call_s", "quantile", "_run_delay_s", "sync",
    "time_call", "Timing", "COPY_BOUND", "_beyond_copy", "long_call", "peak_bytes", "RowFigures", "time_row",
]

log = logging.getLogger(__name__)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def cuda_index(dev: torch.device) -> int:
    """The index of a CUDA device asked for (the current one where ``dev`` names none); a ValueError where torch sees
    no CUDA device."""
    if not torch.cuda.is_available():
        why = "torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise ValueError(f"device: {dev} asked for, but {why} (torch {torch.__version__}); use device='cpu'")
    return torch.cuda.current_device() if dev.index is None else dev.index


def one_call_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, synchronized before and after (the GPU's time for a GPU-bound call)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return max(time.perf_counter() - t0, 1e-6)


def batch_times_us(fn: Callable[[], object], device: torch.device, budget_s: float, batches: int = 5,
                   wait: bool = False, one_s: float | None = None, min_calls: int = 3) -> list[float]:
    """Host time per call (us) of each of ``batches`` batches of back-to-back calls (the GPU synchronized before each
    batch, untimed). ``wait=False``: timed up to the return of the last call, the GPU not waited for: the launch path
    a caller pays (a GPU-bound call returns early and reads below its kernel time; one that synchronizes inside
    waits and reads it). ``wait=True``: up to a final synchronize, the throughput of back-to-back calls. A batch
    holds ``budget_s / batches`` of calls, at least ``min_calls``, the length of one call taken from one untimed
    call first, or ``one_s`` where the caller has it."""
    one = one_s if one_s is not None else one_call_s(fn, device)
    n = int(min(max(budget_s / batches / one, min_calls), 2000))
    per = []
    for _ in range(batches):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if wait:
            sync(device)
        per.append((time.perf_counter() - t0) / n * 1e6)
    sync(device)
    return per


def host_time_per_call(fn: Callable[[], object], device: torch.device, budget_s: float = 0.05) -> float:
    """Throughput of back-to-back calls, GPU waited for (the dispatch target compares launch-bound calls with it; a
    measurement's host time is the issue time, :func:`batch_times_us` without ``wait``). Fastest of 5 batches, in
    microseconds per call: interference from other work on the host only ever adds time (the median let it
    through: an H100 run of 2026-11-23 has layer_norm's Triton host time at 4x its 367 us kernel time)."""
    return min(batch_times_us(fn, device, budget_s, wait=True))


@functools.lru_cache(maxsize=None)
def _cycles_per_us(device: torch.device) -> float:
    """The GPU clock as ``torch.cuda._sleep`` counts it (cycles per microsecond), measured once."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(4_000_000)
        end.record()
        end.synchronize()
        return 4_000_000 / (start.elapsed_time(end) * 1e3)


FLUSH_BYTES = 256 << 20  # as triton.testing.do_bench: more than any GPU's L2


def gpu_times_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
                 long: bool = False) -> list[float]:
    """GPU time of each of many calls of ``fn`` (ms), L2 flushed before each, the way ``do_bench`` does it, with one
    change: the GPU sleeps before each timed call for twice the host's time to enqueue it. Without that, a call
    whose host path (Python launcher, autograd, guards) takes longer than the flush leaves the GPU idle between
    the start event and the kernel, and the "kernel time" carries host time and its jitter: seen on the H100 as
    a Triton kernel at 417 us median (p20 309, p80 680) that takes 140 us. Host cost is measured separately.
    ``long`` (a call of at least ``LONG_CALL_MS``): fewer probe calls, no warm-up beyond them, and the samples
    ``gpu_samples`` allows a long call."""
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    cyc = _cycles_per_us(device)
    probes = LONG_PROBES if long else 5
    enq = []
    for _ in range(probes):
        sync(device)
        t0 = time.perf_counter()
        fn()
        enq.append((time.perf_counter() - t0) * 1e6)
    sync(device)
    sleep_cycles = int((2 * statistics.median(enq) + 20) * cyc)

    def timed(n: int) -> list[float]:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in ev:
            cache.zero_()
            torch.cuda._sleep(sleep_cycles)
            start.record()
            fn()
            end.record()
        sync(device)
        return [s.elapsed_time(e) for s, e in ev]

    est = max(statistics.median(timed(probes)), 1e-3)
    per_rep = est + sleep_cycles / cyc / 1e3 + 0.1  # + the flush
    # The warm-up lasts about warmup_ms of wall time, each repetition counted with its flush and sleep (a warm-up
    # counted in kernel time alone ran ~200 ms for every microsecond kernel: a fifth of a sweep's time). A long
    # call is warm: made before the timing (a measurement's first call) and by the probes.
    timed(max(0 if long else 1, int(warmup_ms / per_rep)))
    return timed(gpu_samples(est, per_rep, rep_ms, long))


def cpu_blocks(fn: Callable[[], object], budget_s: float = CPU_BUDGET_S, min_samples: int = CPU_MIN_SAMPLES
               ) -> tuple[list[float], int, float | None]:
    """Time ``fn`` (already warmed up) in blocks of back-to-back calls: (each block's seconds, calls per block, the
    fraction of the timed wall time this thread waited for a CPU, None where unknown). The calls per block double
    until two blocks in a row last twice ``CPU_MIN_BLOCK_S`` (and far above the clock's resolution: a warmer block
    can run faster than the first); then at least ``min_samples`` blocks, more while ``budget_s`` lasts."""
    block_s = 2 * max(CPU_MIN_BLOCK_S, CPU_BLOCK_RESOLUTIONS * clock_resolution_s())

    def block(n: int) -> float:
        t0 = clock()
        for _ in range(n):
            fn()
        return clock() - t0

    n = 1
    while True:
        took = block(n)
        # A block long enough once may be one preempted call (a 6 us op read 4 ms on a busy 2-core host): it counts
        # when a second block of as many calls also lasts long enough; else the shorter one sets the next size.
        if took >= block_s and (took := min(took, block(n))) >= block_s:
            break
        n *= 2 if took * 4 >= block_s else max(2, min(1 << 20, math.ceil(block_s / max(took, 1e-9))))
    blocks = max(min_samples, min(CPU_MAX_SAMPLES, int(budget_s / took)))
    wait0, wall0 = _run_delay_s(), clock()
    out = [block(n) for _ in range(blocks)]
    wall, wait1 = clock() - wall0, _run_delay_s()
    waited = (wait1 - wait0) / wall if wait0 is not None and wait1 is not None and wall > 0 else None
    return out, n, waited


QUICK = dict(host_budget_s=0.005, warmup_ms=5.0, rep_ms=10.0, cpu_budget_s=0.02, cpu_samples=5)  # a first look
FULL = dict(host_budget_s=0.025, warmup_ms=25.0, rep_ms=100.0, cpu_budget_s=None, cpu_samples=None)


def time_call(fn: Callable[[], object], device: torch.device, quick: bool = False) -> Timing:
    """Time ``fn`` (already warmed up) the way the device allows. ``quick``: a short first look (``QUICK``: about a
    tenth of the samples and time), for a sweep to tell a clearly slower candidate before timing it in full."""
    k = QUICK if quick else FULL
    if device.type == "cuda":
        # The host time is taken in two windows of 5 batches, before and after the GPU timing: the fastest batch is
        # the figure (a burst of other work on the host, a compile worker starting, the OS, only ever adds time)
        # and the p20-p80 of all 10 its spread. No garbage collection runs inside the timed windows (as timeit):
        # a collection pause is the caller's, not the op's.
        with no_gc(), torch.cuda.device(device):
            # Timing the host up to a final synchronize would add the GPU's back-to-back time and its noise:
            # on an H100 (2026-11-23) a Triton rms_norm of 184 us kernel time read 247 us, then 202 us.
            # A long call (LONG_CALL_MS) is GPU-bound: its host windows are 2 batches of 1 call each (the floor of
            # 3 calls a batch made them 30 calls), with no untimed call of their own.
            one = one_call_s(fn, device)
            long = one * 1e3 >= LONG_CALL_MS
            hk = dict(batches=2, one_s=one, min_calls=1) if long else {}
            host = batch_times_us(fn, device, k["host_budget_s"], **dict(hk, one_s=one))
            times = sorted(t * 1e3 for t in gpu_times_ms(fn, device, k["warmup_ms"], k["rep_ms"], long))
            host = sorted(host + batch_times_us(fn, device, k["host_budget_s"], **hk))
        return Timing(quantile(times, 0.2), statistics.median(times), quantile(times, 0.8), host[0],
                      quantile(host, 0.2), quantile(host, 0.8))
    return cpu_timing(fn, device, k["cpu_budget_s"] or CPU_BUDGET_S, k["cpu_samples"] or CPU_MIN_SAMPLES)


def cpu_timing(fn: Callable[[], object], device: torch.device, budget_s: float = CPU_BUDGET_S,
               min_samples: int = CPU_MIN_SAMPLES) -> Timing:
    """CPU timing of ``fn`` (already warmed up): p20/p50/p80 of the per-call time over at least ``min_samples``
    blocks, whether the machine was busy meanwhile (a copy probe right after is compared with the best copy
    bandwidth seen, which it raises when higher)."""
    with no_gc():
        blocks, n, waited = cpu_blocks(fn, budget_s, min_samples)
    best = copy_bandwidth_gbps(device)
    probe = copy_probe_gbps(device)
    times = sorted(b / n * 1e6 for b in blocks)
    p50 = statistics.median(times)
    return Timing(quantile(times, 0.2), p50, quantile(times, 0.8), p50, samples=len(times),
                  contended=contention(blocks, n, waited, probe, best))


COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # the copy's size per device type: far beyond the caches
_copy_best: dict[str, float] = {}


def _copy_pair(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randn(COPY_BYTES.get(device.type, COPY_BYTES["cpu"]) // 4, device=device)  # random data, never zeros
    return src, torch.empty_like(src)


@functools.lru_cache(maxsize=None)
def _probe_pair(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _copy_pair(device)  # kept: every CPU timing probes with it


def _gbps(src: torch.Tensor, us: float) -> float:
    return 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling for memory-bound ops: measured on the
    first call; on the CPU the best of it and every copy probe since (a busy machine only ever lowers it)."""
    key = str(device)
    if key not in _copy_best:
        if device.type == "cuda":
            src, dst = _copy_pair(device)
            _copy_best[key] = _gbps(src, time_call(lambda: dst.copy_(src), device).p50_us)
        else:
            src, dst = _probe_pair(device)
            dst.copy_(src)
            blocks, n, _ = cpu_blocks(lambda: dst.copy_(src))
            _copy_best[key] = _gbps(src, statistics.median(blocks) / n * 1e6)
    return _copy_best[key]


def copy_probe_gbps(device: torch.device, copies: int = 3) -> float:
    """A quick copy bandwidth (the fastest of ``copies`` copies of the reference size) for the CPU timings'
    contention check; it raises the best copy bandwidth seen when higher."""
    src, dst = _probe_pair(device)
    took = []
    for _ in range(copies):
        t0 = clock()
        dst.copy_(src)
        took.append((clock() - t0) * 1e6)
    gbps = _gbps(src, min(took))
    key = str(device)
    _copy_best[key] = max(_copy_best.get(key, 0.0), gbps)
    return gbps


def long_call(call: Callable[[], object], device: torch.device, first_s: float) -> bool:
    """Whether ``call`` is a long GPU call (``LONG_CALL_MS``): timed within a time budget, its quick look (the
    pruning's) costs about what its full timing does, so it is never pruned, timed in full at once. Asked (one more
    call, synchronized) only where its first call took that long."""
    if device.type != "cuda" or first_s * 1e3 < LONG_CALL_MS:
        return False
    return one_call_s(call, device) * 1e3 >= LONG_CALL_MS


def peak_bytes(call: Callable[[], object], device: torch.device) -> int | None:
    """Bytes one call allocates above what was allocated before it (its inputs, a retained graph): the CUDA caching
    allocator's peak during the call minus its allocation before. None on the CPU (no allocator statistics)."""
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return int(peak)


COPY_BOUND = 1.5  # an op moving at least the copy's bytes cannot beat the copy bandwidth by more than this


def _beyond_copy(gbps: float | None, copy: float, nbytes: int, device: torch.device) -> str | None:
    """On the CPU, a bandwidth no memory system gives: above COPY_BOUND x the copy bandwidth for an op that moves at
    least the copy's bytes (beyond every cache), so the copy figure or this timing was taken on a busy machine."""
    if device.type != "cpu" or not gbps or nbytes < 2 * COPY_BYTES["cpu"] or gbps <= COPY_BOUND * copy:
        return None
    return f"{gbps:.1f} GB/s is {gbps / copy:.2f} x the copy bandwidth {copy:.1f} GB/s (limit {COPY_BOUND:g} x)"


def _figures(t: Timing, device: torch.device, nbytes: int) -> tuple[float, float | None]:
    """(the copy bandwidth, the op's bandwidth at ``t``'s p50) for a row timed as ``t``."""
    return copy_bandwidth_gbps(device), nbytes / (t.p50_us * 1e-6) / 1e9 if t.p50_us > 0 else None


def time_row(call: Callable[[], object], device: torch.device, first_s: float, nbytes: int, *,
             bar_us: float | None = None, look_first: bool = False, between: Callable[[], bool] | None = None,
             check_busy: bool | None = None, tries: int = 3, pause_s: float = 0.2, label: tuple[object, ...] = ()
             ) -> RowFigures:
    """A measurement's timing of ``call`` (made once already, in ``first_s``), moving ``nbytes``, in the order it
    runs on the device. ``bar_us`` (successive halving) asks for a quick look (``time_call(quick=True)``): where its
    caller p20 lies above the bar, the row ends with that look's figures (``pruned_at_us``), unless the call is long
    (``long_call``: no look) or the look itself looked taken on a busy machine. ``look_first``: the look comes before
    ``between`` (the measurement's step there, its gate: False ends the row untimed), else after it and the peak.
    Then the full timing, taken again up to ``tries`` times in all, ``pause_s`` apart, while it looks taken on a busy
    machine (its CPU signals, or a bandwidth beyond the copy's: ``_beyond_copy``), each such try logged under ``label``
    (what is measured, its parts joined by spaces). ``check_busy`` False: a timing is taken as it is, busy or not;
    None: as ``envs.contention_check`` says, read only where a timing looked busy."""

    def checks() -> bool:  # asked only where a timing looked taken on a busy machine
        return contention_check() if check_busy is None else check_busy

    long = bar_us is not None and long_call(call, device, first_s)
    if long:
        bar_us = None  # its quick look would cost what its full timing does: timed in full at once

    def look(peaked: bool = False, peak: int | None = None) -> RowFigures | None:
        t = time_call(call, device, quick=True)
        lo = max(t.p20_us, t.host_us)  # the low end of what a caller sees
        if lo <= bar_us or (t.contended and checks()):
            return None
        copy, gbps = _figures(t, device, nbytes)
        return RowFigures(t, long, pruned_at_us=lo, peaked=peaked, peak_bytes=peak, copy_gbps=copy, gbps=gbps)

    if bar_us is not None and look_first and (pruned := look()) is not None:
        return pruned
    if between is not None and not between():
        return RowFigures(None, long)
    peak = peak_bytes(call, device)
    if bar_us is not None and not look_first and (pruned := look(True, peak)) is not None:
        return pruned
    for attempt in range(1, tries + 1):
        t = time_call(call, device)
        copy, gbps = _figures(t, device, nbytes)
        busy = "; ".join(w for w in (t.contended, _beyond_copy(gbps, copy, nbytes, device)) if w)
        if not busy or not checks():
            busy = ""
            break
        log.info("%s: %s (attempt %d of %d)", " ".join(map(str, label)), busy, attempt, tries)
        if attempt < tries:
            time.sleep(pause_s)
    return RowFigures(t, long, peaked=True, peak_bytes=peak, copy_gbps=copy, gbps=gbps, busy=busy)
