"""Correctness gate, store and selection, driven through the real registry on the CPU."""

import math
import sqlite3

import pytest
import torch

import tiered_ops
from tiered_ops.analysis.analysis import table
from tiered_ops.decide import decide as sel_mod
from tiered_ops.measure import timing as timing_mod
from tiered_ops.measure.measure import measure
from tiered_ops.registry import Impl, Tier, rel_error
from tiered_ops.runtime import memo
from tiered_ops.store.store import COLUMN_NAMES, Store, StoreError
from tiered_ops.sweep.bench import sweep
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
SOFTMAX = get_op("softmax")


@pytest.fixture
def planted(monkeypatch):
    """softmax with only eager and three wrong but fast implementations."""
    impls = {
        "eager": SOFTMAX.impls["eager"],
        "identity": Impl("identity", Tier.CUDA, lambda x, dim=-1: x.clone(), (SOFTMAX.source,)),
        "unwritten": Impl("unwritten", Tier.TRITON, lambda x, dim=-1: torch.empty_like(x), (SOFTMAX.source,)),
        # right except on 1-column rows: only the edge problems catch it (a tier gated once timed: a compiled tier
        # is gated only where the choice would name it, and this one is no faster than eager)
        "edge_bug": Impl("edge_bug", Tier.CUDA,
                         lambda x, dim=-1: torch.zeros_like(x) if x.shape[dim] == 1 else torch.softmax(x, dim),
                         (SOFTMAX.source,)),
    }
    monkeypatch.setattr(SOFTMAX, "impls", impls)
    return impls


def test_wrong_implementations_are_recorded_and_never_selected(planted, monkeypatch):
    # no pruning: a wrong candidate's short timing, slowed by a loaded machine, would otherwise be pruned before its
    # gate (ok 0 all the same, but not for being wrong, which is what this test reads)
    import tiered_ops.decide.claimed as claimed

    monkeypatch.setattr(claimed, "PRUNE_FACTOR", None)
    s = tiered_ops.select_backend("softmax", (64, 300), "fp32", "cpu")
    assert s.name == "eager"
    cands = {c["impl"]: c for c in s.record["candidates"]}
    assert set(cands) == set(planted)
    for bad in ("identity", "unwritten", "edge_bug"):
        assert cands[bad]["ok"] == 0, bad
        assert "wrong" in cands[bad]["reason"], cands[bad]["reason"]
    assert "edge case" in cands["edge_bug"]["reason"] and "4096x1" in cands["edge_bug"]["reason"]


def test_rel_error_never_passes_nan():
    ref = torch.ones(4, dtype=torch.float64)
    out = ref.clone()
    out[1] = math.nan
    assert rel_error(out, ref) == math.inf
    assert rel_error(ref.clone(), ref) == 0.0
    ref2 = torch.tensor([math.nan, 1.0], dtype=torch.float64)
    assert rel_error(ref2.clone(), ref2) == 0.0  # NaN where the reference has NaN is right
    assert rel_error(torch.ones(3), ref) == math.inf  # shape mismatch


def test_rel_error_in_chunks_matches_the_whole_norm_and_catches_a_late_nan():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1823, 781, generator=g, dtype=torch.float64)
    out = (ref + 1e-3 * torch.randn(ref.shape, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    whole = (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()
    assert rel_error(out, ref, chunk=1000) == pytest.approx(whole, rel=1e-12)
    ref[-1, -1] = math.inf
    assert rel_error(out, ref, chunk=1000) == math.inf  # out is finite where ref is +inf: wrong
    out2 = out.clone()
    out2[-1, -1] = math.inf
    assert math.isfinite(rel_error(out2, ref, chunk=1000))
    out2[-1, -1] = -math.inf  # wrong sign of inf
    assert rel_error(out2, ref, chunk=1000) == math.inf
    assert rel_error(ref.t(), ref.t().contiguous(), chunk=7) == 0.0  # non-contiguous input
    assert rel_error(torch.zeros(3), torch.zeros(3, dtype=torch.float64), floor=1e-6) == 0.0


def test_measure_records_unavailable_with_reason():
    row = measure(SOFTMAX, SOFTMAX.impls["cuda"], SOFTMAX.problem((8, 8)), torch.float32, CPU)
    assert row["ok"] == 0 and row["reason"].startswith("unavailable:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter runs on CPU machines (CI)")
def test_triton_interpreter_is_gated_but_not_timed():
    row = measure(SOFTMAX, SOFTMAX.impls["triton"], SOFTMAX.problem((8, 300)), torch.float32, CPU)
    assert row["ok"] == 1 and row.get("p50_us") is None and "not timed" in row["reason"]


def test_store_keeps_rows_and_decision_survives_a_new_process(planted, private_store, monkeypatch):
    first = tiered_ops.select_backend("softmax", (64, 300), "fp32", "cpu")
    assert {r["impl"] for r in Store(private_store).rows(op="softmax")} == set(planted)
    # A new process: empty caches, fresh Store object. Measuring again would raise.
    sel_mod.use_store(str(private_store))
    monkeypatch.setattr(sel_mod, "measure_kept", lambda *a, **k: pytest.fail("re-measured a stored bucket"))
    again = tiered_ops.select_backend("softmax", (50, 300), "fp32", "cpu")  # 50 rows: same bucket as 64
    assert again.name == first.name and again.record["bucket"] == first.record["bucket"] == "[64,300,true]"


def test_stale_source_hash_is_ignored(planted, private_store, monkeypatch):
    tiered_ops.select_backend("softmax", (64, 300), "fp32", "cpu")
    sel_mod.clear_cache()
    monkeypatch.setattr(planted["eager"], "_hash", "edited-source")
    sel_mod.set_tuning(False)
    try:
        s = tiered_ops.select_backend("softmax", (64, 300), "fp32", "cpu")
    finally:
        sel_mod.set_tuning(None)
    eager = next(c for c in s.record["candidates"] if c["impl"] == "eager")
    assert eager["fresh"] is False and s.record["reason"].startswith("no correct timed")


def test_tuning_off_returns_eager_and_says_so(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    s = tiered_ops.select_backend("muladd", (10, 10), "bf16", "cpu")
    assert s.tier == Tier.EAGER and "tuning off" in s.record["reason"]
    a = torch.randn(10, 10, dtype=torch.bfloat16)
    assert torch.equal(s(a, a, a), a * a + a)


def test_fastest_correct_wins_from_stored_rows(private_store):
    """Decisions follow the numbers: the same op picks different tiers in different buckets."""
    spec = get_op("muladd")
    small, big = spec.problem((32,)), spec.problem((1 << 20,))
    rows = []
    for problem, fast in ((small, "eager"), (big, "compile")):
        for impl in spec.impls.values():
            r = measure(spec, impl, problem, torch.float32, CPU)
            us = 1.0 if impl.name == fast else 5.0
            r.update(ok=1, reason=None, caller_us=us, p50_us=us, host_us=us / 2)  # kernel-bound: no host state reorders
            rows.append(r)
    Store(private_store).add(rows)
    sel_mod.set_tuning(False)
    try:
        assert tiered_ops.select_backend("muladd", (32,), "fp32", "cpu").name == "eager"
        assert tiered_ops.select_backend("muladd", (1 << 20,), "fp32", "cpu").name == "compile"
    finally:
        sel_mod.set_tuning(None)


def test_tuning_off_decides_from_the_nearest_measured_bucket_and_never_picks_a_peer(private_store):
    """A shape nobody measured is decided from the nearest measured bucket (sizes in log2, same flags), each time
    predicted there: the launch path (fastest host time) against the kernel time scaled by the bytes moved at the
    bandwidth of the nearest bandwidth-bound bucket. A peer that is fastest is still not chosen."""
    from tiered_ops.registry import Impl, Tier

    spec = get_op("softmax")
    peer = spec.impls.get("liger")
    assert peer is not None and peer.tier == Tier.PEER  # registered by tiered_ops.ops
    # (host us, kernel us at 8x64, kernel us at 8x4096): eager launches fast, compile moves bytes fast
    figures = {"eager": (1.0, 0.5, 8.0), "compile": (3.0, 0.3, 4.0), "liger": (0.2, 0.2, 0.5)}
    rows = []
    for k, problem in enumerate((spec.problem((8, 64)), spec.problem((8, 4096)))):
        nbytes = spec.mode_bytes(problem, torch.float32, "fwd_nograd")
        for impl in [i for i in spec.impls.values() if i.tier in (Tier.EAGER, Tier.COMPILE)] + [peer]:
            host, kernel = figures[impl.name][0], figures[impl.name][1 + k]
            r = measure(spec, impl, problem, torch.float32, CPU)
            r.update(ok=1, reason=None, p50_us=kernel, host_us=host, caller_us=max(host, kernel),
                     gbps=nbytes / kernel / 1e3)
            rows.append(r)
    Store(private_store).add(rows)
    sel_mod.set_tuning(False)
    try:
        near_small = tiered_ops.select_backend("softmax", (8, 100), "fp32", "cpu")
        near_big = tiered_ops.select_backend("softmax", (16, 20000), "fp32", "cpu")
        launch_bound = tiered_ops.select_backend("softmax", (2, 2048), "fp32", "cpu")
        other_dim = tiered_ops.select_backend("softmax", (8, 64, 3), "fp32", "cpu", dim=1)
    finally:
        sel_mod.set_tuning(None)
    assert near_small.name == "eager" and "nearest measured bucket [8,64,true]" in near_small.record["reason"]
    # 16x20000 moves 9.8x the bytes of 8x4096: eager 0.5 + 7.5 x 9.8 us, compile 0.3 + 3.7 x 9.8
    assert near_big.name == "compile" and "[8,4096,true]" in near_big.record["reason"]
    got = {c["impl"]: c["caller_us"] for c in near_big.record["candidates"]}
    ratio = spec.mode_bytes(spec.problem((16, 20000)), torch.float32, "fwd_nograd") / \
        spec.mode_bytes(spec.problem((8, 4096)), torch.float32, "fwd_nograd")
    assert got["eager"] == pytest.approx(0.5 + 7.5 * ratio) and got["compile"] == pytest.approx(0.3 + 3.7 * ratio)
    # nearest is 8x4096, where compile wins; at 1/8 of its bytes compile's 3 us launch path is the larger figure
    assert "[8,4096,true]" in launch_bound.record["reason"] and launch_bound.name == "eager"
    assert other_dim.name == "eager" and "no stored decision" in other_dim.record["reason"]  # dim flag differs
    assert isinstance(peer, Impl) and all(s.name != "liger" for s in (near_small, near_big, launch_bound))


def test_winners_and_decisions_skip_peers_but_show_the_fastest(private_store):
    import pandas as pd

    from tiered_ops.analysis.analysis import decisions, winners

    base = dict(op="softmax", problem="8x64,dim=-1", dtype="fp32", mode="fwd_nograd", ok=1, p20_us=None, p50_us=None,
                p80_us=None, first_call_s=0.0)
    df = pd.DataFrame([dict(base, impl="eager", tier="eager", caller_us=4.0),
                       dict(base, impl="triton", tier="triton", caller_us=2.0),
                       dict(base, impl="liger", tier="peer", caller_us=1.0)])
    w = winners(df).iloc[0]
    assert (w.winner, w.runner_up, w.peer, w.peer_us, w.margin) == ("triton", "eager", "liger", 1.0, 2.0)
    assert decisions(df, {}).iloc[0].fastest == "triton"


def test_dispatch_uses_the_decision_and_is_correct(planted):
    x = torch.randn(64, 300)
    y = tiered_ops.softmax(x)
    assert torch.allclose(y, torch.softmax(x, -1))
    key = ("softmax", x.shape, x.dtype, x.get_device(), -1, False, 0)  # False: not training; 0: an eager caller
    assert memo._calls[key].name == "eager"


def test_store_schema_version_is_checked(private_store):
    Store(private_store).close()
    con = sqlite3.connect(private_store)
    con.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="schema version 999, newer than this tiered_ops"):
        Store(private_store)


def test_store_add_is_all_or_nothing(private_store):
    store = Store(private_store)
    good = dict(op="x", impl="a", tier="eager", mode="fwd", problem="1", bucket="1", dtype="fp32", device_key="d",
                ok=1, source_hash="h", timestamp=1.0)
    with pytest.raises(sqlite3.IntegrityError):
        store.add([good, {**good, "op": None}])
    assert store.rows() == []


def test_sweep_resumes_instead_of_remeasuring(private_store, monkeypatch):
    spec = get_op("muladd")
    monkeypatch.setattr(spec, "impls", {"eager": spec.impls["eager"]})
    store = Store(private_store)
    df = sweep([spec], {"muladd": [spec.problem((64, 64))]}, [torch.float32], CPU, store, progress=False,
               log=lambda s: None, modes=["fwd_nograd", "fwd+bwd"])
    assert len(df) == 2 and (df.ok == 1).all() and (df.gbps > 0).all() and (0 < df.frac_copy).all()
    assert list(df["mode"]) == ["fwd_nograd", "fwd+bwd"]
    # fwd+bwd moves the forward's bytes and the backward's: 4 + 5 element-passes against 4
    assert df.gbps.iloc[1] * df.p50_us.iloc[1] == pytest.approx(df.gbps.iloc[0] * df.p50_us.iloc[0] * 9 / 4)
    n = len(store.rows())
    sweep([spec], {"muladd": [spec.problem((64, 64))]}, [torch.float32], CPU, store, progress=False,
          log=lambda s: None, modes=["fwd_nograd", "fwd+bwd"])
    assert len(store.rows()) == n  # nothing measured twice


def test_a_sweep_frame_has_every_store_column(private_store, monkeypatch):
    """A sweep whose rows all pass, timed in full and uncontended, carries no reason in any row: its frame still has
    that column (and every other of the store), so the CLI's table of it prints instead of raising AttributeError."""
    spec = get_op("muladd")
    monkeypatch.setattr(spec, "impls", {"eager": spec.impls["eager"]})
    monkeypatch.setattr(timing_mod, "contention_check", lambda: False)  # a busy machine's row would have a reason
    df = sweep([spec], {"muladd": [spec.problem((64, 64))]}, [torch.float32], CPU, Store(private_store),
               progress=False, log=lambda s: None, modes=["fwd_nograd"], cost_metadata=False)
    assert len(df) == 1 and df.ok.iloc[0] == 1 and df.reason.isna().all()
    assert set(COLUMN_NAMES) <= set(df.columns)
    assert "<- winner" in table(df, "muladd")


@pytest.mark.gpu
def test_kernel_time_excludes_a_slow_host_path():
    """A call whose host side takes 400 us and whose kernel takes a few us: the kernel median must stay far below
    the host time (with the GPU idle between the start event and the kernel it would read ~400 us), while the
    host time per call carries it."""
    import time

    from tiered_ops.measure.timing import time_call

    dev = torch.device("cuda")
    x = torch.randn(1 << 16, device=dev)

    def slow_host() -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < 400e-6:
            pass
        x.mul_(1.0001)

    slow_host()
    t = time_call(slow_host, dev)
    assert t.p50_us < 100, t
    assert t.host_us > 350, t
    assert t.caller_us == t.host_us
    assert t.host_us <= t.host_p20_us <= t.host_p80_us


@pytest.mark.gpu
def test_host_time_of_a_gpu_bound_call_is_its_launch_path_not_the_gpu():
    """A call whose kernel moves 1 GiB (~0.3 ms on an H100) issues in a few us: its host time must read that, not
    the GPU's back-to-back time (which a final synchronize adds, with its noise), and its caller time is the
    kernel's."""
    from tiered_ops.measure.timing import time_call

    dev = torch.device("cuda")
    x = torch.randn(1 << 27, device=dev)
    t = time_call(lambda: x.mul_(1.0001), dev)
    assert t.p50_us > 100, t
    assert t.host_us < 0.2 * t.p50_us, t
    assert t.host_us <= t.host_p20_us <= t.host_p80_us < t.p50_us, t
    assert t.caller_us == t.p50_us


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gate_calls_each_optional_argument_omitted(dtype):
    """The inputs factory passes rms_norm's eps explicitly; a tier whose own eps=None default is x's dtype's eps (not
    torch's, the compute dtype's) agrees with eager on those inputs and fails the gate with eps omitted. The shipped
    tiers pass it."""
    from tiered_ops.measure.gate import check_defaults, gate
    from tiered_ops.ops.rms_norm import reference
    from tiered_ops.registry import checked

    spec, dev = get_op("rms_norm"), torch.device("cpu")

    def own_default(x, normalized_shape, weight=None, eps=None, **form):  # form: the Hugging Face forms' arguments
        return reference(x, normalized_shape, weight, torch.finfo(x.dtype).eps if eps is None else eps, **form)

    planted = Impl("planted_own_eps", Tier.TRITON, checked(spec, own_default), (spec.source,))
    edge = spec.edge_problems()[0]
    err, why = gate(spec, planted, edge, dtype, dev)
    assert why is not None and "eps omitted" in why and "defaults" in why, why
    for name in ("eager", "triton"):
        assert check_defaults(spec, spec.impls[name], edge, dtype, dev, grad=True)[1] is None


def test_a_timing_window_neither_collects_nor_lets_a_collection_run(monkeypatch):
    """A timed window disables the collector and restores it after; it never runs a full collection first (one took
    longer than the timing itself in a process with Inductor loaded)."""
    import gc

    from tiered_ops.measure import timing

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    assert gc.isenabled()
    with timing.no_gc():
        assert not gc.isenabled()
    assert gc.isenabled() and calls == []
    t = timing.time_call(lambda: torch.ones(64).sum(), torch.device("cpu"))
    assert t.p50_us > 0 and calls == [] and gc.isenabled()


def test_a_sweep_gates_a_compiled_tier_only_where_a_choice_would_take_it(private_store, monkeypatch):
    """The Triton and compile tiers are timed without their gate; once the case is stored, the gate runs for the one a
    choice would name (the next in line where it fails), the rest are stored as never chosen, a resumed sweep
    measures nothing again, and ``gate_all`` gates every candidate as it is measured."""
    from tiered_ops.measure.fingerprint import fingerprint
    from tiered_ops.measure.measure import base_row
    from tiered_ops.store.rows import WAITING
    from tiered_ops.sweep import bench

    fake = lambda x, dim=-1: torch.softmax(x, dim)  # noqa: E731
    monkeypatch.setattr(SOFTMAX, "impls", {
        "eager": SOFTMAX.impls["eager"], "fast_wrong": Impl("fast_wrong", Tier.TRITON, fake, (SOFTMAX.source,)),
        "next": Impl("next", Tier.COMPILE, fake, (SOFTMAX.source,)),
        "slow": Impl("slow", Tier.COMPILE, fake, (SOFTMAX.source,))})
    times = {"eager": 10.0, "fast_wrong": 4.0, "next": 6.0, "slow": 20.0}
    asked: list = []

    def fake_measure(spec, impl, problem, dtype, device, mode, **kw):
        asked.append(("measure", impl.name, kw.get("gated", True)))
        t, gated = times[impl.name], kw.get("gated", True)
        return dict(base_row(spec, impl, problem, dtype, mode, fingerprint(device)), ok=int(gated), p20_us=t,
                    p50_us=t, p80_us=t * 1.05, host_us=t / 2, host_p20_us=t / 2, host_p80_us=t / 2, caller_us=t,
                    first_call_s=0.01, rel_error=0.0 if gated else None, reason=None if gated else WAITING)

    def fake_gate(spec, impl, problem, dtype, device, mode, row, edges=None):
        asked.append(("gate", impl.name, None))
        if impl.name == "fast_wrong":
            return dict(row, ok=0, rel_error=0.5, reason=f"wrong output at {problem} seed 1")
        return dict(row, ok=1, rel_error=0.0, reason=None)

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "gate_row", fake_gate)
    store, problems = Store(private_store), {"softmax": [SOFTMAX.problem((64, 64), dim=-1)]}

    def run(**kw):
        asked.clear()
        return sweep([SOFTMAX], problems, [torch.float32], CPU, store, progress=False, log=lambda s: None,
                     modes=["fwd_nograd"], cost_metadata=False, prune=None, **kw)

    df = run().set_index("impl")
    assert [a for a in asked if a[0] == "measure"] == [("measure", "eager", True), ("measure", "fast_wrong", False),
                                                       ("measure", "next", False), ("measure", "slow", False)]
    assert [a[1] for a in asked if a[0] == "gate"] == ["fast_wrong", "next"]
    assert df.loc["next", "ok"] == 1 and df.loc["fast_wrong", "ok"] == 0 and "wrong" in df.loc["fast_wrong", "reason"]
    assert df.loc["slow", "ok"] == 0 and "next, correct, is chosen over it" in df.loc["slow", "reason"]
    assert tiered_ops.select_backend("softmax", (64, 64), "fp32", "cpu", tune=False).name == "next"
    run()
    assert asked == []  # resumed: every row stored is taken, the never-chosen one included
    run(force=True, gate_all=True)
    assert {a[2] for a in asked if a[0] == "measure"} == {True} and not [a for a in asked if a[0] == "gate"]
    # a gate whose row is not fresh here (it failed to build, in another environment) is not asked again and again
    monkeypatch.setattr(bench, "gate_row", lambda *a, **k: (asked.append(("gate", a[1].name, None)), dict(
        a[6], ok=0, reason="raised at 1x1 seed 1: a build error", env="another machine's environment"))[1])
    run(force=True)
    assert [a[1] for a in asked if a[0] == "gate"] == ["fast_wrong"]
