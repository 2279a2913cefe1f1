"""The device fingerprint: what makes a timing valid only on this machine (GPU, its capability and SM count,
torch, Triton and CUDA versions, the host's CPU model). Stored with every row; a decision reads only its own."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import re
import sys
from dataclasses import dataclass

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
    host: str = "-"  # the host's CPU model: a launch path's time (host_us) is the host's as much as the GPU's

    @property
    def key(self) -> str:
        return (f"{self.name}|cc{self.capability}|sm{self.sm_count}|torch{self.torch}|triton{self.triton}"
                f"|cuda{self.cuda}|host{self.host}")

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """The host's CPU model: /proc/cpuinfo's first "model name" (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    """Triton's ``__version__`` without importing Triton where it is not imported yet (0.4 s or more, paid by the
    first call of a process): read from its ``__init__.py``; "none" where it is not installed."""
    mod = sys.modules.get("triton")
    if mod is not None:
        return getattr(mod, "__version__", "none")
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "none"
    try:
        with open(spec.origin, encoding="utf-8") as f:
            found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", f.read(), re.M)
    except OSError:
        found = None
    if found:
        return found.group(1)
    try:  # a layout that sets its version otherwise
        import triton

        return triton.__version__
    except Exception:  # triton is optional on some CPU platforms
        return "none"


@functools.lru_cache(maxsize=None)
def fingerprint(device: torch.device) -> Fingerprint:
    tv = triton_version()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return Fingerprint(
            "cuda", p.name, f"{p.major}.{p.minor}", p.multi_processor_count, torch.__version__, tv,
            torch.version.cuda or "none", host_cpu(),
        )

    name = platform.processor() or platform.machine() or "cpu"
    return Fingerprint("cpu", f"cpu-{name}", "-", os.cpu_count() or 1, torch.__version__, tv, "none", host_cpu())
