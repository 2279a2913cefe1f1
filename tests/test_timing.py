"""CPU timings: enough samples for a spread, and a measurement taken on a busy machine noticed, flagged, never used.

The contention tests are deterministic (the sample source and the copy probe replaced) except the planted busy loop,
which oversubscribes every core twice over: only more load than that could make its assertion fail the other way.
"""

import os
import statistics
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from tiered_ops.decide import decide as sel_mod
from tiered_ops.measure import fingerprint, timing
from tiered_ops.measure.measure import base_row, flag_contended, measure
from tiered_ops.store.rows import CONTENDED, contended, pruned, usable
from tiered_ops.store.store import Store
from tiered_ops.sweep.bench import sweep
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
MULADD = get_op("muladd")
QUANTIZED = [0.008] * 6 + [0.016] * 4  # block seconds on multiples of 8 ms: a scheduler's slices, not an op's time
FINE = [0.0010 + 1e-6 * (i * 37 % 11) for i in range(12)]  # a quiet machine's 1 ms blocks, a few us apart



@pytest.fixture(autouse=True)
def contention_check_on(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_CONTENTION_CHECK", "1")

def test_cpu_timing_takes_the_minimum_number_of_samples_even_for_a_slow_call():
    """A call of 30 ms: the timing budget (0.2 s) holds only 6 of them; the minimum sample count still holds, and the
    percentiles are taken over those samples (before, one benchmark block of a slow call gave p20 = p50 = p80)."""
    def slow() -> None:
        time.sleep(0.03)

    t = timing.time_call(slow, CPU)
    assert t.samples >= timing.CPU_MIN_SAMPLES, t
    assert t.p20_us <= t.p50_us <= t.p80_us and t.p50_us >= 30_000, t
    assert t.host_us == t.p50_us and t.host_p80_us is None  # the CPU has no separate host time


def test_idle_timing_of_a_small_op_has_a_spread():
    x = torch.randn(4096)
    t = timing.time_call(lambda: x.mul(1.0001), CPU)
    assert t.samples >= timing.CPU_MIN_SAMPLES, t
    assert t.p20_us < t.p80_us, t  # distinct order statistics of >= 10 blocks on a fine clock
    blocks, calls, _ = timing.cpu_blocks(lambda: x.mul(1.0001))
    assert len(blocks) >= timing.CPU_MIN_SAMPLES and calls > 1  # a 4096-element multiply is far below 1 ms
    assert statistics.median(blocks) >= timing.CPU_MIN_BLOCK_S


def test_one_preempted_call_does_not_set_the_block_size():
    x, first = torch.randn(4096), [True]

    def fn():
        if first[0]:  # the first timed call stalls as a preempted one would, far past a block's length
            first[0] = False
            time.sleep(4 * timing.CPU_MIN_BLOCK_S)
        return x.mul(1.0001)

    blocks, calls, _ = timing.cpu_blocks(fn)
    assert calls > 1, (calls, blocks[:5])
    assert statistics.median(blocks) >= timing.CPU_MIN_BLOCK_S


def test_contention_signals():
    assert timing.contention(FINE, 100, 0.0, 9.0, 10.0) is None
    assert timing.contention(FINE, 100, None) is None  # no schedstat, no probe: nothing to say
    why = timing.contention(QUANTIZED, 1, 0.0)
    assert "multiples of 8.0 ms" in why and "p80/p20 = 2.0" not in why, why
    assert "multiples" not in (timing.contention([0.008, 0.0101, 0.0123, 0.0149, 0.0171], 1, 0.0) or "")
    assert timing.contention(FINE, 100, 0.0, 3.0, 10.0) is None  # a low copy probe alone: an idle VM's noise
    assert "copy probe 3.0 GB/s < 0.5 x" in timing.contention(FINE, 100, 0.6, 3.0, 10.0)  # with another signal
    assert "waited for a CPU 60%" in timing.contention(FINE, 100, 0.6)
    assert "p80/p20 = 3.0" in timing.contention([0.001] * 3 + [0.002] * 4 + [0.003] * 3 + [0.00301], 10, 0.0)


@pytest.fixture
def busy(monkeypatch):
    """The CPU sample source returns block times on an 8 ms quantum and the copy probe a fifth of the best copy
    bandwidth; ``busy.calls`` counts the timings. ``busy.on = False`` makes the machine quiet again."""
    class State:
        on, calls = True, 0

    def blocks(fn, budget_s=timing.CPU_BUDGET_S, min_samples=timing.CPU_MIN_SAMPLES):
        State.calls += 1
        fn()
        return (list(QUANTIZED) if State.on else list(FINE)), 1, None

    monkeypatch.setitem(timing._copy_best, "cpu", 10.0)
    monkeypatch.setattr(timing, "cpu_blocks", blocks)
    monkeypatch.setattr(timing, "copy_probe_gbps", lambda device, copies=3: 2.0 if State.on else 10.0)
    monkeypatch.setattr("tiered_ops.measure.measure.CONTENDED_PAUSE_S", 0.0)
    return State


def test_a_contended_measurement_is_retried_then_flagged(busy):
    from tiered_ops.measure.measure import CONTENDED_TRIES

    p = MULADD.problem((64, 64))
    row = measure(MULADD, MULADD.impls["eager"], p, torch.float32, CPU)
    assert busy.calls == CONTENDED_TRIES
    assert row["ok"] == 1 and row["reason"].startswith(CONTENDED), row
    assert "multiples of 8.0 ms" in row["reason"] and "copy probe 2.0 GB/s" in row["reason"]
    assert row["caller_us"] is None and row["host_us"] is None and row["p50_us"] > 0  # figures kept, no decision
    assert contended(row) and not usable(row)
    busy.on, busy.calls = False, 0
    row = measure(MULADD, MULADD.impls["eager"], p, torch.float32, CPU)
    assert busy.calls == 1 and row.get("reason") is None and row["caller_us"] == row["p50_us"] > 0, row
    assert usable(row) and not contended(row)


def test_the_check_switched_off_stores_a_busy_timing_as_taken(busy, monkeypatch):
    """TIERED_OPS_CONTENTION_CHECK=0: one timing, stored with its figures and a caller time, not flagged."""
    monkeypatch.setenv("TIERED_OPS_CONTENTION_CHECK", "0")
    row = measure(MULADD, MULADD.impls["eager"], MULADD.problem((64, 64)), torch.float32, CPU)
    assert busy.calls == 1 and row.get("reason") is None and row["caller_us"] == row["p50_us"] > 0, row


def test_a_bandwidth_beyond_the_copy_is_contended(monkeypatch):
    """On the CPU an op that moves more than the copy's bytes cannot run at 2x the copy bandwidth: the copy figure
    was taken on a busy machine (a sweep stored 499 % of copy) or the timing was."""
    from tiered_ops.measure.timing import _beyond_copy

    big = 4 * timing.COPY_BYTES["cpu"]
    assert "2.00 x the copy bandwidth" in _beyond_copy(20.0, 10.0, big, CPU)
    assert _beyond_copy(14.0, 10.0, big, CPU) is None
    assert _beyond_copy(50.0, 10.0, 1 << 20, CPU) is None  # a small problem lives in the caches
    assert _beyond_copy(50.0, 10.0, big, torch.device("cuda")) is None  # the GPU path is not judged this way


def test_a_flagged_row_is_never_selected(private_store):
    """The fastest stored row was timed on a busy machine: the slower clean one is chosen, and the flagged one is
    shown among the candidates with its reason."""
    p = MULADD.problem((64, 64))
    fp = fingerprint.fingerprint(CPU)
    figures = dict(ok=1, p20_us=0.9, p50_us=1.0, p80_us=1.1, gbps=1.0, copy_gbps=10.0, frac_copy=0.1)
    fast = dict(base_row(MULADD, MULADD.impls["compile"], p, torch.float32, "fwd_nograd", fp), **figures,
                host_us=1.0, caller_us=1.0)
    flag_contended(fast, "block times on multiples of 8.0 ms (1 call(s) per block)")
    slow = dict(base_row(MULADD, MULADD.impls["eager"], p, torch.float32, "fwd_nograd", fp), **figures)
    slow.update(p20_us=4.9, p50_us=5.0, p80_us=5.1, host_us=5.0, caller_us=5.0)
    Store(private_store).add([fast, slow])
    for policy in ("fastest", "cost-aware", "cold-start"):
        sel = sel_mod.select_problem(MULADD, p, torch.float32, CPU, tune=False, policy=policy)
        assert sel.name == "eager", sel.record
        cands = {c["impl"]: c for c in sel.record["candidates"]}
        assert cands["compile"]["reason"].startswith(CONTENDED) and cands["compile"].get("policy_figure") is None


def test_sweep_logs_flagged_rows_and_measures_them_again(private_store, monkeypatch, busy):
    monkeypatch.setattr(MULADD, "impls", {"eager": MULADD.impls["eager"]})
    store, said = Store(private_store), []
    kw = dict(progress=False, log=said.append, modes=["fwd_nograd"], cost_metadata=False)
    df = sweep([MULADD], {"muladd": [MULADD.problem((64, 64))]}, [torch.float32], CPU, store, **kw)
    assert df.reason.iloc[0].startswith(CONTENDED) and df.caller_us.isna().all()
    assert any("excluded from decisions" in s for s in said), said
    assert any("1 measurement(s) taken while the machine was busy" in s for s in said), said
    busy.on = False
    df = sweep([MULADD], {"muladd": [MULADD.problem((64, 64))]}, [torch.float32], CPU, store, **kw)
    assert df.reason.isna().all() and (df.caller_us > 0).all()  # measured again, not taken from the store
    assert [contended(r) for r in store.rows(op="muladd")] == [True, False]


def _spinners(n: int, seconds: float) -> list[subprocess.Popen]:
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


@pytest.mark.skipif(timing._run_delay_s() is None, reason="needs Linux schedstat (/proc/thread-self/schedstat)")
def test_a_planted_busy_loop_is_noticed():
    """Two spinning processes per core (bounded at 10 s, stopped at the end) while a CPU timing runs: the timing
    thread waits for a CPU and the timing says the machine was busy."""
    def work() -> int:
        return sum(range(2000))

    procs = _spinners(2 * len(os.sched_getaffinity(0)), 10.0)
    try:
        time.sleep(0.5)  # the spinners are running
        blocks, calls, waited = timing.cpu_blocks(work)
        why = timing.contention(blocks, calls, waited)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert waited is not None and waited > timing.WAIT_LIMIT, (waited, blocks)
    assert why is not None and "waited for a CPU" in why, why


def test_a_clearly_slower_candidate_is_pruned_after_a_short_timing(monkeypatch):
    """Successive halving: with a bar below its short timing the row keeps that timing and says why; with none
    above it, it is timed in full. (A short timing that looks contended is never pruned: the check is off here,
    so that this 2-core machine's load cannot make the test pass for the wrong reason.)"""
    monkeypatch.setenv("TIERED_OPS_CONTENTION_CHECK", "0")
    from tiered_ops.store.rows import PRUNED, pruned

    p = MULADD.problem((64, 64))
    row = measure(MULADD, MULADD.impls["eager"], p, torch.float32, CPU, prune_above_us=1e-3, best="compile")
    assert row["ok"] == 1 and row["reason"].startswith(PRUNED) and "compile" in row["reason"], row
    assert row["caller_us"] > 1e-3 and row["p20_us"] <= row["p80_us"] and pruned(row) and usable(row)
    row = measure(MULADD, MULADD.impls["eager"], p, torch.float32, CPU, prune_above_us=1e9, best="compile")
    assert row.get("reason") is None and not pruned(row) and row["caller_us"] > 0, row


def test_a_candidate_pruned_before_its_gate_costs_no_gate_and_is_never_ok(monkeypatch):
    """``gate_first=False`` (background tuning): the short timing comes first; a pruned candidate is not gated, so
    its row is not ok, and one that is not pruned is gated and timed in full as before. (The contention check is off,
    as in the test above: a short timing that looks contended is never pruned, so a busy machine would fail this test
    for a reason it does not test.)"""
    from tiered_ops.measure import verdict as m

    monkeypatch.setenv("TIERED_OPS_CONTENTION_CHECK", "0")

    gated = []
    real = m.gate
    monkeypatch.setattr(m, "gate", lambda *a, **k: gated.append(a[1].name) or real(*a, **k))
    p = MULADD.problem((64, 64))
    row = measure(MULADD, MULADD.impls["eager"], p, torch.float32, CPU, prune_above_us=1e-3, best="cuda",
                  gate_first=False)
    assert gated == [] and row["ok"] == 0 and pruned(row) and not usable(row), row
    assert "not gated" in row["reason"] and "cuda" in row["reason"] and row["caller_us"] > 1e-3
    row = measure(MULADD, MULADD.impls["eager"], p, torch.float32, CPU, prune_above_us=1e9, best="cuda",
                  gate_first=False)
    assert gated == ["eager"] and row["ok"] == 1 and not pruned(row) and row["caller_us"] > 0, row
    gated.clear()  # the default: gated first, then pruned (an ok row)
    row = measure(MULADD, MULADD.impls["eager"], p, torch.float32, CPU, prune_above_us=1e-3, best="cuda")
    assert gated == ["eager"] and row["ok"] == 1 and pruned(row), row


def test_the_pruning_bar_is_the_fastest_full_timing_of_ours_and_a_pruned_row_never_wins():
    from tiered_ops.analysis.analysis import decisions, winners
    from tiered_ops.store.rows import prune_bar

    fp, p = fingerprint.fingerprint(CPU), MULADD.problem((64, 64))

    def row(impl, lo, hi, tier=None, **kw):
        r = dict(base_row(MULADD, MULADD.impls[impl], p, torch.float32, "fwd_nograd", fp), ok=1, p20_us=lo,
                 p50_us=(lo + hi) / 2, p80_us=hi, host_us=lo, caller_us=(lo + hi) / 2, first_call_s=0.1, **kw)
        return dict(r, tier=tier) if tier else r

    eager, fast = row("eager", 9.0, 11.0), row("compile", 4.0, 5.0)
    peer = row("eager_addcmul", 1.0, 1.2, tier="peer")
    flagged = flag_contended(row("compile", 1.0, 1.1), "p80/p20 = 3.0 over 10 blocks")
    assert prune_bar([eager, None, peer, flagged], 1.5) == (1.5 * 11.0, "eager")  # no peer, no contended row
    assert prune_bar([eager, fast], 1.5) == (7.5, "compile") and prune_bar([eager, fast], None) is None
    assert prune_bar([dict(eager, p20_us=None, p80_us=None)], 1.5) is None  # no spread: no bar
    slow = row("triton", 8.0, 9.0, reason="pruned: a short timing's caller p20 8.0 us is above 7.5 us")
    assert prune_bar([slow], 1.5) is None  # a pruned row is no bar
    df = pd.DataFrame([eager, fast, slow])
    assert winners(df).winner.tolist() == ["compile"]
    assert set(decisions(df, {}).iloc[0][["fastest", "cost_aware"]]) == {"compile"}


def test_the_winner_per_mode_table_says_why_a_cell_is_empty():
    """A case whose rows were all timed on a busy machine has no winner: its cell says so instead of NaN."""
    from tiered_ops.analysis.analysis import winner_per_mode, winners

    fp, p = fingerprint.fingerprint(CPU), MULADD.problem((64, 64))
    rows = []
    for mode in ("fwd_nograd", "fwd+bwd"):
        for impl in ("eager", "compile"):
            r = dict(base_row(MULADD, MULADD.impls[impl], p, torch.float32, mode, fp), ok=1, p20_us=1.0, p50_us=1.0,
                     p80_us=1.1, host_us=1.0, caller_us=1.0 if impl == "eager" else 2.0, first_call_s=0.1)
            rows.append(flag_contended(r, "p80/p20 = 3.0 over 10 blocks") if mode == "fwd+bwd" else r)
    df = pd.DataFrame(rows)
    modes, _ = winner_per_mode(winners(df), df)
    assert modes.loc[("muladd", str(p), "fp32"), "fwd_nograd"] == "eager"
    assert modes.loc[("muladd", str(p), "fp32"), "fwd+bwd"] == "(contended: 2 of 2 timed on a busy machine)"
    assert not modes.isna().any().any()


def test_interleaved_rounds_rotate_the_order():
    from tiered_ops.measure.recheck import interleaved, rotated

    assert "".join(rotated(list("abc"), 4)) == "abcbcacababc"
    seen: list[str] = []
    out = interleaved({n: (lambda n=n: n) for n in "ab"}, 3, lambda f: seen.append(f()) or float(len(seen)))
    assert seen == list("abbaab") and out == {"a": [1.0, 4.0, 5.0], "b": [2.0, 3.0, 6.0]}
