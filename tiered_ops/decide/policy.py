"""Selection policies: which correct implementation to use, given what each costs per call and up front.

- ``fastest`` (default): the lowest per-call time a caller sees, in the worst of two host states: each candidate's
  regret (its time over the fastest's) is taken as measured and were the host 1.5x slower (a launch-bound call's
  host time moves that much between processes, its kernel time does not), and the one whose larger regret is least
  wins. Where no candidate is launch-bound both states agree and this is the plain fastest.
- ``cost-aware``: a tier is chosen only if its best implementation beats the fastest implementation of
  every cheaper tier by the tier's margin (defaults: compile 0 %, Triton 5 %, CUDA 10 %) and outside the noise
  (when candidates carry ``lo``/``hi``, their p20-p80 range as a caller sees it: a tie goes to the cheaper
  tier); else the fastest among the cheaper tiers that qualify (eager always does) wins.
- ``cold-start`` with N expected calls: minimizes up-front seconds + N x per-call time. Up front is the
  first call at this shape (torch.compile's compile, Triton's JIT) plus, for the CUDA tier, the extension
  build (a process that must build it pays it once).
- ``memory`` with a budget in bytes: the fastest whose peak memory (allocated above the inputs, ``peak_bytes``)
  stays within the budget; where none is measured within it, the one with the smallest peak, and the reason says so.
The candidates are dicts with at least ``impl``, ``tier``, ``caller_us``, ``first_call_s`` and an optional
``build_s``; only correct, fresh, timed ones should be passed in.
"""

from __future__ import annotations

from typing import Any

from .. import envs
from ..registry import Tier
from ..store.rows import HOST_SWING, overlap

POLICIES = ("fastest", "cost-aware", "cold-start", "memory")
DEFAULT_MARGINS: dict[str, float] = {"eager": 0.0, "compile": 0.0, "triton": 0.05, "cuda": 0.10}
DEFAULT_CALLS = 1000


def margins() -> dict[str, float]:
    """Cost-aware margins; ``TIERED_OPS_MARGINS="triton=0.05,cuda=0.2"`` overrides some."""
    out = dict(DEFAULT_MARGINS)
    for item in filter(None, envs.margins().split(",")):
        tier, _, value = item.partition("=")
        if tier.strip() not in out:
            raise ValueError(f"TIERED_OPS_MARGINS: unknown tier {tier!r}; expected one of {', '.join(out)}")
        out[tier.strip()] = float(value)
    return out


def check_policy(policy: str, calls: int | None, budget: int | None = None) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if calls is not None and (not isinstance(calls, int) or calls < 1):
        raise ValueError(f"calls: expected a positive whole number of expected calls, got {calls!r}")
    if policy == "memory" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"budget: the memory policy needs a budget in bytes (a whole number >= 0), got {budget!r}")
    if policy != "memory" and budget is not None:
        raise ValueError(f"budget: only the memory policy takes a budget, not {policy!r}")


def _steady(c: dict[str, Any]) -> float:
    """A candidate's caller time were the host ``HOST_SWING`` slower (its kernel time unchanged). A time predicted at
    another shape (``predicted``) counts its predicted kernel time, not the measured bucket's."""
    host, kernel = c.get("host_us"), c.get("kernel_us") if c.get("predicted") else c.get("p50_us")
    return c["caller_us"] if host is None or kernel is None else max(kernel, host * HOST_SWING)


def _fastest(cands: list[dict[str, Any]]) -> tuple[dict[str, Any], str, dict[str, float]]:
    """The candidate of least worst-case regret over the two host states (as measured; ``HOST_SWING`` slower), the
    lower measured time breaking a tie."""
    totals = {c["impl"]: c["caller_us"] for c in cands}
    best = min(cands, key=lambda c: c["caller_us"])
    floor_now, floor_slow = max(best["caller_us"], 1e-9), max(min(_steady(c) for c in cands), 1e-9)  # a 0 us row

    def worst(c: dict[str, Any]) -> float:
        return max(c["caller_us"] / floor_now, _steady(c) / floor_slow)

    pick = min(cands, key=lambda c: (worst(c), c["caller_us"]))
    if worst(pick) < worst(best):
        return pick, (f"fastest correct in the worst host state ({pick['caller_us']:.1f} us per call, "
                      f"{_steady(pick):.1f} were the host {HOST_SWING:g}x slower; "
                      f"{best['impl']} {best['caller_us']:.1f} and {_steady(best):.1f})"), totals
    return best, f"fastest correct ({best['caller_us']:.1f} us per call)", totals


def _rank(tier: str) -> int:
    return Tier[tier.upper()].value


def _tie(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Both carry a p20-p80 range (``lo``, ``hi``) and the ranges overlap."""
    if any(x.get(k) is None for x in (a, b) for k in ("lo", "hi")):
        return False
    return overlap((a["lo"], a["hi"]), (b["lo"], b["hi"]))


def choose(cands: list[dict[str, Any]], policy: str = "fastest", calls: int | None = None,
           tier_margins: dict[str, float] | None = None, budget: int | None = None
           ) -> tuple[dict[str, Any] | None, str, dict[str, float]]:
    """(chosen candidate or None, why, the figure each candidate was judged by) under ``policy``."""
    check_policy(policy, calls, budget)
    if not cands:
        return None, "no correct timed implementation", {}
    if policy == "memory":
        return _within_budget(cands, budget or 0)
    if policy == "fastest":
        return _fastest(cands)
    if policy == "cold-start":
        n = calls or DEFAULT_CALLS
        totals = {c["impl"]: (c.get("first_call_s") or 0.0) + (c.get("build_s") or 0.0) + n * c["caller_us"] * 1e-6
                  for c in cands}
        best = min(cands, key=lambda c: totals[c["impl"]])
        return best, f"cold start over {n} calls: {totals[best['impl']]:.3f} s in all", totals
    m = tier_margins or margins()
    by_tier: dict[str, dict[str, Any]] = {}
    for c in cands:
        if c["tier"] not in by_tier or c["caller_us"] < by_tier[c["tier"]]["caller_us"]:
            by_tier[c["tier"]] = c
    tiers = sorted(by_tier, key=_rank)
    qualifying, totals = [by_tier[tiers[0]]], {}
    for i, t in enumerate(tiers):
        c = by_tier[t]
        totals[c["impl"]] = c["caller_us"] * (1 + m.get(t, 0.0))  # the time it must beat cheaper tiers with
        cheaper = [by_tier[u] for u in tiers[:i]]
        if cheaper and totals[c["impl"]] < min(x["caller_us"] for x in cheaper) and not any(
                _tie(c, x) for x in cheaper):
            qualifying.append(c)
    best = min(qualifying, key=lambda c: c["caller_us"])
    fastest = min(cands, key=lambda c: c["caller_us"])
    why = f"cost-aware: {best['tier']} ({best['caller_us']:.1f} us per call)"
    if fastest is not best:
        why += (f"; {fastest['impl']} is {best['caller_us'] / fastest['caller_us']:.2f}x faster but not by its "
                f"{m.get(fastest['tier'], 0.0):.0%} margin over cheaper tiers and outside their noise")
    return best, why, totals


def _within_budget(cands: list[dict[str, Any]], budget: int) -> tuple[dict[str, Any], str, dict[str, float]]:
    known = [c for c in cands if c.get("peak_bytes") is not None]
    totals = {c["impl"]: float(c["peak_bytes"]) for c in known}
    fit = [c for c in known if c["peak_bytes"] <= budget]
    if fit:
        best = min(fit, key=lambda c: c["caller_us"])
        return best, (f"memory: fastest within {budget} bytes ({best['caller_us']:.1f} us per call, peak "
                      f"{best['peak_bytes']} bytes)"), totals
    if known:
        best = min(known, key=lambda c: (c["peak_bytes"], c["caller_us"]))
        return best, (f"memory: none measured within {budget} bytes; the smallest peak ({best['peak_bytes']} bytes, "
                      f"{best['caller_us']:.1f} us per call)"), totals
    best = min(cands, key=lambda c: c["caller_us"])
    return best, (f"memory: no peak measured here (CPU rows carry none): fastest ({best['caller_us']:.1f} us per "
                  "call)"), {}
