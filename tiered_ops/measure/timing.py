"""Copy-bandwidth ceiling and the two timings of a call.

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

import contextlib
import functools
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


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
        t0 = _clock()
        dst.copy_(src)
        took.append((_clock() - t0) * 1e6)
    gbps = _gbps(src, min(took))
    key = str(device)
    _copy_best[key] = max(_copy_best.get(key, 0.0), gbps)
    return gbps
