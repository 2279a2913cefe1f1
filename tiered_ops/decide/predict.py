"""Decisions with tuning off: the nearest measured bucket, and each candidate's time predicted at the requested
shape from its measurements (launch path, kernel time by bytes moved).

The nearest bucket is sought in this order: the same flags and dtype; the same flags and the other 16-bit dtype
(same bytes per element); then, where no bucket of the same flags is measured, the fewest flags apart (a
cross_entropy of reduction "sum" read from "mean"), in the same order of dtypes. A choice read from another dtype or
other flags is gated at the requested problem before it is returned (``Near.gate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..buckets import distance, flags_apart
from ..measure.measure import bucket_str
from ..registry import OpSpec, Problem
from ..store.store import Store


def _bucket_distance(a: str, b: str) -> float:
    """How far apart two stored buckets are (``tiered_ops.buckets.distance``)."""
    return distance(a, b)


BANDWIDTH_BOUND = 4.0  # a kernel time this many times an implementation's shortest one is read as bandwidth


def predict(spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str, near: list[dict], measured: list[dict],
            like: str | None = None, launch_us: float | None = None) -> list[dict]:
    """The ``near`` rows (the nearest measured bucket's) with each caller time predicted at ``problem`` from every
    fresh measurement of the same implementation at buckets of the same flags (``measured``): the larger of
    its launch path (its fastest host time at any of them: the launch path does not grow with the shape) and its
    kernel time there, its shortest kernel time (the latency) plus the bytes ``problem`` moves at the bandwidth it
    reached beyond that latency in the bucket nearest ``problem`` whose kernel time is at least BANDWIDTH_BOUND x
    that latency (a launch-bound bucket says nothing of bandwidth). Its latency is its shortest kernel time where
    that is launch-bound (within BANDWIDTH_BOUND x ``launch_us``, the device's shortest kernel of any op), else
    ``launch_us``: on the H100 grid cross_entropy fp32 was swept at bandwidth-bound buckets only, and at 64x262144
    each kernel time was predicted from its shortest bandwidth-bound one as the latency (the CUDA kernel's 221 us at
    4096x32000), 4.7x the time the grid measured there. On an H100, taking the nearest
    bucket's times as they were chose a Triton softmax of 98 us per call (launch path) over eager's 27 at
    2048x3000, after the bucket 16384x4096 whose kernels dwarf any launch path.

    ``like``: the bucket whose flags the measurements must share (the nearest one's, where its flags differ from
    ``problem``'s); by default ``problem``'s own."""
    target, nbytes = bucket_str(spec.bucket(problem)), spec.mode_bytes(problem, dtype, mode)
    like = like or target
    latest: dict[tuple[str, str], dict] = {}
    for r in measured:  # ordered by id: the newest per (implementation, bucket) wins
        if (r["ok"] and r["p50_us"] and r["gbps"] and r["host_us"] is not None and spec.fresh_impl(r) is not None
                and _bucket_distance(like, r["bucket"]) < math.inf):
            latest[(r["impl"], r["bucket"])] = r
    out = []
    for r in near:
        mine = [x for (impl, _), x in latest.items() if impl == r["impl"]]
        if not mine or not r["ok"] or r["caller_us"] is None:
            out.append(r)
            continue
        latency = min(x["p50_us"] for x in mine)
        if launch_us is not None and latency > BANDWIDTH_BOUND * launch_us:
            latency = launch_us  # none of its own buckets launch-bound: the device's launch latency instead
        kernel = latency
        bound = [x for x in mine if x["p50_us"] >= BANDWIDTH_BOUND * latency]
        if bound:
            x = min(bound, key=lambda x: flags_apart(target, x["bucket"])[1])
            moved = x["gbps"] * 1e3 * x["p50_us"]  # bytes: GB/s x us
            kernel = latency + nbytes * (x["p50_us"] - latency) / moved
        host = min(x["host_us"] for x in mine)
        out.append(dict(r, caller_us=max(host, kernel), kernel_us=kernel, host_us=host, predicted=True))
    return out


def nearest_bucket(store: Store, spec: OpSpec, bucket: str, dtype: str, device_key: str, mode: str,
                   other_flags: bool = False) -> str | None:
    """The measured bucket closest to ``bucket`` (same flags; nearest in log2 of the sizes), or None. With
    ``other_flags``: the one whose flags differ least, then nearest in the sizes (``buckets.flags_apart``)."""
    rank = (lambda b: flags_apart(bucket, b)) if other_flags else (lambda b: (0.0, _bucket_distance(bucket, b)))
    best = min(((rank(b), b) for b in store.buckets(spec.name, dtype, device_key, mode) if b != bucket),
               default=((math.inf, math.inf), None))
    return best[1] if best[0][1] < math.inf else None


@dataclass
class Near:
    """The rows of the nearest measured bucket, their times predicted at the requested problem."""

    label: str  # the bucket, with its dtype where another's
    rows: list[dict]
    gate: bool  # read from another dtype or other flags: the choice is gated at the requested problem first


def nearest_rows(store: Store, spec: OpSpec, problem: Problem, dtype: torch.dtype, dname: str, device_key: str,
                 mode: str, other_dtype: bool = True) -> Near | None:
    """The nearest measured bucket's rows (the order in the module's docstring), or None where nothing of the op is
    measured in this mode. ``other_dtype``: also read the other 16-bit dtype's and other flags' buckets (a choice
    that needs a gate at the requested problem, on the calling thread)."""
    bkey = bucket_str(spec.bucket(problem))
    dtypes = [dname, *({"fp16": ["bf16"], "bf16": ["fp16"]}.get(dname, []) if other_dtype else [])]
    for other_flags in (False, True) if other_dtype else (False,):
        for dn in dtypes:
            b = nearest_bucket(store, spec, bkey, dn, device_key, mode, other_flags)
            if b is None:
                continue
            rows = predict(spec, problem, dtype, mode, store.latest(spec.name, b, dn, device_key, mode),
                           store.rows(op=spec.name, dtype=dn, device_key=device_key, mode=mode), like=b,
                           launch_us=store.shortest_kernel(device_key))
            label = b if dn == dname else f"{b} ({dn})"
            return Near(f"{label} (other flags)" if other_flags else label, rows, dn != dname or other_flags)
    return None
