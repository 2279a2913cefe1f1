"""Correctness gate and measurement of one implementation at one problem: written once, driven by OpSpec.

Gate: before an implementation is timed at a problem it must match the float64 reference on fresh
random inputs (two seeds) at that problem, and on the op's edge problems (checked once per
implementation, dtype and device in a process). The error ||out-ref||/||ref|| must stay under the
dtype's bound and NaN/Inf must appear exactly where the reference has them. A NaN-filled block of the
output's size is freed just before each call, so with CUDA's caching allocator an unwritten element
usually reads as NaN (on the CPU it reads as whatever was there, still caught as a wrong value).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .registry import DTYPE_NAMES, Impl, Inputs, OpSpec, Problem, rel_error
from .timing import copy_bandwidth_gbps, fingerprint, sync, time_call

SEEDS = (1, 2)  # correctness seeds; timing uses seed 0 (fresh random data, never zeros)
_edge_results: dict[tuple, tuple[bool, float, str | None]] = {}


def _to64(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.to(torch.float64)
    if isinstance(v, (tuple, list)):
        return type(v)(_to64(x) for x in v)
    return v


def _short(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def _poison(inp: Inputs, device: torch.device) -> None:
    first = inp.args[0]
    if isinstance(first, torch.Tensor) and first.numel():
        torch.full((first.numel(),), math.nan, dtype=first.dtype, device=device)


def check_one(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, seed: int
              ) -> tuple[float, str | None]:
    """Relative error of impl vs the float64 reference at one problem and seed; reason when it fails."""
    inp = spec.make_inputs(problem, dtype, device, seed)
    _poison(inp, device)
    try:
        out = impl.fn(*inp.args, **inp.kwargs)
        sync(device)
    except Exception as e:  # a failing candidate is recorded, never raised out of the sweep
        return math.inf, f"raised at {problem} seed {seed}: {_short(e)}"
    ref = spec.reference(*_to64(inp.args), **_to64(inp.kwargs))
    if not isinstance(out, torch.Tensor) or out.dtype != dtype:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        return math.inf, f"wrong output dtype at {problem}: {got}, expected {dtype}"
    err = rel_error(out, ref)
    bound = spec.rtol[dtype]
    if not err <= bound:
        what = "NaN/Inf where the reference is finite (or shape mismatch)" if math.isinf(err) else f"{err:.2e}"
        return err, f"wrong at {problem} seed {seed}: rel error {what} > bound {bound:.1e}"
    return err, None


def gate(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device
         ) -> tuple[float, str | None]:
    """Worst relative error over the seeds at ``problem`` and the edge problems; reason on failure."""
    key = (spec.name, impl.name, impl.source_hash, dtype, str(device))
    if key not in _edge_results:
        worst = 0.0
        for edge in spec.edge_problems():
            err, why = check_one(spec, impl, edge, dtype, device, seed=len(edge.shape))
            worst = max(worst, err)
            if why:
                _edge_results[key] = (False, err, f"edge case: {why}")
                break
        else:
            _edge_results[key] = (True, worst, None)
    ok, worst, why = _edge_results[key]
    if not ok:
        return worst, why
    for seed in SEEDS:
        err, why = check_one(spec, impl, problem, dtype, device, seed)
        worst = max(worst, err)
        if why:
            return err, why
    return worst, None


def measure(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
            mode: str = "fwd") -> dict[str, Any]:
    """Gate, then time one implementation; returns a store row (never raises for a bad candidate)."""
    fp = fingerprint(device)
    row: dict[str, Any] = dict(
        op=spec.name, impl=impl.name, tier=impl.tier.label, mode=mode, problem=str(problem),
        bucket=bucket_str(spec.bucket(problem)), dtype=DTYPE_NAMES[dtype], device_key=fp.key,
        device_type=fp.device_type, gpu_name=fp.name, capability=fp.capability, sm_count=fp.sm_count,
        torch_version=fp.torch, triton_version=fp.triton, cuda_version=fp.cuda, source_hash=impl.source_hash,
        timestamp=time.time(), ok=0,
    )
    why = impl.why_not(device, dtype)
    if why:
        row["reason"] = f"unavailable: {why}"
        return row
    inp = spec.make_inputs(problem, dtype, device, 0)
    t0 = time.perf_counter()
    try:
        impl.fn(*inp.args, **inp.kwargs)  # warm-up: JIT, torch.compile, autotuning; recorded, not timed
        sync(device)
    except Exception as e:
        row.update(reason=f"first call raised: {_short(e)}", first_call_s=time.perf_counter() - t0)
        return row
    row["first_call_s"] = time.perf_counter() - t0
    err, why = gate(spec, impl, problem, dtype, device)
    row["rel_error"] = err if math.isfinite(err) else None
    if why:
        row["reason"] = why
        return row
    row["ok"] = 1
    not_timeable = impl.timeable(device)
    if not_timeable:
        row["reason"] = f"correct; not timed: {not_timeable}"
        return row
    t = time_call(lambda: impl.fn(*inp.args, **inp.kwargs), device)
    nbytes = spec.bytes_moved(problem, dtype)
    copy = copy_bandwidth_gbps(device)
    gbps = nbytes / (t.p50_us * 1e-6) / 1e9 if t.p50_us > 0 else None
    row.update(p20_us=t.p20_us, p50_us=t.p50_us, p80_us=t.p80_us, host_us=t.host_us, caller_us=t.caller_us,
               gbps=gbps, copy_gbps=copy, frac_copy=(gbps / copy) if gbps else None)
    return row


def bucket_str(bucket: tuple) -> str:
    return "|".join(str(b) for b in bucket)
