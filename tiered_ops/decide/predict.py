"""Decisions with tuning off: the nearest measured bucket, and each candidate's time predicted at the requested
shape from its measurements (launch path, kernel time by bytes moved)."""

from __future__ import annotations

import math

import torch

from ..buckets import distance
from ..measure.measure import bucket_str
from ..registry import OpSpec, Problem
from ..store.store import Store


def _bucket_distance(a: str, b: str) -> float:
    """How far apart two stored buckets are (``tiered_ops.buckets.distance``)."""
    return distance(a, b)


BANDWIDTH_BOUND = 4.0  # a kernel time this many times an implementation's shortest one is read as bandwidth


def predict(spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str, near: list[dict], measured: list[dict]
            ) -> list[dict]:
    """The ``near`` rows (the nearest measured bucket's) with each caller time predicted at ``problem`` from every
    fresh measurement of the same implementation at buckets of the same flags (``measured``): the larger of
    its launch path (its fastest host time at any of them: the launch path does not grow with the shape) and its
    kernel time there, its shortest kernel time (the latency) plus the bytes ``problem`` moves at the bandwidth it
    reached beyond that latency in the bucket nearest ``problem`` whose kernel time is at least BANDWIDTH_BOUND x
    that latency (a launch-bound bucket says nothing of bandwidth). On an H100, taking the nearest
    bucket's times as they were chose a Triton softmax of 98 us per call (launch path) over eager's 27 at
    2048x3000, after the bucket 16384x4096 whose kernels dwarf any launch path."""
    target, nbytes = bucket_str(spec.bucket(problem)), spec.mode_bytes(problem, dtype, mode)
    latest: dict[tuple[str, str], dict] = {}
    for r in measured:  # ordered by id: the newest per (implementation, bucket) wins
        if (r["ok"] and r["p50_us"] and r["gbps"] and r["host_us"] is not None and spec.fresh_impl(r) is not None
                and _bucket_distance(target, r["bucket"]) < math.inf):
            latest[(r["impl"], r["bucket"])] = r
    out = []
    for r in near:
        mine = [x for (impl, _), x in latest.items() if impl == r["impl"]]
        if not mine or not r["ok"] or r["caller_us"] is None:
            out.append(r)
            continue
        latency = min(x["p50_us"] for x in mine)
        kernel = latency
        bound = [x for x in mine if x["p50_us"] >= BANDWIDTH_BOUND * latency]
        if bound:
            x = min(bound, key=lambda x: _bucket_distance(target, x["bucket"]))
            moved = x["gbps"] * 1e3 * x["p50_us"]  # bytes: GB/s x us
            kernel = latency + nbytes * (x["p50_us"] - latency) / moved
        out.append(dict(r, caller_us=max(min(x["host_us"] for x in mine), kernel), kernel_us=kernel, predicted=True))
    return out


def nearest_bucket(store: Store, spec: OpSpec, bucket: str, dtype: str, device_key: str, mode: str) -> str | None:
    """The measured bucket closest to ``bucket`` (same flags; nearest in log2 of the sizes), or None."""
    best = min(((_bucket_distance(bucket, b), b) for b in store.buckets(spec.name, dtype, device_key, mode)
                if b != bucket), default=(math.inf, None))
    return best[1] if best[0] < math.inf else None
