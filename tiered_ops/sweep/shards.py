"""Splitting a sweep's cases: into shards by a stable hash (``--shard i/n``: machines or jobs that each run one shard
cover the sweep exactly once, whatever order the cases come in), and over the visible GPUs (``--gpus``: one worker
process per GPU, each GPU a share of the cases).

A case is one (op, problem, dtype); every mode and implementation of a case stays in the same shard and on the same
GPU, so its edge-case gates and compilations are paid once there.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, TypeVar

import torch

from ..registry import DTYPE_NAMES, OpSpec, Problem

Case = tuple[OpSpec, Problem, torch.dtype]
T = TypeVar("T")


def case_id(case: Case) -> str:
    """The stable text of a case: op, problem and dtype (the same in every process and on every machine)."""
    spec, problem, dtype = case
    return f"{spec.name}|{problem}|{DTYPE_NAMES[dtype]}"


def shard_of(case: Case, n: int) -> int:
    """The shard (1..n) a case falls in: a stable hash of ``case_id``, never Python's salted ``hash``."""
    digest = hashlib.sha256(case_id(case).encode()).digest()
    return int.from_bytes(digest[:8], "big") % n + 1


def check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    i, n = shard
    if n < 1 or not 1 <= i <= n:
        raise ValueError(f"shard: expected i/n with 1 <= i <= n, got {i}/{n}")
    return i, n


def in_shard(cases: Sequence[Case], shard: tuple[int, int]) -> list[Case]:
    """The cases of shard ``i`` of ``n`` (1-based, like ``--shard 2/4``), in their order."""
    i, n = check_shard(shard)
    return [c for c in cases if shard_of(c, n) == i]


def spread(items: Sequence[T], n: int) -> list[list[T]]:
    """``items`` dealt over ``n`` workers in turn (each item once; shares differ by at most one)."""
    if n < 1:
        raise ValueError(f"spread: expected at least one worker, got {n}")
    return [list(items[k::n]) for k in range(n)]


def gpu_devices(gpus: str | int) -> list[torch.device]:
    """The GPUs ``--gpus`` names: ``all`` the visible ones, N the first N; an error naming what is visible when
    there are fewer (or none)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == "all":
        n = visible
    else:
        try:
            n = int(gpus)
        except ValueError:
            raise ValueError(f"gpus: expected 'all' or a number of GPUs, got {gpus!r}") from None
        if n < 1:
            raise ValueError(f"gpus: expected at least 1, got {n}")
    if n < 1 or n > visible:
        raise ValueError(f"gpus: {gpus} asked for, but torch sees {visible} CUDA device(s)")
    return [torch.device("cuda", k) for k in range(n)]
