"""Blocking tuning measures a bucket as background tuning does: the tiers whose gate compiles nothing first, a short
timing before the rest (pruned where clearly slower than the fastest full timing so far), the compiled tiers timed
without their gate, which then runs only for the candidate the choice names."""

from __future__ import annotations

import pytest
import torch

from tiered_ops.decide import claimed
from tiered_ops.measure import case
from tiered_ops.measure.case import edge_store_key
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import EDGES, PRUNE_FACTOR, base_row
from tiered_ops.registry import DTYPE_NAMES, Problem
from tiered_ops.store.rows import PRUNED, UNGATED
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


def _fake_measure(asked: list, times: dict[str, tuple[float, float]]):
    """A ``measure_kept`` stand-in: each candidate's p20-p80 from ``times``; a candidate above the prune bar comes
    back pruned (not gated), ``gated=False`` rows come back not ok and not gated, as ``measure`` writes them."""

    def measure(store, spec, impl, problem, dtype, device, mode, **kw):
        if "bucket" in kw:  # the tuner hands down its store key's bucket
            assert kw.pop("bucket") == base_row(spec, impl, problem, dtype, mode, fingerprint(device))["bucket"]
        if "gates" in kw:  # and the bucket's edge-gate record (a direct call passes none)
            assert isinstance(kw.pop("gates"), case.EdgeGates)
        asked.append((impl.name, dict(kw)))  # the pruning's keywords
        lo, hi = times[impl.name]
        row = base_row(spec, impl, problem, dtype, mode, fingerprint(device))
        row.update(p20_us=lo, p50_us=(lo + hi) / 2, p80_us=hi, host_us=lo, host_p20_us=lo, host_p80_us=hi,
                   caller_us=(lo + hi) / 2, first_call_s=0.01)
        if kw.get("prune_above_us") is not None and lo > kw["prune_above_us"]:
            return dict(row, ok=0, reason=f"{PRUNED}slower; not gated either (never chosen)")
        if kw.get("gated", True):
            return dict(row, ok=1, rel_error=0.0, reason=None)
        return dict(row, ok=0, rel_error=None, reason=f"{UNGATED}timed; its gate runs only where it would be chosen")

    return measure


@pytest.mark.parametrize("times, gates, chosen, pruned", [
    # triton fastest: compile timed ungated and passed over, triton's gate alone runs
    ({"eager": (10.0, 12.0), "triton": (4.0, 5.0), "compile": (6.0, 7.0)}, ["triton"], "triton", set()),
    # compile far slower than eager's full timing: pruned by its short timing, no gate
    ({"eager": (10.0, 12.0), "triton": (9.0, 10.0), "compile": (10.0 * PRUNE_FACTOR * 3, 400.0)}, ["triton"],
     "triton", {"compile"}),
])
def test_blocking_tuning_prunes_and_gates_only_the_named_candidate(tmp_path, monkeypatch, times, gates, chosen,
                                                                   pruned):
    spec = get_op("softmax")
    impls = {n: spec.impls[n] for n in ("compile", "triton", "eager")}  # given out of order on purpose
    monkeypatch.setattr(spec, "impls", impls)
    gated: list[str] = []

    def gate_row(spec_, impl, problem, dtype, device, mode, row, edges=None):
        gated.append(impl.name)
        return dict(row, ok=1, rel_error=0.0, reason=None)

    monkeypatch.setattr(case, "gate_row", gate_row)
    monkeypatch.setattr(claimed, "check_fits", lambda *a, **k: None)
    monkeypatch.setattr(case.recheck, "retime", lambda *a, **k: ([], None))
    store = Store(str(tmp_path / "s.sqlite"))
    asked: list = []
    problem = Problem((4, 64), (("dim", -1),))
    rows, took, busy = claimed.tune_bucket(store, spec, problem, torch.float32, CPU, "fwd_nograd", "eager",
                                           measure_one=_fake_measure(asked, times))
    assert busy is None and took is not None
    assert [n for n, _ in asked] == ["eager", "triton", "compile"], asked  # the compiled tiers last
    assert asked[0][1] == {}, asked  # nothing to prune against yet: timed and gated in full
    bar = PRUNE_FACTOR * times["eager"][1]
    assert asked[1][1] == dict(prune_above_us=bar, best="eager", gate_first=False, gated=False), asked
    assert asked[2][1]["gated"] is False and asked[2][1]["prune_above_us"] <= bar, asked
    assert gated == gates, gated
    newest = {r["impl"]: r for r in rows}
    assert newest[chosen]["ok"] == 1, newest[chosen]
    for name in {"triton", "compile"} - {chosen}:
        r = newest[name]
        assert r["ok"] == 0, r
        assert r["reason"].startswith(PRUNED if name in pruned else UNGATED), r
        assert name not in gated
    assert {r["dtype"] for r in rows} == {DTYPE_NAMES[torch.float32]}


def test_the_gate_turns_read_the_stored_edge_gates_once_and_give_each_gate_its_own(tmp_path, monkeypatch):
    """Two gate turns (the first named fails its gate, the next is named): the store's edge gates are read once for
    the batch, and each gate is given the pass recorded for its own implementation (None where there is none)."""
    spec = get_op("softmax")
    impls = {n: spec.impls[n] for n in ("compile", "triton", "eager")}
    monkeypatch.setattr(spec, "impls", impls)
    given: dict = {}

    def gate_row(spec_, impl, problem, dtype, device, mode, row, edges=None):
        given[impl.name] = edges
        if impl.name == "triton":
            return dict(row, ok=0, rel_error=1.0, reason="wrong output")
        return dict(row, ok=1, rel_error=0.0, reason=None)

    monkeypatch.setattr(case, "gate_row", gate_row)
    monkeypatch.setattr(claimed, "check_fits", lambda *a, **k: None)
    monkeypatch.setattr(case.recheck, "retime", lambda *a, **k: ([], None))
    store = Store(str(tmp_path / "s.sqlite"))
    store.put_edge_gate(edge_store_key(spec, impls["triton"], torch.float32, fingerprint(CPU), "fwd_nograd"), 1e-6)
    reads: list = []
    real = Store.edge_gates
    monkeypatch.setattr(Store, "edge_gates", lambda self, key: reads.append(key) or real(self, key))
    monkeypatch.setattr(Store, "edge_gate", lambda self, key: pytest.fail(f"one implementation's gate read: {key}"))
    times = {"eager": (10.0, 12.0), "triton": (4.0, 5.0), "compile": (6.0, 7.0)}
    rows, _, _ = claimed.tune_bucket(store, spec, Problem((4, 64), (("dim", -1),)), torch.float32, CPU,
                                     "fwd_nograd", "eager", measure_one=_fake_measure([], times))
    assert given == {"triton": 1e-6, "compile": None}, given
    assert len(reads) == 1, reads
    newest = {r["impl"]: r for r in rows}
    assert newest["compile"]["ok"] == 1 and newest["triton"]["ok"] == 0, newest


def test_a_blocking_miss_reads_the_edge_gates_once_and_records_each_new_pass_once(tmp_path, monkeypatch):
    """Each candidate measured by ``measure_kept`` and the named one gated: one read of the store's edge gates for the
    bucket (not one per candidate and one more for the gates), each new pass recorded once; a second bucket is given
    the passes the first recorded, nothing recorded again."""
    spec = get_op("softmax")
    impls = {n: spec.impls[n] for n in ("compile", "triton", "eager")}
    monkeypatch.setattr(spec, "impls", impls)
    new = {"eager": 2e-6, "compile": 4e-6}  # the worst edge error of a pass checked now; triton fails its gate
    times = {"eager": (10.0, 12.0), "triton": (4.0, 5.0), "compile": (6.0, 7.0)}
    given: list = []

    def measure(spec_, impl, problem, dtype, device, mode, edges=None, **kw):
        given.append(("measure", impl.name, edges))
        lo, hi = times[impl.name]
        row = dict(base_row(spec_, impl, problem, dtype, mode, fingerprint(device)), p20_us=lo, p50_us=(lo + hi) / 2,
                   p80_us=hi, host_us=lo, host_p20_us=lo, host_p80_us=hi, caller_us=(lo + hi) / 2, first_call_s=0.01)
        if kw.get("gated", True):
            return dict(row, ok=1, rel_error=0.0, reason=None, **{EDGES: new[impl.name] if edges is None else edges})
        row = dict(row, ok=0, rel_error=None, reason=f"{UNGATED}timed; its gate runs only where it would be chosen")
        return row if edges is None else dict(row, **{EDGES: edges})

    def gate_row(spec_, impl, problem, dtype, device, mode, row, edges=None, **kw):
        given.append(("gate", impl.name, edges))
        if impl.name == "triton":
            return dict(row, ok=0, rel_error=1.0, reason="wrong output")
        return dict(row, ok=1, rel_error=0.0, reason=None, **{EDGES: new[impl.name] if edges is None else edges})

    monkeypatch.setattr(case, "measure", measure)
    monkeypatch.setattr(case, "gate_row", gate_row)
    monkeypatch.setattr(claimed, "check_fits", lambda *a, **k: None)
    monkeypatch.setattr(case.recheck, "retime", lambda *a, **k: ([], None))
    store = Store(str(tmp_path / "s.sqlite"))
    reads: list = []
    puts: list = []
    real_read, real_put = Store.edge_gates, Store.put_edge_gate
    monkeypatch.setattr(Store, "edge_gates", lambda self, key: reads.append(key) or real_read(self, key))
    monkeypatch.setattr(Store, "edge_gate", lambda self, key: pytest.fail(f"one implementation's gate read: {key}"))
    monkeypatch.setattr(Store, "put_edge_gate",
                        lambda self, key, e, *a: puts.append((key[1], e)) or real_put(self, key, e, *a))
    for n_rows in (4, 256):  # two buckets, each a blocking miss over three candidates
        given.clear(), reads.clear()
        rows, _, _ = claimed.tune_bucket(store, spec, Problem((n_rows, 64), (("dim", -1),)), torch.float32, CPU,
                                         "fwd_nograd", "eager")
        assert len(reads) == 1, reads
        newest = {r["impl"]: r for r in rows}
        assert newest["compile"]["ok"] == 1 and newest["triton"]["ok"] == 0, newest
        assert all(EDGES not in r for r in newest.values()), newest
        known = {} if n_rows == 4 else new  # the second bucket is handed what the first recorded
        assert given == [("measure", "eager", known.get("eager")), ("measure", "triton", None),
                         ("measure", "compile", known.get("compile")), ("gate", "triton", None),
                         ("gate", "compile", known.get("compile"))], given
        assert sorted(puts) == [("compile", new["compile"]), ("eager", new["eager"])], puts
    assert store.count("edge_gates") == 2
