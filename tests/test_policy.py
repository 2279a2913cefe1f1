"""Policies on stored measurements: fastest, cost-aware margins, cold-start totals, through select_backend."""

import pytest
import torch

import tiered_ops
from tiered_ops.decide import decide as sel_mod
from tiered_ops.decide import policy
from tiered_ops.decide.policy import check_policy, choose
from tiered_ops.measure.measure import measure
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

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



def test_cost_aware_gives_a_tie_to_the_cheaper_tier():
    """A tier 1.2x faster than eager by its point estimate, but with p20-p80 ranges overlapping eager's (a host-
    bound H100 case: cuda 389 [388-480] against eager 474 [473-475]), is a tie, and a tie goes to the cheaper
    tier; clear of the noise, it wins. ``fastest`` ignores the ranges."""
    m = dict(policy.DEFAULT_MARGINS)
    eager = dict(_c("eager", "eager", 474), lo=473, hi=475)
    cuda = dict(_c("cuda", "cuda", 389), lo=388, hi=480)
    best, why, _ = policy.choose([eager, cuda], "cost-aware", tier_margins=m)
    assert best["impl"] == "eager" and "outside their noise" in why
    assert policy.choose([eager, cuda], "fastest")[0]["impl"] == "cuda"
    assert policy.choose([eager, dict(cuda, hi=400)], "cost-aware", tier_margins=m)[0]["impl"] == "cuda"
    assert policy.choose([_c("eager", "eager", 474), _c("cuda", "cuda", 389)], "cost-aware",
                         tier_margins=m)[0]["impl"] == "cuda"  # no ranges: the margin alone
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
    # fastest but wrong (never chosen)
    figures = {"eager": (30.0, 0.001, 1), "eager_addcmul": (29.0, 0.5, 1), "compile": (20.0, 4.0, 1),
               "triton": (1.0, 0.001, 0)}
    rows = []
    for impl in spec.impls.values():
        r = measure(spec, impl, problem, torch.float32, CPU)
        us, first, ok = figures[impl.name]
        # kernel-bound (host half the kernel), so that no host state reorders them
        r.update(ok=ok, reason=None if ok else "wrong (planted)", caller_us=us, p50_us=us, host_us=us / 2,
                 first_call_s=first)
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
    assert figs["compile"] == pytest.approx(4.0 + 2.0) and figs["triton"] is None


def test_default_policy_from_environment(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_POLICY", "cold-start")
    monkeypatch.setenv("TIERED_OPS_CALLS", "7")
    assert sel_mod.default_policy() == ("cold-start", 7)
    sel_mod.set_policy("cost-aware")
    try:
        assert sel_mod.default_policy() == ("cost-aware", None)
    finally:
        sel_mod.set_policy(None)


def test_cost_aware_through_select_backend_reads_the_stored_spreads(private_store):
    """select_backend gives each stored candidate its p20-p80 range as a caller sees it: compile at 20 us whose
    host batches reach 35 us ties eager's 30 us under cost-aware (eager chosen) and wins under fastest."""
    spec = get_op("muladd")
    problem = spec.problem((64, 64))
    rows = []
    for name, (p50, host, host_p80) in {"eager": (30.0, 30.0, 30.5), "compile": (5.0, 20.0, 35.0)}.items():
        r = measure(spec, spec.impls[name], problem, torch.float32, CPU)
        r.update(ok=1, reason=None, p20_us=p50 * 0.99, p50_us=p50, p80_us=p50 * 1.01, host_us=host,
                 host_p20_us=host, host_p80_us=host_p80, caller_us=max(p50, host))
        rows.append(r)
    Store(private_store).add(rows)
    sel_mod.set_tuning(False)
    try:
        pick = {p: tiered_ops.select_backend("muladd", (64, 64), "fp32", "cpu", policy=p)
                for p in ("fastest", "cost-aware")}
    finally:
        sel_mod.set_tuning(None)
    assert pick["fastest"].name == "compile" and pick["cost-aware"].name == "eager"
    c = {x["impl"]: x for x in pick["cost-aware"].record["candidates"]}
    assert (c["compile"]["lo"], c["compile"]["hi"]) == (20.0, 35.0) and c["eager"]["hi"] == pytest.approx(30.5)


def _mem(impl: str, tier: str, us: float, peak: int | None) -> dict:
    return dict(impl=impl, tier=tier, caller_us=us, first_call_s=0.0, peak_bytes=peak)


def test_memory_policy_is_the_fastest_within_the_budget():
    cands = [_mem("eager", "eager", 10.0, 4000), _mem("compile", "compile", 8.0, 3000),
             _mem("triton", "triton", 9.0, 100)]
    best, why, figures = choose(cands, "memory", budget=1000)
    assert best["impl"] == "triton" and "within 1000 bytes" in why
    assert figures == {"eager": 4000.0, "compile": 3000.0, "triton": 100.0}
    assert choose(cands, "memory", budget=3000)[0]["impl"] == "compile"  # the peak may equal the budget
    assert choose(cands, "fastest")[0]["impl"] == "compile"


def test_memory_policy_without_a_fitting_candidate_takes_the_smallest_peak_and_says_so():
    cands = [_mem("eager", "eager", 10.0, 4000), _mem("compile", "compile", 8.0, 3000)]
    best, why, _ = choose(cands, "memory", budget=10)
    assert best["impl"] == "compile" and "none measured within 10 bytes" in why
    best, why, _ = choose([_mem("eager", "eager", 10.0, None)], "memory", budget=10)
    assert best["impl"] == "eager" and "no peak measured" in why


@pytest.mark.parametrize("policy,budget,match", [("memory", None, "budget: the memory policy needs a budget"),
                                                 ("memory", -1, "budget"), ("fastest", 100, "only the memory")])
def test_the_memory_budget_is_checked(policy, budget, match):
    with pytest.raises(ValueError, match=match):
        check_policy(policy, None, budget)
    with pytest.raises(ValueError, match=match):
        tiered_ops.select_backend("softmax", (4, 8), "fp32", "cpu", policy=policy, budget=budget, tune=False)


def _timed(impl, tier, p50, host):
    return dict(impl=impl, tier=tier, p50_us=p50, host_us=host, caller_us=max(p50, host), first_call_s=0.0)


def test_fastest_takes_the_least_worst_regret_over_two_host_states():
    """Each candidate's regret is taken as measured and were the host 1.5x slower (a launch-bound call's host time
    moves that much between processes, its kernel time does not); the least of the larger two wins."""
    bound, steady = _timed("compile", "compile", 46.7, 46.0), _timed("triton", "triton", 47.5, 23.9)
    best, why, totals = choose([bound, steady], "fastest")
    assert best is steady and "worst host state" in why and totals == {"compile": 46.7, "triton": 47.5}
    # 6 % slower as measured, but the launch-bound one is 1.39x slower were the host slower: the steady one
    far = _timed("triton", "triton", 49.5, 23.9)
    assert choose([bound, far], "fastest")[0] is far
    # the H200 grid's softmax 9000x512 fp32: Triton 13.6 us (host 12.6) against eager's 15.1 (host 9.6); the grid's
    # own process then timed Triton's host at 22.9 us
    triton, eager = _timed("triton", "triton", 13.6, 12.6), _timed("eager", "eager", 15.1, 9.6)
    assert choose([triton, eager], "fastest")[0] is eager
    # 1.5x slower as measured is not made up for by any host state
    slow = _timed("triton", "triton", 70.0, 10.0)
    assert choose([bound, slow], "fastest")[0] is bound
    # all launch-bound alike (or no host figure, as rows of the CPU may have): the fastest
    a, b = _timed("eager", "eager", 9.6, 14.6), _timed("cuda", "cuda", 8.9, 14.9)
    assert choose([a, b], "fastest") == (a, "fastest correct (14.6 us per call)", {"eager": 14.6, "cuda": 14.9})
    plain = [dict(impl="x", tier="eager", caller_us=10.0), dict(impl="y", tier="triton", caller_us=10.2)]
    assert choose(plain, "fastest")[0]["impl"] == "x"


def test_a_time_predicted_at_another_shape_is_steady_by_its_predicted_kernel_time():
    """With tuning off each time is predicted at the requested shape (``predict``): the tie rule weighs that
    kernel time, not the measured bucket's. On the H100 grid, softmax 65536x7 bf16 read from 65536x256: eager 8.9 us
    predicted (kernel 7.0) and the CUDA kernel 9.1 (launch-bound); eager's kernel at 256 columns (35.2 us) made it
    look the unsteady one and the CUDA kernel, 4.7x slower there, was chosen."""
    eager = dict(impl="eager", tier="eager", caller_us=8.9, p50_us=35.2, host_us=8.9, kernel_us=7.0, predicted=True,
                 first_call_s=0.0)
    cuda = dict(impl="cuda", tier="cuda", caller_us=9.1, p50_us=9.0, host_us=9.1, kernel_us=3.0, predicted=True,
                first_call_s=0.0)
    best, why, _ = choose([eager, cuda], "fastest")
    assert best is eager and why == "fastest correct (8.9 us per call)"
    # measured rows are judged as before: their own p50
    assert choose([dict(eager, predicted=False), cuda], "fastest")[0] is cuda
