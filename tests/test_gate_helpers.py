"""Gate helpers: background tuning's extra worker processes split a gate's edge checks with its measuring worker. The
split gives the figure the sequential gate gives, a failing share leaves the verdict to the worker's own gate, and a
bucket tuned with a helper records the edge gate it passed in the store."""

import logging

import plants  # noqa: F401 (registers plant_double)
import pytest
import torch

from tiered_ops import envs
from tiered_ops.decide import background
from tiered_ops.decide import decide as select
from tiered_ops.decide.helpers import Helpers, split_edges
from tiered_ops.measure.case import edge_store_key
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.gate import check_edges, edge_checks
from tiered_ops.measure.measure import base_row
from tiered_ops.measure.worker import Pool
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
MODULES = ["plants"]


def test_edge_checks_split_over_two_workers_give_the_sequential_gates_figure():
    spec = get_op("plant_double")
    checks = edge_checks(spec)
    assert checks == len(spec.edge_problems()) + 1  # one per edge problem, then the defaults
    with Pool(CPU, MODULES, timeout_s=120, log=lambda s: None) as main, \
            Pool(CPU, MODULES, timeout_s=120, log=lambda s: None) as helper:
        worst, said = split_edges(main, [helper], ("edges", "plant_double", "triton_good", "fp32", False), checks, "t")
        assert said == f"{checks} edge checks in 2 processes" and worst is not None, said
        # the same inputs (each edge problem's seed) as the gate in this process: the same worst error
        assert worst == check_edges(spec, spec.impls["triton_good"], torch.float32, CPU, False)[0]
        bad, why = split_edges(main, [helper], ("edges", "plant_double", "triton_bad", "fp32", False), checks, "t")
        assert bad is None and why.startswith("edge case: ") and "planted" in why, why
        # a share whose worker dies: no figure, and the death said
        main.worker.kill()
        lost, why = split_edges(main, [helper], ("edges", "plant_double", "triton_good", "fp32", False), checks, "t")
        assert lost is None and "worker died" in why, why


def test_check_edges_runs_the_numbered_share_and_stops_at_its_first_failure():
    spec = get_op("plant_double")
    good, bad = spec.impls["triton_good"], spec.impls["triton_bad"]
    n = edge_checks(spec)
    assert check_edges(spec, good, torch.float32, CPU, False, []) == (0.0, None)
    # the defaults' check alone: plant_double has no option with a default, nothing to fail
    assert check_edges(spec, bad, torch.float32, CPU, False, [n - 1]) == (0.0, None)
    err, why = check_edges(spec, bad, torch.float32, CPU, False, [1])  # the second edge problem alone
    assert why.startswith("edge case: ") and "planted" in why, why
    err, why = check_edges(spec, bad, torch.float32, CPU, False)
    assert why.startswith("edge case: ") and "planted" in why, why


def test_helpers_start_beside_the_worker_and_close_with_it():
    h = Helpers(str(CPU), MODULES, 2, 120, lambda s: None)
    try:
        assert h.wait(120) == 2 and len(h.ready()) == 2
        pids = {p.worker.proc.pid for p in h.ready()}
        assert len(pids) == 2
        h.ready()[0].worker.kill()
        h.ready()[0]._drop()  # as Pool.run does with a worker that died
        assert len(h.ready()) == 1
        h.revive()
        assert h.wait(120) == 2
    finally:
        procs = [p.worker.proc for p in h.pools if p.worker is not None]
        h.close()
    assert all(p.poll() is not None for p in procs), "a helper outlived close"


def test_a_bucket_tuned_with_a_helper_splits_its_winners_edge_checks(private_store, monkeypatch, caplog):
    """The compile tier, gated after its timing: its edge checks run in the worker and one helper at once, their pass
    is stored as the gate's would be, and the decision lands on it (eager is stored already, as slow)."""
    monkeypatch.setenv("TIERED_OPS_GATE_HELPERS", "1")
    assert envs.gate_helpers("cpu") == 1
    spec = get_op("gelu")
    monkeypatch.setattr(spec, "impls", {n: spec.impls[n] for n in ("eager", "compile")})
    slow = dict(p20_us=1e6, p50_us=1e6, p80_us=1e6, host_us=1e6, host_p20_us=1e6, host_p80_us=1e6, caller_us=1e6)
    problem = spec.problem((8, 64))
    Store(private_store).add([dict(base_row(spec, spec.impls["eager"], problem, torch.float32, "fwd_nograd",
                                            fingerprint(CPU)), ok=1, rel_error=0.0, **slow)])
    caplog.set_level(logging.INFO, logger="tiered_ops")
    background.shutdown()
    select.set_tuning("background")
    try:
        sel = select.select_backend("gelu", (8, 64), "fp32", "cpu")
        assert sel.record.get("tuning") == background.QUEUED, sel.record
        assert background.wait_for_tuning(timeout=600)
    finally:
        background.shutdown()
        select.set_tuning(None)
    figures = [getattr(r, background.CANDIDATE) for r in caplog.records if hasattr(r, background.CANDIDATE)]
    split = [f for f in figures if f["impl"] == "compile" + background.EDGE_SHARES]
    n = edge_checks(spec)
    assert len(split) == 1 and split[0]["outcome"] == f"passed: {n} edge checks in 2 processes", figures
    store = Store(private_store)
    newest = {r["impl"]: r for r in store.rows(op="gelu")}
    assert newest["compile"]["ok"] == 1, newest
    key = edge_store_key(spec, spec.impls["compile"], torch.float32, fingerprint(CPU), "fwd_nograd")
    assert store.edge_gate(key) is not None
    assert select.select_backend("gelu", (8, 64), "fp32", "cpu", tune=False).name == "compile"


@pytest.mark.parametrize("cores,want", [(2, 0), (8, 2), (16, 3), (64, 3)])
def test_gate_helpers_default_to_a_quarter_of_the_cores_on_a_gpu_and_none_on_the_cpu(monkeypatch, cores, want):
    monkeypatch.delenv("TIERED_OPS_GATE_HELPERS", raising=False)
    monkeypatch.setattr(envs.os, "cpu_count", lambda: cores)
    assert envs.gate_helpers("cuda") == want and envs.gate_helpers("cpu") == 0
