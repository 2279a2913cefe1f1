"""Every ``TIERED_OPS_*`` environment variable the package reads, in one place (read at each use, so a process or a
test that sets one later sees it)."""

from __future__ import annotations

import os
from pathlib import Path

OFF = ("0", "false", "no", "off")


TUNE_MODES = ("off", "blocking", "background")


def tune_mode() -> str:
    """TIERED_OPS_TUNE as a mode: ``off`` (0, false, no, off), ``background`` (a call with no stored decision runs a
    prediction at once and its bucket is measured by a background thread), else ``blocking`` (1, the default: the
    call measures, then returns)."""
    v = os.environ.get("TIERED_OPS_TUNE", "1").strip().lower()
    return "off" if v in OFF else "background" if v == "background" else "blocking"


COMPILE_CHOICES = ("table", "inductor")


def compile_choice() -> str:
    """TIERED_OPS_COMPILE_CHOICE: who chooses an op's tier inside torch.compile. ``table`` (the default): the stored
    compiled-context decision, else the eager tier. ``inductor``: Inductor's custom-op autotuning benchmarks the
    tiers that can run in a graph inside the caller's compile and keeps the fastest (``decide/inductor_choice.py``),
    where the installed torch has it (else ``table``, said once)."""
    v = os.environ.get("TIERED_OPS_COMPILE_CHOICE", "table").strip().lower()
    if v not in COMPILE_CHOICES:
        raise ValueError(f"TIERED_OPS_COMPILE_CHOICE must be one of {', '.join(COMPILE_CHOICES)}, got {v!r}")
    return v


def compile_choice_min_speedup() -> float:
    """TIERED_OPS_COMPILE_CHOICE_MIN_SPEEDUP: in the ``inductor`` compile choice, how much faster than the op's plain
    eager call (Inductor's fallback) another choice must be to be taken (torch's ``min_speedup_threshold``, where the
    installed torch has it; default 1.0: any speedup)."""
    return max(1.0, float(os.environ.get("TIERED_OPS_COMPILE_CHOICE_MIN_SPEEDUP", "1.0")))


def policy() -> str:
    """TIERED_OPS_POLICY: the process's default policy (fastest, cost-aware, cold-start)."""
    return os.environ.get("TIERED_OPS_POLICY", "fastest")


def calls() -> int | None:
    """TIERED_OPS_CALLS: expected calls of the cold-start policy."""
    v = os.environ.get("TIERED_OPS_CALLS")
    return int(v) if v else None


def margins() -> str:
    """TIERED_OPS_MARGINS: per-tier margins over the tier below, e.g. ``triton=0.05,cuda=0.1``."""
    return os.environ.get("TIERED_OPS_MARGINS", "")


def db() -> str | None:
    """TIERED_OPS_DB: the store's path (the CLI's --db overrides it)."""
    return os.environ.get("TIERED_OPS_DB") or None


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/tiered_ops, or ~/.cache/tiered_ops."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiered_ops"


def report_dir() -> Path:
    """TIERED_OPS_REPORT: the folder under which ``tiered-ops bench`` writes its report (one sub-folder per device)
    unless given ``--out``; default ``tiered_ops_report`` in the working directory."""
    return Path(os.environ.get("TIERED_OPS_REPORT") or "tiered_ops_report")


def build_dir() -> str | None:
    """TIERED_OPS_BUILD_DIR: where the CUDA extension is built."""
    return os.environ.get("TIERED_OPS_BUILD_DIR") or None


def verbose_build() -> bool:
    """TIERED_OPS_VERBOSE_BUILD=1: ninja's output while building the CUDA extension."""
    return os.environ.get("TIERED_OPS_VERBOSE_BUILD") == "1"


def contention_check() -> bool:
    """TIERED_OPS_CONTENTION_CHECK: notice a busy machine while timing on the CPU (default on). ``0`` stores CPU
    timings as taken: for a machine known to be shared, whose figures are read with that in mind (the test suite,
    which tests the check itself separately, runs its sweeps so)."""
    return os.environ.get("TIERED_OPS_CONTENTION_CHECK", "1").lower() not in OFF


def gate_bytes(device_type: str) -> int:
    """TIERED_OPS_GATE_BYTES: the float64 correctness check's budget at a problem, bytes moved at float64 (default
    64 MiB on the CPU, 4 GiB on a GPU); a larger row-wise problem is checked on a sample of its rows."""
    v = os.environ.get("TIERED_OPS_GATE_BYTES")
    return int(float(v)) if v else (64 << 20 if device_type == "cpu" else 4 << 30)


def gate_helpers(device_type: str) -> int:
    """TIERED_OPS_GATE_HELPERS: how many extra worker processes background tuning keeps on a device to split a gate's
    edge checks with its measuring worker (each holds a CUDA context of its own). Default: on a GPU, a quarter of the
    host's cores, at most 3; on the CPU none (they would take the cores that the CPU tiers run on)."""
    v = os.environ.get("TIERED_OPS_GATE_HELPERS")
    if v:
        return max(0, int(v))
    return min(3, (os.cpu_count() or 1) // 4) if device_type == "cuda" else 0


def first_calls_aside() -> bool:
    """TIERED_OPS_FIRST_CALLS_ASIDE: background tuning's gate helpers make a bucket's compiled candidates' first calls
    while the worker times the others (default on; 0 leaves them to the worker, as an A/B of what it saves)."""
    return os.environ.get("TIERED_OPS_FIRST_CALLS_ASIDE", "1").strip().lower() not in OFF


def blocking_aside(device_type: str) -> bool:
    """TIERED_OPS_BLOCKING_ASIDE: whether blocking tuning hands a missing bucket to background tuning's worker and gate
    helpers and waits for it to land: ``auto`` (the default) on a GPU, where the helpers compile the candidates'
    kernels at once (benchmarks/first_call.py --blocking-only: the faster first call there); ``1`` on any device;
    ``0`` never (the call measures in its own process, kernel after kernel)."""
    v = os.environ.get("TIERED_OPS_BLOCKING_ASIDE", "auto").strip().lower()
    return device_type == "cuda" if v == "auto" else v not in OFF


def blocking_wait_s() -> float:
    """TIERED_OPS_BLOCKING_WAIT_S: how long a blocking call waits for background tuning's worker to measure its bucket
    before it measures the bucket in its own process (default 600 s)."""
    return max(0.0, float(os.environ.get("TIERED_OPS_BLOCKING_WAIT_S", "600")))


def retime_s() -> float:
    """TIERED_OPS_RETIME_S: how long after a bucket's timings were taken on a busy machine they are taken again (the
    back-off's first step; it doubles with each busy pass, up to 32 x; default 60 s)."""
    return max(0.0, float(os.environ.get("TIERED_OPS_RETIME_S", "60")))


def claim_wait_s() -> float:
    """TIERED_OPS_CLAIM_WAIT_S: how long a process waits for another process sharing its store to measure a bucket
    that process has claimed, before deciding provisionally without it (default 120 s)."""
    return max(0.0, float(os.environ.get("TIERED_OPS_CLAIM_WAIT_S", "120")))


def claim_lease_s() -> float:
    """TIERED_OPS_CLAIM_LEASE_S: the lease of a bucket's claim, renewed before each candidate is measured: a claim
    whose owner died on another host (one of this host is seen dead at once) blocks the bucket this long at most
    (default 600 s)."""
    return max(1.0, float(os.environ.get("TIERED_OPS_CLAIM_LEASE_S", "600")))
