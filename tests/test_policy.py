"""Policies on stored measurements: fastest, cost-aware margins, cold-start totals, through select_backend."""

import pytest
import torch

import tiered_ops
from tiered_ops import policy
from tiered_ops import select as sel_mod
from tiered_ops.measure import measure
from tiered_ops.registry import get_op
from tiered_ops.store import Store

CPU = torch.device("cpu")


def _c(impl, tier, us, first=0.0, build=None):
    return dict(impl=impl, tier=tier, caller_us=us, first_call_s=first, build_s=build)


def test_cost_aware_margin_arithmetic():
    m = dict(policy.DEFAULT_MARGINS)
    # CUDA 8 % faster than Triton, needs 10 %: Triton; Triton 20 % faster than compile: it qualifies.
    cands = [_c("eager", "eager", 100), _c("compile", "compile", 60), _c("triton", "triton", 50),
             _c("cuda", "cuda", 46)]
    best, why, figs = policy.choose(cands, "cost-aware", tier_margins=m)
    assert best["impl"] == "triton" and "not by its 10% margin" in why
    assert figs["cuda"] == pytest.approx(46 * 1.1) and figs["triton"] == pytest.approx(52.5)
    # CUDA 20 % faster: it wins.
    cands[-1]["caller_us"] = 40
    assert policy.choose(cands, "cost-aware", tier_margins=m)[0]["impl"] == "cuda"
    # a tier that does not beat eager by its margin loses to eager, even if faster
    cands = [_c("eager", "eager", 100), _c("cuda", "cuda", 95)]
    assert policy.choose(cands, "cost-aware", tier_margins=m)[0]["impl"] == "eager"
    assert policy.choose(cands, "fastest")[0]["impl"] == "cuda"


def test_cold_start_counts_first_call_and_build():
    cands = [_c("eager", "eager", 20.0, 0.001), _c("compile", "compile", 10.0, 3.0),
             _c("cuda", "cuda", 8.0, 0.01, build=60.0)]
    assert policy.choose(cands, "cold-start", 1000)[0]["impl"] == "eager"  # 0.021 s vs 3.01 s vs 60.02 s
    best, why, figs = policy.choose(cands, "cold-start", 10**8)  # 2000 s vs 1003 s vs 860 s
    assert best["impl"] == "cuda" and figs["compile"] == pytest.approx(3.0 + 1000.0)
    assert policy.choose(cands, "cold-start", 10**6)[0]["impl"] == "compile"  # 20.0 vs 13.0 vs 68.0


def test_bad_policy_and_margins_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="policy: expected one of fastest, cost-aware, cold-start"):
        tiered_ops.select_backend("muladd", (4,), policy="cheapest")
    with pytest.raises(ValueError, match="calls: expected a positive"):
        tiered_ops.select_backend("muladd", (4,), policy="cold-start", calls=0)
    monkeypatch.setenv("TIERED_OPS_MARGINS", "tpu=0.3")
    with pytest.raises(ValueError, match="unknown tier 'tpu'"):
        policy.margins()
    monkeypatch.setenv("TIERED_OPS_MARGINS", "cuda=0.25")
    assert policy.margins()["cuda"] == 0.25 and policy.margins()["triton"] == 0.05


def test_policies_choose_differently_from_stored_rows(private_store, monkeypatch):
    """The same stored measurements give three different decisions under the three policies."""
    spec = get_op("muladd")
    problem = spec.problem((64, 64))
    # (per-call us, first-call s, correct): implementations that run on any CPU, plus a Triton row that is the
    # fastest but wrong (never chosen) and a CUDA row (unavailable on the CPU, never chosen here)
    figures = {"eager": (30.0, 0.001, 1), "eager_addcmul": (29.0, 0.5, 1), "compile": (20.0, 4.0, 1),
               "triton": (1.0, 0.001, 0), "cuda": (1.0, 0.001, 1)}
    rows = []
    for impl in spec.impls.values():
        r = measure(spec, impl, problem, torch.float32, CPU)
        us, first, ok = figures[impl.name]
        r.update(ok=ok, reason=None if ok else "wrong (planted)", caller_us=us, first_call_s=first)
        rows.append(r)
    Store(private_store).add(rows)
    monkeypatch.setenv("TIERED_OPS_MARGINS", "compile=0.5")
    sel_mod.set_tuning(False)
    try:
        pick = {p: tiered_ops.select_backend("muladd", (64, 64), "fp32", "cpu", policy=p, calls=n)
                for p, n in (("fastest", None), ("cost-aware", None), ("cold-start", 10**5))}
    finally:
        sel_mod.set_tuning(None)
    assert pick["fastest"].name == "compile"
    assert pick["cost-aware"].name == "eager_addcmul"  # compile 20 * 1.5 = 30 does not beat 29
    assert pick["cold-start"].name == "eager"  # 3.001 s vs addcmul 3.4 s vs compile 6.0 s
    assert pick["cold-start"].record["policy"] == "cold-start" and pick["cold-start"].record["calls"] == 10**5
    figs = {c["impl"]: c["policy_figure"] for c in pick["cold-start"].record["candidates"]}
    assert figs["compile"] == pytest.approx(4.0 + 2.0) and figs["triton"] is None and figs["cuda"] is None


def test_default_policy_from_environment(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_POLICY", "cold-start")
    monkeypatch.setenv("TIERED_OPS_CALLS", "7")
    assert sel_mod.default_policy() == ("cold-start", 7)
    sel_mod.set_policy("cost-aware")
    try:
        assert sel_mod.default_policy() == ("cost-aware", None)
    finally:
        sel_mod.set_policy(None)
