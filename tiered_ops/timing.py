"""Device fingerprint, copy-bandwidth ceiling, and the two timings of a call.

On CUDA a call gets two numbers: the kernel time from ``triton.testing.do_bench`` (median and p20/p80,
L2 flushed between repetitions) and the host time per call over back-to-back calls, which carries the
launch path a model pays (torch.compile's guards, Triton's launcher). The time a caller sees is the
larger of the two: a big kernel is bound by the GPU, a tiny one by its launch path.

On the CPU a call is timed with ``torch.utils.benchmark`` (median over repeated blocks).
"""

from __future__ import annotations

import functools
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
    """Median over 5 batches of back-to-back calls, in microseconds per call."""
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
    return statistics.median(per)


def time_call(fn: Callable[[], object], device: torch.device) -> Timing:
    """Time ``fn`` (already warmed up) the way the device allows."""
    if device.type == "cuda":
        import triton.testing

        with torch.cuda.device(device):
            p20, p50, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
            host = host_time_per_call(fn, device)
        return Timing(p20 * 1e3, p50 * 1e3, p80 * 1e3, host)
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
