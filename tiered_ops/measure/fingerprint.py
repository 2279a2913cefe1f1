"""The device fingerprint: what makes a timing valid only on this machine (GPU, its capability and SM count,
torch, Triton and CUDA versions, the host's CPU model). Stored with every row; a decision reads only its own."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

from ..environment import triton_version


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

    @functools.cached_property
    def key(self) -> str:
        """The fingerprint as the store's ``device_key`` (made once: every row read or written names it)."""
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
