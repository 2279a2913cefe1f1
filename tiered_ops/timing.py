"""Device fingerprint, copy-bandwidth ceiling, and the two timings of a call.

On CUDA a call gets two numbers: the kernel time (median and p20/p80 over calls timed with CUDA events,
L2 flushed between repetitions as ``triton.testing.do_bench`` does, the GPU kept ahead of the host: see
``gpu_times_ms``) and the host time per call: what issuing back-to-back calls costs the host, the GPU not
waited for, which is the launch path a model pays (torch.compile's guards, Triton's launcher, autograd). The
time a caller sees is the larger of the two: a big kernel is bound by the GPU, a tiny one by its launch path.
Both come with a p20-p80 spread, so a decision between two timings can tell a margin from noise.

On the CPU a call is timed with ``torch.utils.benchmark`` (median over repeated blocks).
"""

from __future__ import annotations

import functools
import gc
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Fingerprint:
    """What makes a timing valid only on this machine."""

    device_type: str
    name: str
    capability: str
    sm_count: int
    torch: str
    triton: str
    cuda: str

    @property
    def key(self) -> str:
        return (f"{self.name}|cc{self.capability}|sm{self.sm_count}|torch{self.torch}|triton{self.triton}"
                f"|cuda{self.cuda}")

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")


@functools.lru_cache(maxsize=None)
def fingerprint(device: torch.device) -> Fingerprint:
    try:
        import triton

        tv = triton.__version__
    except Exception:  # triton is optional on some CPU platforms
        tv = "none"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return Fingerprint(
            "cuda", p.name, f"{p.major}.{p.minor}", p.multi_processor_count, torch.__version__, tv,
            torch.version.cuda or "none",
        )
    import os

    name = platform.processor() or platform.machine() or "cpu"
    return Fingerprint("cpu", f"cpu-{name}", "-", os.cpu_count() or 1, torch.__version__, tv, "none")


@dataclass
class Timing:
    p20_us: float
    p50_us: float
    p80_us: float
    host_us: float  # per call, issuing back-to-back calls (CUDA), fastest batch; equals p50 on the CPU
    host_p20_us: float | None = None  # the spread of the host batches (CUDA); None on the CPU
    host_p80_us: float | None = None

    @property
    def caller_us(self) -> float:
        """What a caller sees per call: bound by the GPU for big work, by the launch path for small."""
        return max(self.p50_us, self.host_us)


def _num(v: object) -> float | None:
    return None if v is None or v != v else float(v)  # None and NaN (a CSV's empty cell) alike


def caller_range(r: object) -> tuple[float, float]:
    """The p20-p80 range of what a caller sees per call, for a stored row (a dict or attributes, the store's columns):
    the kernel's p20-p80 and, where the launch path sets the time, the host batches' spread up to their p80.
    A row without host spread (the CPU's, whose host figure is its median; results from before schema 3) gets
    the caller time scaled by the kernel spread."""
    def get(k: str) -> float | None:
        return _num(r.get(k) if isinstance(r, dict) else getattr(r, k, None))

    caller = float(get("caller_us"))
    p20, p50, p80 = get("p20_us"), get("p50_us"), get("p80_us")
    if p20 is None or p80 is None or not p50:
        return caller, caller
    host, host_p80 = get("host_us"), get("host_p80_us")
    if host is None or host_p80 is None:
        return caller * p20 / p50, caller * p80 / p50
    return max(p20, host), max(p80, host_p80)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two (lo, hi) ranges overlap: the two timings are a tie."""
    return a[1] >= b[0] and b[1] >= a[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def batch_times_us(fn: Callable[[], object], device: torch.device, budget_s: float, batches: int = 5,
                   wait: bool = False) -> list[float]:
    """Host time per call (us) of each of ``batches`` batches of back-to-back calls (the GPU synchronized before each
    batch, untimed). ``wait=False``: timed up to the return of the last call, the GPU not waited for: the launch path
    a caller pays (a GPU-bound call returns early and reads below its kernel time; one that synchronizes inside
    waits and reads it). ``wait=True``: up to a final synchronize, the throughput of back-to-back calls."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max(budget_s / batches / one, 3), 2000))
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


def quantile(sorted_values: list[float], f: float) -> float:
    """The ``f`` quantile of already sorted values, nearest rank below (as the timings' p20/p80)."""
    return sorted_values[min(len(sorted_values) - 1, int(f * len(sorted_values)))]


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


def gpu_times_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100
                 ) -> list[float]:
    """GPU time of each of many calls of ``fn`` (ms), L2 flushed before each, the way ``do_bench`` does it, with one
    change: the GPU sleeps before each timed call for twice the host's time to enqueue it. Without that, a call
    whose host path (Python launcher, autograd, guards) takes longer than the flush leaves the GPU idle between
    the start event and the kernel, and the "kernel time" carries host time and its jitter: seen on the H100 as
    a Triton kernel at 417 us median (p20 309, p80 680) that takes 140 us. Host cost is measured separately."""
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    cyc = _cycles_per_us(device)
    enq = []
    for _ in range(5):
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

    est = max(statistics.median(timed(5)), 1e-3)
    per_rep = est + sleep_cycles / cyc / 1e3 + 0.1  # + the flush
    timed(max(1, min(int(warmup_ms / est), int(200 / per_rep))))
    n = max(20, min(int(rep_ms / est), 300, int(1000 / per_rep)))
    return timed(n)


def time_call(fn: Callable[[], object], device: torch.device) -> Timing:
    """Time ``fn`` (already warmed up) the way the device allows."""
    if device.type == "cuda":
        # The host time is taken in two windows of 5 batches, before and after the GPU timing: the fastest batch is
        # the figure (a burst of other work on the host, a compile worker starting, the OS, only ever adds time)
        # and the p20-p80 of all 10 its spread. No garbage collection runs inside the timed windows (as timeit):
        # a collection pause is the caller's, not the op's.
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(device):
                # Timing the host up to a final synchronize would add the GPU's back-to-back time and its noise:
                # on an H100 (2026-11-23) a Triton rms_norm of 184 us kernel time read 247 us, then 202 us.
                host = batch_times_us(fn, device, 0.025)
                times = sorted(t * 1e3 for t in gpu_times_ms(fn, device))
                host = sorted(host + batch_times_us(fn, device, 0.025))
        finally:
            if enabled:
                gc.enable()
        return Timing(quantile(times, 0.2), statistics.median(times), quantile(times, 0.8), host[0],
                      quantile(host, 0.2), quantile(host, 0.8))
    import torch.utils.benchmark as tb

    m = tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=0.2
    )
    times = sorted(t * 1e6 for t in m.times)
    return Timing(quantile(times, 0.2), m.median * 1e6, quantile(times, 0.8), m.median * 1e6)


@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbps(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written), the ceiling for memory-bound ops."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.randn(nbytes // 4, device=device)  # random data, never zeros
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device)
    return 2 * nbytes / (t.p50_us * 1e-6) / 1e9
