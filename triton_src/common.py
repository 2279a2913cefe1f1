"""Launch helpers shared by the Triton kernels (block sizes, warps, input checks)."""

from __future__ import annotations

import os

import torch
import triton

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> str | None:
    """Why the Triton tier cannot run on ``device``, or None."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreted():
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU interpreter)"


def timeable(device: torch.device) -> str | None:
    if device.type == "cuda" and not interpreted():
        return None
    return "the Triton interpreter is for correctness, not speed"


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOATS:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.device.type != "cuda" and not interpreted():
        raise ValueError(f"{op}: {name} must be a CUDA tensor (or TRITON_INTERPRET=1 on the CPU), got {t.device}")


def num_warps_for(block: int) -> int:
    """Warps per program for a block of `block` elements: about 8-16 elements per thread."""
    return max(1, min(16, block // 512))


def row_settings(n: int, max_fused: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows of n elements: short rows pack several rows in one program."""
    block = triton.next_power_of_2(max(n, 1))
    if block > max_fused:
        block = max_fused
    rows = max(1, min(16, 2048 // block))
    return block, rows, num_warps_for(block * rows)
