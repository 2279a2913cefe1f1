"""The gate's memory budget: a row-wise problem whose float64 check would move more than TIERED_OPS_GATE_BYTES is
checked on a sample of its rows (and the row says so); reductions over dim 0 and segment problems are checked whole."""

from __future__ import annotations

import torch

from tiered_ops.measure import gate, measure
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


def test_a_huge_row_wise_problem_is_gated_on_its_first_rows(monkeypatch):
    spec = get_op("softmax")
    problem = spec.problem((4096, 512))
    monkeypatch.setenv("TIERED_OPS_GATE_BYTES", str(1 << 20))
    checked, note = gate.gate_problem(spec, problem, CPU)
    assert checked.shape[1:] == (512,) and 1 <= checked.shape[0] < 4096
    assert spec.mode_bytes(checked, torch.float64, "fwd_nograd") <= 1 << 20
    assert note and "of 4096 rows" in note and "TIERED_OPS_GATE_BYTES" in note
    monkeypatch.setenv("TIERED_OPS_GATE_BYTES", str(1 << 30))
    assert gate.gate_problem(spec, problem, CPU) == (problem, None)


def test_no_sample_where_rows_are_not_independent(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_GATE_BYTES", "1024")
    softmax, rms, seg = get_op("softmax"), get_op("rms_norm"), get_op("segment_sum")
    for spec, p in ((softmax, softmax.problem((4096, 512), dim=0)),
                    (rms, rms.problem((64, 512), normalized_shape=(64, 512))),
                    (seg, seg.problem((4096, 64)))):
        assert gate.gate_problem(spec, p, CPU) == (p, None), (spec.name, p)


def test_gate_checks_the_sample_and_the_row_says_so(monkeypatch):
    spec = get_op("rms_norm")
    problem = spec.problem((2048, 256))
    monkeypatch.setenv("TIERED_OPS_GATE_BYTES", str(256 << 10))
    monkeypatch.setattr(gate, "_problem_results", {})
    seen = []
    real = gate.check_one

    def spy(spec_, impl, p, *a, **k):
        seen.append(p)
        return real(spec_, impl, p, *a, **k)

    monkeypatch.setattr(gate, "check_one", spy)
    row = measure.measure(spec, spec.impls["eager"], problem, torch.float32, CPU)
    assert row["ok"] == 1, row.get("reason")
    at_problem = [p for p in seen if p.shape[1:] == (256,) and p.shape[0] > 1 and p not in spec.edge_problems()]
    assert at_problem and all(p.shape[0] < 2048 for p in at_problem), at_problem
    assert "gated on the first" in row["reason"] and "of 2048 rows" in row["reason"]
