"""A pass of an implementation's edge problems is recorded in the store (``edge_gates``), so a later process (a resumed
sweep, a restarted server) does not compile and check them again; a failure is not recorded; any change of source,
dtype, mode's gradients or versions is another gate."""

from __future__ import annotations

import pytest
import torch

from tiered_ops.decide.claimed import measure_kept
from tiered_ops.measure import gate
from tiered_ops.measure.case import edge_store_key
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import EDGES
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


@pytest.fixture
def checked(monkeypatch):
    """The problems the gate checks, in order; the process's gate caches emptied (a fresh process)."""
    monkeypatch.setattr(gate, "_edge_results", {})
    monkeypatch.setattr(gate, "_problem_results", {})
    seen: list = []
    real = gate.check_one

    def spy(spec, impl, problem, *a, **kw):
        seen.append(problem)
        return real(spec, impl, problem, *a, **kw)

    monkeypatch.setattr(gate, "check_one", spy)
    return seen


def test_a_recorded_pass_is_not_checked_again_by_the_next_process(private_store, checked, monkeypatch):
    spec, store = get_op("rms_norm"), Store(private_store)
    impl, problem = spec.impls["eager"], spec.problem((8, 64), normalized_shape=(64,))
    edges = set(map(str, spec.edge_problems()))
    row = measure_kept(store, spec, impl, problem, torch.float32, CPU)
    assert row["ok"] == 1 and EDGES not in row, row
    assert edges <= set(map(str, checked)), checked  # the first process checked them
    key = edge_store_key(spec, impl, torch.float32, fingerprint(CPU), "fwd_nograd")
    worst = store.edge_gate(key)
    assert worst is not None and 0 <= worst < 1e-5
    # the next process: nothing cached in it, the store says the edges passed
    checked.clear()
    monkeypatch.setattr(gate, "_edge_results", {})
    monkeypatch.setattr(gate, "_problem_results", {})
    row = measure_kept(store, spec, impl, problem, torch.float32, CPU)
    assert row["ok"] == 1 and not edges & set(map(str, checked)), checked
    assert [str(p) for p in checked] == [str(problem)] * len(gate.SEEDS), checked  # the problem's own seeds only
    # training (gradients): another gate, checked and recorded apart
    checked.clear()
    measure_kept(store, spec, impl, problem, torch.float32, CPU, mode="fwd+bwd")
    assert edges <= set(map(str, checked)), checked
    assert store.edge_gate(edge_store_key(spec, impl, torch.float32, fingerprint(CPU), "fwd+bwd")) is not None
    assert store.count("edge_gates") == 2


def test_a_failed_edge_gate_is_not_recorded(private_store, checked, monkeypatch):
    spec, store = get_op("softmax"), Store(private_store)
    impl, problem = spec.impls["eager"], spec.problem((8, 64), dim=-1)
    first_edge = spec.edge_problems()[0]

    def wrong(spec_, impl_, p, *a, **kw):
        checked.append(p)
        return (1.0, f"wrong output at {p} seed 1: planted") if p == first_edge else (0.0, None)

    monkeypatch.setattr(gate, "check_one", wrong)
    row = measure_kept(store, spec, impl, problem, torch.float32, CPU)
    assert row["ok"] == 0 and row["reason"].startswith("edge case: wrong output"), row
    assert store.count("edge_gates") == 0 and EDGES not in row
