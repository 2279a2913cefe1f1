"""Blocking tuning through background tuning's worker (on a GPU by default; forced here on the CPU with
TIERED_OPS_BLOCKING_ASIDE=1): the call blocks until its bucket's rows are stored, then decides from them as it would
after measuring them in its own process; a worker that cannot measure it says so in one line and the call measures it
itself. Never a provisional decision."""

import logging
import os
import threading
import time

import pytest
import torch
from test_background import _FakePool, _no_measuring, _only
from test_blocking_pruned import _fake_measure

import tiered_ops
from tiered_ops import envs
from tiered_ops.decide import background, blocking, claimed
from tiered_ops.decide import decide as select
from tiered_ops.measure import case
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import bucket_str
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

TIMES = {"eager": (10.0, 12.0), "triton": (4.0, 5.0), "compile": (6.0, 7.0)}


@pytest.fixture
def aside(monkeypatch):
    """Blocking tuning, its misses handed to background tuning's worker on the CPU too; the thread stopped before and
    after; a process that has not tuned yet (its first tune warns)."""
    background.shutdown()
    monkeypatch.setenv("TIERED_OPS_BLOCKING_ASIDE", "1")
    monkeypatch.setattr(claimed, "_first", threading.Event())
    select.set_tuning("blocking")
    _only(monkeypatch, "softmax", "eager", "triton", "compile")
    yield
    background.shutdown()
    background._s.given_up.clear()
    select.set_tuning(None)


def _in_process(monkeypatch, asked: list) -> None:
    """The caller's own measuring made up from TIMES (as tests/test_blocking_pruned.py makes it up)."""
    monkeypatch.setattr(select, "measure_kept", _fake_measure(asked, TIMES))
    monkeypatch.setattr(case, "gate_row", lambda spec, impl, problem, dtype, device, mode, row, edges=None, **_:
                        dict(row, ok=1, rel_error=0.0, reason=None))
    monkeypatch.setattr(claimed, "check_fits", lambda *a, **k: None)


def _settled(sel) -> None:
    """A decision from the bucket's own measured rows: nothing provisional, predicted or queued about it."""
    r = sel.record
    assert "tuning" not in r and "provisional" not in r, r
    assert "nearest" not in r["reason"] and "tuning off" not in r["reason"], r
    assert r["candidates"], r


def test_the_call_blocks_until_the_rows_are_stored_and_decides_as_the_in_process_path(aside, private_store,
                                                                                     monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(select, "measure_kept", _no_measuring)  # nothing measured in the caller's process
    monkeypatch.setattr(claimed, "measure_kept", _no_measuring)
    release, asked = threading.Event(), []
    monkeypatch.setattr(background, "_pool_for", lambda me, job: _FakePool(asked, TIMES, release))
    caplog.set_level(logging.INFO, logger="tiered_ops")
    seen: dict = {}

    def watch() -> None:  # beside the call: what stands while the worker still measures compile
        deadline = time.monotonic() + 60
        while ("measure", "compile") not in [(k, n) for k, n, _ in asked] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # eager and triton are stored and landed by now: the call still waits for compile
        seen.update(returned="y" in out, stored={r["impl"] for r in Store(private_store).rows(op="softmax")})
        release.set()

    x, out = torch.randn(4, 64), {}
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out["y"] = tiered_ops.softmax(x, -1)  # on this thread: the store's connection is this thread's
    watcher.join(60)
    assert seen["returned"] is False, "the call returned before its bucket was measured"
    assert seen["stored"] == {"eager", "triton"}, seen
    torch.testing.assert_close(out["y"], torch.softmax(x, -1))
    stored = {r["impl"]: r for r in Store(private_store).rows(op="softmax")}
    assert set(stored) == {"eager", "triton", "compile"} and stored["triton"]["ok"] == 1, stored
    assert [(k, n) for k, n, _ in asked] == [("measure", "eager"), ("measure", "triton"), ("measure", "compile"),
                                            ("gate", "triton")], asked
    sel = select.select_backend("softmax", (4, 64), dim=-1)  # the call's decision, from the table
    _settled(sel)
    assert sel.name == "triton", sel.record
    # the same decision as from the same rows without measuring (tuning off: the stored rows alone) ...
    select.clear_cache()
    again = select.select_backend("softmax", (4, 64), dim=-1, tune=False)
    assert (again.name, again.record["reason"], again.record["candidates"]) == (
        sel.name, sel.record["reason"], sel.record["candidates"])
    # ... and as the in-process path's after measuring the same figures in the caller's process
    monkeypatch.setenv("TIERED_OPS_BLOCKING_ASIDE", "0")
    mine: list = []
    _in_process(monkeypatch, mine)
    tiered_ops.use_store(str(tmp_path / "in_process.sqlite"))
    own = select.select_backend("softmax", (4, 64), dim=-1)
    assert [n for n, _ in mine] == ["eager", "triton", "compile"], mine
    assert (own.name, own.record["reason"]) == (sel.name, sel.record["reason"]), (own.record, sel.record)
    said = [r for r in caplog.records if r.getMessage().startswith("tiered_ops: tuning softmax 4x64")]
    assert said[0].levelno == logging.WARNING, said  # the first-use line: what it waits for and for how long
    text = said[0].getMessage()
    for part in ("3 implementation(s)", "on first use, ~", "s (an estimate)", blocking.IN_WORKER):
        assert part in text, (part, text)


def test_two_buckets_in_a_row_each_waits_for_its_own(aside, private_store, monkeypatch):
    monkeypatch.setattr(select, "measure_kept", _no_measuring)
    monkeypatch.setattr(claimed, "measure_kept", _no_measuring)
    asked: list = []
    monkeypatch.setattr(background, "_pool_for", lambda me, job: _FakePool(asked, TIMES))
    for rows_n in (4, 200):
        x = torch.randn(rows_n, 64)
        torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x, -1))
        stored = {r["impl"] for r in Store(private_store).rows(op="softmax") if r["problem"].startswith(f"{rows_n}x")}
        assert stored == {"eager", "triton", "compile"}, (rows_n, stored)  # stored before the call returned
        sel = select.select_backend("softmax", (rows_n, 64), dim=-1)
        _settled(sel)
        assert sel.name == "triton", sel.record
    assert [n for k, n, _ in asked if k == "measure"] == ["eager", "triton", "compile"] * 2, asked
    assert background.pending() == 0


class _Unstartable:
    def start(self):
        raise RuntimeError("a measurement worker for cpu could not start: no interpreter here")

    def run(self, task, what):
        raise AssertionError("a worker that never started ran a task")


def test_a_worker_that_cannot_start_falls_back_to_measuring_in_the_process_with_one_line(aside, private_store,
                                                                                        monkeypatch, caplog):
    monkeypatch.setattr(background, "_pool_for", lambda me, job: _Unstartable())
    asked: list = []
    _in_process(monkeypatch, asked)
    caplog.set_level(logging.INFO, logger="tiered_ops")
    x = torch.randn(4, 64)
    torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x, -1))
    assert [n for n, _ in asked] == ["eager", "triton", "compile"], asked  # measured in the caller's process
    sel = select.select_backend("softmax", (4, 64), dim=-1)
    _settled(sel)
    assert sel.name == "triton", sel.record
    lines = [r for r in caplog.records if "did not measure it" in r.getMessage()
             or "background tuning of" in r.getMessage() and "failed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    text = lines[0].getMessage()
    assert "could not start: no interpreter here" in text and "measuring it in this process" in text, text
    assert "\n" not in text


def test_a_full_queue_falls_back_to_measuring_in_the_process(aside, private_store, monkeypatch, caplog):
    monkeypatch.setattr(background, "QUEUE_MAX", 0)
    asked: list = []
    _in_process(monkeypatch, asked)
    caplog.set_level(logging.INFO, logger="tiered_ops")
    tiered_ops.softmax(torch.randn(4, 64), -1)
    assert [n for n, _ in asked] == ["eager", "triton", "compile"], asked
    _settled(select.select_backend("softmax", (4, 64), dim=-1))
    assert any("cannot measure it (the background tuning queue is full" in r.getMessage() for r in caplog.records)


def test_the_cpu_measures_in_the_process_unless_forced():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TIERED_OPS_BLOCKING_ASIDE", raising=False)
        # the default (auto): the worker on a GPU alone
        assert not envs.blocking_aside(cpu.type) and envs.blocking_aside(gpu.type)
        mp.setenv("TIERED_OPS_BLOCKING_ASIDE", "auto")
        assert not envs.blocking_aside(cpu.type) and envs.blocking_aside(gpu.type)
        mp.setenv("TIERED_OPS_BLOCKING_ASIDE", "0")
        assert not envs.blocking_aside(gpu.type)
        mp.setenv("TIERED_OPS_BLOCKING_ASIDE", "1")
        assert envs.blocking_aside(cpu.type) and envs.blocking_wait_s() > 0


@pytest.mark.gpu
def test_a_blocking_first_call_on_a_gpu_is_measured_in_the_worker(private_store, monkeypatch, caplog):
    """On a GPU with ``auto``: the first call waits for the worker and its gate helpers, and decides from the stored
    rows of every candidate."""
    background.shutdown()
    monkeypatch.setenv("TIERED_OPS_BLOCKING_ASIDE", "auto")  # on a GPU, the worker measures
    select.set_tuning("blocking")
    caplog.set_level(logging.INFO, logger="tiered_ops")
    try:
        x = torch.randn(8, 1000, device="cuda")
        torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x, -1))
        assert any(blocking.IN_WORKER in r.getMessage() for r in caplog.records)
        assert not any("did not measure it" in r.getMessage() for r in caplog.records)
        sel = select.select_backend("softmax", (8, 1000), device="cuda", dim=-1)
        _settled(sel)
        fresh = {r["impl"] for r in Store(private_store).rows(op="softmax")}
        assert {c["impl"] for c in sel.record["candidates"]} <= fresh
    finally:
        background.shutdown()
        select.set_tuning(None)


def test_a_worker_that_outlasts_the_wait_falls_back_to_measuring_in_the_process(aside, private_store, monkeypatch,
                                                                                 caplog):
    monkeypatch.setenv("TIERED_OPS_BLOCKING_WAIT_S", "1")
    release, asked = threading.Event(), []
    monkeypatch.setattr(background, "_pool_for", lambda me, job: _FakePool(asked, TIMES, release))  # compile hangs
    mine: list = []
    _in_process(monkeypatch, mine)
    caplog.set_level(logging.INFO, logger="tiered_ops")
    try:
        tiered_ops.softmax(torch.randn(4, 64), -1)
    finally:
        release.set()
    assert [n for n, _ in mine] == ["compile"], mine  # what the worker had not stored yet
    _settled(select.select_backend("softmax", (4, 64), dim=-1))
    lines = [r.getMessage() for r in caplog.records if "did not measure it" in r.getMessage()]
    assert len(lines) == 1 and "not measured within 1 s" in lines[0], lines


def test_a_bucket_another_process_measures_is_waited_for_not_measured_again(aside, private_store, monkeypatch):
    """The bucket's claim, held by another owner of the store, is waited for as in the caller's own measuring; what
    it stored is used, nothing is handed to the worker."""
    monkeypatch.setattr(select, "measure_kept", _no_measuring)
    asked: list = []
    monkeypatch.setattr(background, "_pool_for", lambda me, job: _FakePool(asked, TIMES))
    spec, cpu = get_op("softmax"), torch.device("cpu")
    problem = spec.problem((4, 64), dim=-1)
    key5 = ("softmax", bucket_str(spec.bucket(problem)), "fp32", fingerprint(cpu).key, "fwd_nograd")
    held, done = threading.Event(), threading.Event()

    def other() -> None:  # another owner of the store: claims the bucket, measures it (made up), releases
        st = Store(str(private_store))
        st.owner = ("another-host", os.getpid(), "a-rank-elsewhere")  # as tests/test_contended_tuning.py holds one
        assert st.claim(claimed.bucket_key(spec, key5), 60)
        held.set()
        time.sleep(0.5)
        rows = []
        for name in ("eager", "triton", "compile"):
            rows.append(_fake_measure([], TIMES)(st, spec, spec.impls[name], problem, torch.float32, cpu,
                                                 "fwd_nograd"))
        st.add(rows)
        st.release()
        st.close()
        done.set()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    assert held.wait(30)
    tiered_ops.softmax(torch.randn(4, 64), -1)
    assert done.is_set() and not asked, asked
    sel = select.select_backend("softmax", (4, 64), dim=-1)
    _settled(sel)
    assert sel.name == "triton", sel.record
