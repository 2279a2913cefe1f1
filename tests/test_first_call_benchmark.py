"""benchmarks/first_call.py's comparison with blocking tuning: the bucket tuned blocking in a store of its own, and
the background pick's caller time over the blocking pick's, read from that one tuning's measurements."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import first_call  # noqa: E402
from tiered_ops.decide import decide  # noqa: E402


def _fake_select(chosen, us):
    calls = []

    def select(spec, problem, dtype, dev, mode):
        calls.append((spec.name, mode, decide.tuning_mode()))
        return SimpleNamespace(name=chosen, record=dict(candidates=[dict(impl=k, caller_us=v) for k, v in us.items()]))

    return select, calls


def test_the_background_pick_is_judged_by_the_blocking_tunings_own_measurements(monkeypatch, tmp_path):
    select, calls = _fake_select("triton", {"eager": 30.0, "triton": 20.0, "compile": 25.0})
    monkeypatch.setattr(first_call, "select_problem", select)
    r = first_call.vs_blocking("softmax", torch.device("cpu"), tmp_path, "compile")
    assert (r["blocking_chosen"], r["vs_blocking"]) == ("triton", 1.25)
    assert calls == [("softmax", "fwd_nograd", "blocking")]  # tuned blocking, then the setting given back
    assert decide.tuning_setting() is None


def test_a_pick_without_a_timing_there_has_no_ratio(monkeypatch, tmp_path):
    select, _ = _fake_select("eager", {"eager": None, "compile": 25.0})
    monkeypatch.setattr(first_call, "select_problem", select)
    assert first_call.vs_blocking("gelu", torch.device("cpu"), tmp_path, "compile")["vs_blocking"] is None


def test_busy_calls_go_on_until_the_decision_is_stored_or_the_timeout(monkeypatch):
    answers = iter([False, False, False, True])
    monkeypatch.setattr(first_call.tiered_ops, "wait_for_tuning", lambda timeout=None: next(answers))
    calls = []
    landed, n = first_call.busy_until_landed(lambda: calls.append(1), torch.device("cpu"), timeout=60.0)
    assert (landed, n, len(calls)) == (True, 3, 3)
    monkeypatch.setattr(first_call.tiered_ops, "wait_for_tuning", lambda timeout=None: False)
    landed, n = first_call.busy_until_landed(lambda: None, torch.device("cpu"), timeout=0.05)
    assert not landed and n >= 1
