"""A peer that fails an edge case it does not claim (Liger at 0 rows) is still timed at the problems where it is
correct, marked as such: the reports show it beside ours; nothing ever chooses it. A peer wrong at the problem
itself, and a tier of ours failing an edge case, are not timed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from tiered_ops.analysis.analysis import winners
from tiered_ops.measure import gate
from tiered_ops.measure.measure import measure
from tiered_ops.registry import Tier
from tiered_ops.store.rows import EDGE_ONLY, edge_only, usable
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_gates(monkeypatch):
    monkeypatch.setattr(gate, "_edge_results", {})
    monkeypatch.setattr(gate, "_problem_results", {})


def _softmax_that(wrong_at_8_rows: bool = False, tier: Tier = Tier.PEER):
    """softmax's eager tier, made to raise at no rows (an edge case: Liger's cross_entropy does so), and where asked
    to be wrong at 8 rows (the problem measured below)."""
    spec = get_op("softmax")
    eager = spec.impls["eager"]

    def fn(x, dim=-1):
        if x.shape[0] == 0:
            raise RuntimeError("Expected reduction dim to be specified for input.numel() == 0")
        y = eager.fn(x, dim)
        return y * 1.5 if wrong_at_8_rows and x.shape[0] == 8 else y

    impl = replace(eager, name="a_peer", tier=tier, fn=fn, unchecked=fn, sources=(Path(__file__),), _hash=None)
    return spec, impl


def test_a_peer_failing_an_edge_case_it_does_not_claim_is_timed_where_it_is_correct_and_never_chosen():
    spec, peer = _softmax_that()
    problem = spec.problem((8, 64), dim=-1)
    row = measure(spec, peer, problem, torch.float32, CPU)
    assert row["ok"] == 0 and edge_only(row) and not usable(row)  # never chosen: not ok
    assert row["reason"].startswith(EDGE_ONLY + "raised at 0x16") and "RuntimeError" in row["reason"]
    assert row["caller_us"] > 0 and row["p50_us"] > 0 and row["rel_error"] is not None and row["rel_error"] < 1e-5
    # beside ours in the reports: the fastest peer of its case, marked; the winner one of ours
    ours = measure(spec, spec.impls["eager"], problem, torch.float32, CPU)
    assert ours["ok"] == 1
    df = pd.DataFrame([ours, row])
    w = winners(df).iloc[0]
    assert (w.winner, w.peer, bool(w.peer_edge_only)) == ("eager", "a_peer", True)
    assert w.peer_us == pytest.approx(row["caller_us"])


def test_a_peer_wrong_at_the_problem_itself_is_not_timed():
    spec, peer = _softmax_that(wrong_at_8_rows=True)
    row = measure(spec, peer, spec.problem((8, 64), dim=-1), torch.float32, CPU)
    assert row["ok"] == 0 and not edge_only(row) and row.get("caller_us") is None, row
    assert row["reason"].startswith("edge case: raised at 0x16")


def test_a_tier_of_ours_failing_an_edge_case_is_not_timed():
    spec, ours = _softmax_that(tier=Tier.TRITON)
    row = measure(spec, ours, spec.problem((8, 64), dim=-1), torch.float32, CPU)
    assert row["ok"] == 0 and not edge_only(row) and row.get("caller_us") is None, row
    assert row["reason"].startswith("edge case: raised at 0x16")
