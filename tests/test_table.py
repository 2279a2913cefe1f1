"""The decision table: its key, what a publication does to what readers derive from it, what it carries besides
decisions, and the call path's counts (scripts/diag/call_path.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import tiered_ops
from tiered_ops.decide import capture, table
from tiered_ops.decide import decide as sel_mod
from tiered_ops.runtime import memo
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


@pytest.fixture()
def off():
    sel_mod.set_tuning(False)
    yield
    sel_mod.set_tuning(None)


def _call_path():
    path = Path(__file__).resolve().parents[1] / "scripts" / "diag" / "call_path.py"
    spec = importlib.util.spec_from_file_location("call_path", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_key_is_op_bucket_dtype_device_mode_context_and_another_policy_is_not_published(off):
    spec = get_op("softmax")
    sel = tiered_ops.select_backend("softmax", (8, 64), torch.float32, "cpu")
    key = ("softmax", spec.bucket(spec.problem((8, 64))), torch.float32, CPU, "fwd_nograd", "eager")
    decisions = table.current()
    assert decisions[key].name == sel.name and decisions.how == (*sel_mod.default_policy(), None)
    assert {k[:5] for k in decisions if k[0] == "softmax"} == {key[:5]}  # every context decided at once
    before = dict(decisions)
    other = tiered_ops.select_backend("softmax", (8, 64), torch.float32, "cpu", policy="cold-start", calls=3)
    assert other.record["policy"] == "cold-start" and other.key is None
    assert dict(table.current()) == before  # the process's decisions untouched


def test_a_publication_keeps_of_a_derived_memo_what_still_derives_from_it():
    spec = get_op("softmax")
    eager, compile_ = spec.impls["eager"], spec.impls["compile"]
    k1, k2 = ("softmax", (8, 64), torch.float32, CPU, "fwd_nograd", "eager"), ("x",)
    s1 = table.Selection(eager.fn, eager, {}, k1)
    s2 = table.Selection(eager.fn, eager, {}, k2)
    sel_mod.clear_cache()
    table.publish(add={k1: s1, k2: s2})
    by_object, by_impl = table.derived(), table.derived("impl")
    by_object.update(a=s1, b=s2)
    by_impl.update(a=table.Selection(lambda: None, eager, {}, k1), b=s2)
    table.publish(add={k1: table.Selection(eager.fn, eager, {}, k1)})  # the same implementation, a new record
    assert set(by_object) == {"b"} and set(by_impl) == {"a", "b"}
    table.publish(add={k1: table.Selection(compile_.fn, compile_, {}, k1)})  # another implementation
    assert set(by_impl) == {"b"}
    table.publish(drop=lambda k, _: k == k2)
    assert not by_impl and not by_object


def test_a_derived_memo_starts_over_past_its_bound(monkeypatch):
    monkeypatch.setattr(table, "BOUND", 3)
    memo_, other = {}, {"x": 1}
    for i in range(3):
        table.put(memo_, i, i, other)
    assert len(memo_) == 3 and other
    table.put(memo_, 1, 1, other)  # a key it holds: nothing starts over
    assert len(memo_) == 3 and other
    table.put(memo_, 3, 3, other)
    assert memo_ == {3: 3} and not other


def test_what_is_warm_is_published_and_outlives_a_cleared_table(monkeypatch):
    monkeypatch.setattr(capture, "capturable", lambda device: True)
    spec = get_op("rms_norm")
    impl, problem = spec.impls["compile"], spec.problem((4, 64), normalized_shape=(64,))
    assert not capture.is_warm(spec, impl, problem, torch.float32, CPU, "fwd_nograd")
    generation = table.current().generation
    capture.mark_warm(spec, impl, problem, torch.float32, CPU, "fwd_nograd")
    assert table.current().generation == generation + 1
    capture.mark_warm(spec, impl, problem, torch.float32, CPU, "fwd_nograd")  # warm already: nothing published
    assert table.current().generation == generation + 1
    sel_mod.clear_cache()
    assert capture.is_warm(spec, impl, problem, torch.float32, CPU, "fwd_nograd")


def test_a_publication_runs_no_code_of_the_call_path(off):
    """The call path's memos are kept by the table's rules: publishing runs no frame of ``tiered_ops.runtime``."""
    x, w = torch.randn(4, 64), torch.randn(64)
    tiered_ops.rms_norm(x, (64,), w)
    assert memo._calls
    ran = set()

    def profile(frame, event, arg):
        if event == "call":
            ran.add(frame.f_globals.get("__name__"))

    sys.setprofile(profile)
    try:
        table.publish(drop=lambda k, _: False)
    finally:
        sys.setprofile(None)
    assert not {m for m in ran if isinstance(m, str) and m.startswith("tiered_ops.runtime")}


def test_a_hit_reaches_the_launch_through_few_modules(off):
    """The acceptance count of the call path: a call of a decided signature, from ``tiered_ops.rms_norm`` to the
    implementation's launch, through <= 6 modules, coming back to one it left <= 2 times."""
    got = _call_path().hit(full=False, level="module")
    assert got["modules"] <= 6 and got["reentries"] <= 2, got["sequence"]
