"""What ``select_problem`` passes between its steps: the decision asked for (``Asked``) and the rows it is made
from (``Evidence``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..registry import OpSpec, Problem
from ..store.store import Store


@dataclass(frozen=True)
class Asked:
    """One decision asked for: the problem, where, what for, under which policy."""

    spec: OpSpec
    problem: Problem
    dtype: torch.dtype
    device: torch.device
    mode: str
    context: str
    policy: str
    calls: int | None
    budget: int | None
    key: tuple  # its key in the decision table: (op, bucket, dtype, device, mode, context), the bucket computed once
    how: tuple  # the policy it is decided under: (policy, calls, budget)

    published: bool = True  # asked under the process's policy: its decisions go into the table


@dataclass
class Evidence:
    """The rows a decision is made from, and how they came: ``bucket_key`` (op, bucket, dtype, device key, mode) in
    the store's terms; ``near``, the nearest measured bucket's where this one has none; ``compiled``, the compiled
    context's; ``provisional``, tuning in the background with rows missing (``job``: its queued bucket); ``fresh`` and
    ``compiled_fresh``, the fresh implementations of ``rows`` and ``compiled`` by name (``OpSpec.freshness``)."""

    store: Store
    bucket_key: tuple[str, str, str, str, str]
    rows: list[dict]
    near: Any
    compiled: Any
    tune: bool
    tmode: str
    provisional: bool
    job: Any
    tuning: str | None
    busy: str | None
    tuned_s: float | None
    fresh: dict[str, Any]
    compiled_fresh: dict[str, Any]
