"""Device fingerprint, copy-bandwidth ceiling, and the two timings of a call.

On CUDA a call gets two numbers: the kernel time (median and p20/p80 over calls timed with CUDA events,
L2 flushed between repetitions as ``triton.testing.do_bench`` does, the GPU kept ahead of the host: see
``gpu_times_ms``) and the host time per call over back-to-back calls, which carries the
launch path a model pays (torch.compile's guards, Triton's launcher). The time a caller sees is the
larger of the two: a big kernel is bound by the GPU, a tiny one by its launch path.

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
    host_us: float  # per call, back-to-back (CUDA); equals p50 on the CPU

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


def host_time_per_call(fn: Callable[[], object], device: torch.device, budget_s: float = 0.05) -> float:
    """Fastest of 5 batches of back-to-back calls, in microseconds per call: interference from other work on the
    host only ever adds time (the median let it through: an H100 run of 2026-11-23 has layer_norm's Triton host
    time at 4x its 367 us kernel time)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max(budget_s / 5 / one, 3), 2000))
    per = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        per.append((time.perf_counter() - t0) / n * 1e6)
    return min(per)


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
        # The host time is taken in two windows, before and after the GPU timing, and the faster one kept: a burst
        # of other work on the host (a compile worker starting, the OS) rarely covers both. No garbage collection
        # runs inside the timed windows (as timeit): a collection pause is the caller's, not the op's.
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(device):
                host = host_time_per_call(fn, device, budget_s=0.025)
                times = sorted(gpu_times_ms(fn, device))
                host = min(host, host_time_per_call(fn, device, budget_s=0.025))
        finally:
            if enabled:
                gc.enable()
        q = lambda f: times[min(len(times) - 1, int(f * len(times)))] * 1e3  # noqa: E731
        return Timing(q(0.2), statistics.median(times) * 1e3, q(0.8), host)
    import torch.utils.benchmark as tb

    m = tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=0.2
    )
    times = sorted(m.times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))] * 1e6  # noqa: E731
    return Timing(q(0.2), m.median * 1e6, q(0.8), m.median * 1e6)


@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbps(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written), the ceiling for memory-bound ops."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.randn(nbytes // 4, device=device)  # random data, never zeros
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device)
    return 2 * nbytes / (t.p50_us * 1e-6) / 1e9
