"""The choice among an op's stored rows under a policy, and the float64 gate of a choice read from another
dtype's measurements before it is returned."""

from __future__ import annotations

import logging

import torch

from ..measure.gate import gate
from ..registry import DTYPE_NAMES, GRAD_MODES, Impl, OpSpec, Problem, Tier
from ..store.rows import caller_range
from ..store.store import Store
from .policy import choose

log = logging.getLogger(__name__)


def _decide(spec: OpSpec, rows: list[dict], dtype: torch.dtype, device: torch.device, policy: str,
            calls: int | None, store: Store, budget: int | None = None) -> tuple[Impl, str, list]:
    """Choose among the correct fresh timed implementations under ``policy``; (impl, reason, candidates)."""
    cands, ok = [], []
    for r in rows:
        impl = spec.fresh_impl(r)
        fresh = impl is not None
        c = {k: r.get(k) for k in ("impl", "tier", "caller_us", "p50_us", "p20_us", "p80_us", "host_us", "host_p80_us",
                                   "gbps", "frac_copy", "rel_error", "ok", "reason", "first_call_s", "peak_bytes")
             } | {"fresh": fresh}
        if fresh and r["ok"] and r["caller_us"] is not None and not r.get("predicted"):
            c["lo"], c["hi"] = caller_range(r)  # a time predicted at another shape has no measured spread
        if fresh and impl.tier == Tier.CUDA and policy == "cold-start":
            meta = store.get_meta(spec.name, impl.name, r["device_key"], impl.source_hash) or {}
            c["build_s"] = meta.get("build_s_extension")
        cands.append(c)
        if (fresh and impl.tier != Tier.PEER and r["ok"] and r["caller_us"] is not None
                and impl.why_not(device, dtype) is None):
            ok.append(c)  # a peer is measured for comparison, never chosen
    best, reason, totals = choose(ok, policy, calls, budget=budget)
    for c in cands:
        c["policy_figure"] = totals.get(c["impl"]) if c in ok else None
    if best is None:
        return spec.impls["eager"], f"{reason}: eager", cands
    return spec.impls[best["impl"]], reason, cands


def _gated(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, rows: list[dict],
           how: tuple, decided: tuple[Impl, str, list]) -> tuple[Impl, str, list]:
    """A decision read from another dtype's measurements, gated at the requested dtype before it is returned.

    Nothing returns an implementation that never passed the float64 gate at the requested dtype: the choice is
    gated now at ``problem`` (the gate alone, no timing; cached per implementation, dtype and device like every
    gate), and one that fails is struck and the choice made again among the rest, eager last."""
    policy, calls, store, budget = how
    impl, reason, cands = decided
    failed: list[str] = []
    while True:
        _, why = gate(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES)
        if why is None:
            break
        failed.append(f"{impl.name} failed the gate at {DTYPE_NAMES[dtype]}: {why}")
        log.warning("%s %s %s: %s", spec.name, problem, DTYPE_NAMES[dtype], failed[-1])
        rows = [r for r in rows if r["impl"] != impl.name]
        if impl.name == "eager":
            break  # nothing left that passes: eager, with the failures on record
        impl, reason, cands = _decide(spec, rows, dtype, device, policy, calls, store, budget)
    gated = f"gated at {DTYPE_NAMES[dtype]} on first use" + (f" ({'; '.join(failed)})" if failed else "")
    return impl, f"{reason}; {gated}", cands
