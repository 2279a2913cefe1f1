"""Background tuning (TIERED_OPS_TUNE=background): a first call returns at once through a prediction while a daemon
thread measures its bucket in a worker process; the landed decision is used by the next call; a killed worker is
retried; a trace's miss queues its bucket, a CUDA-graph capture queues nothing; an exiting process keeps what was stored
and leaves no worker behind."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import plants  # noqa: F401 (registers plant_double)
import pytest
import torch

import tiered_ops
from tiered_ops.decide import background, claimed, table
from tiered_ops.decide import decide as select
from tiered_ops.registry import Tier
from tiered_ops.runtime import memo
from tiered_ops.runtime.dispatch import dispatch, public
from tiered_ops.store.rows import ungated
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bg(monkeypatch):
    """Background tuning for the test, the thread and its worker stopped before and after it."""
    background.shutdown()
    select.set_tuning("background")
    yield
    background.shutdown()
    background._s.given_up.clear()
    select.set_tuning(None)


def _only(monkeypatch, op: str, *names: str) -> None:
    """The op's candidates cut to ``names`` (the worker measures them by name): a short measurement."""
    spec = get_op(op)
    monkeypatch.setattr(spec, "impls", {k: v for k, v in spec.impls.items() if k in names})


def _no_measuring(*args, **kwargs):
    raise AssertionError("measured on the calling thread")


def _eager_selection(op: str):
    return next(s for k, s in memo._calls.items() if k[0] == op and k[-1] == 0)


def test_a_first_call_returns_at_once_and_the_landed_decision_is_used_next(bg, private_store, monkeypatch, caplog):
    monkeypatch.setattr(select, "measure_kept", _no_measuring)
    monkeypatch.setattr(claimed, "measure_kept", _no_measuring)
    caplog.set_level(logging.INFO, logger="tiered_ops")
    x = torch.randn(4, 64)
    y = tiered_ops.softmax(x, -1)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), atol=1e-6, rtol=1e-5)
    first = _eager_selection("softmax")
    assert first.record["tuning"] == "queued for background tuning" and first.name == "eager", first.record
    assert background.pending() == 1
    assert not Store(private_store).rows(op="softmax"), "the call waited for a measurement"
    for _ in range(20):  # calls go on while the bucket is measured: counted, correct
        x = torch.randn(4, 64)
        torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x, -1))
    assert tiered_ops.wait_for_tuning(timeout=600)
    stored = {r["impl"]: r for r in Store(private_store).rows(op="softmax", mode="fwd_nograd")}
    spec = get_op("softmax")
    assert set(stored) == {i.name for i in spec.impls.values() if i.tier != Tier.PEER}
    for tier in (Tier.EAGER, Tier.COMPILE, Tier.TRITON):  # the tiers that run on the CPU (Triton: the interpreter)
        # correct, or timed and never chosen: pruned by a short timing before its gate (successive halving), or
        # timed in full and passed over by the choice, so its gate never ran (which of the two depends on the timings)
        assert any(stored[i.name]["ok"] or "(never chosen)" in (stored[i.name]["reason"] or "")
                   for i in spec.impls.values() if i.tier == tier), (tier, stored)
    assert not [k for k in memo._calls if k[0] == "softmax"], "the landed bucket's selections were dropped"
    tiered_ops.softmax(x, -1)
    now = _eager_selection("softmax")
    assert "tuning" not in now.record and "nearest" not in now.record["reason"], now.record
    assert now.name in {k for k, r in stored.items() if r["ok"]}
    assert now.name == select.select_backend("softmax", (4, 64), tune=False).name
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "background tuning: queued softmax 4x64" in said and "landed in" in said, said
    # each candidate said with its time in the worker, its first call and its outcome (the figures on the record)
    figures = [getattr(r, background.CANDIDATE) for r in caplog.records if hasattr(r, background.CANDIDATE)]
    # the worker's start said apart, before the first candidate (the shutdown before this test left none running)
    assert figures[0]["impl"] == background.WORKER_START and figures[0]["outcome"].startswith("started ("), figures
    assert "interpreter and package import" in figures[0]["outcome"] and "compiler warm-up" not in figures[0]["outcome"]
    assert figures[0]["seconds"] > 0 and figures[0]["first_call_s"] is None, figures
    assert "(worker start) took" in said, said
    gates = [f for f in figures if f["impl"].endswith(background.GATE)]  # a compiled tier gated after its timing
    assert all(stored[f["impl"].removesuffix(background.GATE)]["ok"] for f in gates), gates
    figures = [f for f in figures[1:] if f not in gates]
    assert sorted(f["impl"] for f in figures) == sorted(stored), figures
    for f in figures:
        assert f["op"] == "softmax" and f["seconds"] > 0 and f["outcome"], f
        assert (f["first_call_s"] is None) == (stored[f["impl"]]["first_call_s"] is None), f
    assert "softmax 4x64,dim=-1 fp32 fwd_nograd: eager took" in said, said
    # the tiers whose gate compiles nothing first, the compiled ones last; a gated, timed choice handed to the
    # callers as soon as there is one (eager here), the last landing once every candidate is measured
    order = [f["impl"] for f in figures]
    assert order[0] == "eager" and order[-1] == "compile", order
    landings = [getattr(r, background.LANDING) for r in caplog.records if hasattr(r, background.LANDING)]
    assert [f["final"] for f in landings][-1] and not landings[0]["final"], landings
    assert landings[0]["impl"] == "eager" and all(f["op"] == "softmax" and f["seconds"] > 0 for f in landings)
    assert landings[-1]["impl"] == now.name and landings[0]["seconds"] < landings[-1]["seconds"], landings
    assert "decided" in said and "after it was queued, measuring on: eager" in said, said


def test_a_gated_choice_lands_while_slower_to_gate_candidates_are_measured(bg, private_store, monkeypatch):
    """The first candidate measured (eager: its gate compiles nothing) is handed to the callers before the rest are
    measured; the next candidate gets the pruning bar from it and is timed before its gate, which runs because it
    would be chosen; the last landing switches to it."""
    _only(monkeypatch, "softmax", "eager", "compile")
    from tiered_ops.measure.measure import PRUNE_FACTOR

    release, asked = threading.Event(), []
    monkeypatch.setattr(background, "_pool_for", lambda me, job: _FakePool(asked, {"eager": (10.0, 12.0),
                                                                              "compile": (4.0, 5.0)}, release))
    x = torch.randn(4, 64)
    tiered_ops.softmax(x, -1)
    deadline = time.monotonic() + 60
    while len(asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(k, n) for k, n, _ in asked] == [("measure", "eager"), ("measure", "compile")], asked
    assert asked[1][2] == dict(prune_above_us=PRUNE_FACTOR * 12.0, best="eager", gate_first=False, gated=False), asked
    tiered_ops.softmax(x, -1)  # eager landed: this call decides from its row, the bucket still being measured
    sel = _eager_selection("softmax")
    assert sel.name == "eager" and sel.record["tuning"] == "queued for background tuning", sel.record
    assert "fastest correct" in sel.record["reason"] and background.pending() == 1, sel.record
    release.set()
    assert tiered_ops.wait_for_tuning(timeout=60)
    assert [(k, n) for k, n, _ in asked][2:] == [("gate", "compile")], asked
    tiered_ops.softmax(x, -1)
    sel = _eager_selection("softmax")
    assert sel.name == "compile" and "tuning" not in sel.record, sel.record
    stored = {r["impl"]: r for r in Store(private_store).rows(op="softmax")}
    assert stored["compile"]["ok"] == 1 and not ungated(stored["compile"]), stored["compile"]


class _FakePool:
    """The worker's replies, made up: each candidate's p20-p80 in us from ``times``; ``gated=False`` rows come back
    not ok and not gated (as ``measure`` writes them), and a gate passes but for the names in ``wrong``; a compile
    candidate waits for ``release``."""

    def __init__(self, asked: list, times: dict, release: threading.Event | None = None, wrong: tuple = ()):
        self.asked, self.times, self.release, self.wrong = asked, times, release, wrong

    def start(self):
        return None  # running already

    def run(self, task, what):
        from tiered_ops.measure.fingerprint import fingerprint
        from tiered_ops.measure.measure import base_row
        from tiered_ops.store.rows import UNGATED

        kind, op, name, problem, dname, mode, extra, *_ = task
        self.asked.append((kind, name, extra if kind == "measure" else None))
        if kind == "gate":
            if name in self.wrong:
                return dict(extra, ok=0, rel_error=0.5, reason=f"wrong output at {problem} seed 1"), None
            return dict(extra, ok=1, rel_error=0.0, reason=None), None
        if name == "compile" and self.release is not None:
            assert self.release.wait(60)
        spec, (lo, hi) = get_op(op), self.times[name]
        row = base_row(spec, spec.impls[name], problem, torch.float32, mode, fingerprint(CPU))
        gated = extra.get("gated", True)
        return dict(row, ok=int(gated), p20_us=lo, p50_us=(lo + hi) / 2, p80_us=hi, host_us=lo, host_p20_us=lo,
                    host_p80_us=hi, caller_us=(lo + hi) / 2, first_call_s=0.01, rel_error=0.0 if gated else None,
                    reason=None if gated else f"{UNGATED}timed; its gate runs only where it would be chosen"), None


def test_only_the_candidate_that_would_be_chosen_is_gated(bg, private_store, monkeypatch):
    """Triton and compile timed before their gates: the faster one's gate runs; the slower one is stored as never
    chosen without its gate. Where the faster one fails its gate, the next in line is gated and chosen."""
    _only(monkeypatch, "softmax", "eager", "triton", "compile")
    times = {"eager": (10.0, 12.0), "triton": (4.0, 5.0), "compile": (6.0, 7.0)}
    for rows_n, wrong, chosen, gates in ((2, (), "triton", ["triton"]),
                                         (200, ("triton",), "compile", ["triton", "compile"])):
        asked: list = []
        monkeypatch.setattr(background, "_pool_for", lambda me, job: _FakePool(asked, times, wrong=wrong))
        x = torch.randn(rows_n, 64)  # a bucket of its own per case
        tiered_ops.softmax(x, -1)
        assert tiered_ops.wait_for_tuning(timeout=60)
        assert [n for k, n, _ in asked if k == "gate"] == gates, asked
        assert all(e["gated"] is False for k, n, e in asked if k == "measure" and n != "eager"), asked
        stored = {r["impl"]: r for r in Store(private_store).rows(op="softmax")  # the newest row of each
                  if r["problem"].startswith(f"{rows_n}x")}
        assert stored[chosen]["ok"] == 1, stored[chosen]
        for name in {"triton", "compile"} - {chosen}:
            r = stored[name]
            assert r["ok"] == 0, r
            if name in wrong:
                assert r["reason"].startswith("wrong output"), r
            else:
                assert ungated(r) and f"{chosen}, correct, is chosen over it" in r["reason"], r
        assert select.select_backend("softmax", tuple(x.shape), tune=False).name == chosen


def test_the_hottest_queued_bucket_is_measured_first_and_a_nearest_bucket_predicts(bg, private_store, monkeypatch,
                                                                                  caplog):
    _only(monkeypatch, "softmax", "eager", "triton")
    caplog.set_level(logging.INFO, logger="tiered_ops")
    with background._s.cond:  # the thread takes nothing before all three are queued
        for n, times in ((64, 1), (256, 3), (1024, 5)):
            for _ in range(times):
                tiered_ops.softmax(torch.randn(4, n), -1)
        assert [j.calls for j in background._s.queue.values()] == [1, 3, 5]
    assert tiered_ops.wait_for_tuning(timeout=300)
    said = [r.getMessage() for r in caplog.records]
    landed = [m.split(" landed")[0].split("of ")[-1] for m in said if "landed in" in m]
    assert [s.split(",")[0] for s in landed] == ["softmax 4x1024", "softmax 4x256", "softmax 4x64"], landed
    # a new bucket now runs the nearest measured bucket's choice (of its dtype) while its own is measured
    tiered_ops.softmax(torch.randn(8, 1024), -1)
    sel = _eager_selection("softmax")
    assert sel.record["tuning"] == "queued for background tuning"
    assert "nearest measured bucket" in sel.record["reason"] and sel.record["bucket"] == "[8,1024,true]", sel.record


def test_a_killed_worker_leaves_calls_working_and_the_bucket_is_retried(bg, private_store, monkeypatch, caplog):
    _only(monkeypatch, "plant_double", "eager", "py_hang")  # py_hang never returns: killed, then timed out
    monkeypatch.setattr(background, "TIMEOUT_S", 8.0)
    caplog.set_level(logging.INFO, logger="tiered_ops")
    double = public("plant_double")
    x = torch.randn(1000)
    assert torch.equal(double(x), x * 2)
    store = Store(private_store)
    deadline = time.monotonic() + 120
    while not store.rows(op="plant_double", impl="eager") and time.monotonic() < deadline:
        time.sleep(0.1)  # eager is stored: py_hang is being measured now
    runner = background._s.runner
    pid = runner.pool.worker.proc.pid
    os.killpg(pid, signal.SIGKILL)
    for _ in range(50):  # calls go on through the prediction (eager)
        x = torch.randn(1000)
        assert torch.equal(double(x), x * 2)
    assert tiered_ops.wait_for_tuning(timeout=120)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "py_hang worker killed by signal SIGKILL (try 1 of 2); the bucket is queued again" in said, said
    rows = {r["impl"]: r for r in store.rows(op="plant_double")}
    assert rows["eager"]["ok"] == 1 and len(store.rows(op="plant_double", impl="eager")) == 1, "eager measured again"
    assert rows["py_hang"]["ok"] == 0 and "crashed or hung: timed out after 8 s" in rows["py_hang"]["reason"]
    double(x)
    sel = _eager_selection("plant_double")
    assert "tuning" not in sel.record and sel.name == "eager", sel.record
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_trace_queues_its_bucket_once_and_a_capture_queues_nothing(bg, monkeypatch):
    _only(monkeypatch, "softmax", "eager", "triton")
    asked = []
    request = background.request
    monkeypatch.setattr(background, "request", lambda *a: asked.append(a[6]) or request(*a))
    monkeypatch.setattr(background, "_start_runner", lambda: None)  # queued, not measured
    x = torch.randn(4, 64)
    f = torch.compile(lambda t: tiered_ops.softmax(t, -1), backend="eager", fullgraph=True)
    torch.testing.assert_close(f(x), torch.softmax(x, -1))
    torch.testing.assert_close(f(x), torch.softmax(x, -1))
    assert background.pending() == 1 and [k[:3] + k[4:] for k in asked] == [
        ("softmax", "[4,64,true]", "fp32", "fwd_nograd")], "the trace's miss queues its bucket, at trace time only"
    assert not any(k[0] == "softmax" and k[-1] == "compiled" for k in table.current()), "a miss caches nothing"
    background.shutdown()
    monkeypatch.undo()
    _only(monkeypatch, "softmax", "eager", "triton")
    # a CUDA-graph capture's call (the key's context 2): decided by capture_selection, never queued
    spec = get_op("softmax")
    y = dispatch(spec, ("softmax", 2), x, (x, -1), {})
    torch.testing.assert_close(y, torch.softmax(x, -1))
    assert background.pending() == 0 and background._s.runner is None, "queued from a capture"
    key = ("softmax", "4x64,dim=-1", "fp32", "cpu", "fwd_nograd")
    args = (spec, spec.problem((4, 64)), torch.float32, CPU, "fwd_nograd", "eager", key, ["eager"],
            select.get_store(), lambda j: None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert background.request(*args) == (None, "not queued: inside a torch.compile trace")
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert background.request(*args[:3], torch.device("cuda", 0), *args[4:]) == (
        None, "not queued: inside a CUDA-graph capture")
    assert background.pending() == 0 and background._s.runner is None


def test_a_store_kept_in_memory_gets_the_rows_on_the_next_decision(bg, monkeypatch):
    _only(monkeypatch, "softmax", "eager")
    store = select.use_store(":memory:")
    x = torch.randn(4, 64)
    tiered_ops.softmax(x, -1)
    assert _eager_selection("softmax").record["tuning"] == "queued for background tuning"
    assert tiered_ops.wait_for_tuning(timeout=120)
    assert not store.rows(op="softmax")  # the thread cannot write this connection: the caller's next decision does
    tiered_ops.softmax(x, -1)
    assert [r["impl"] for r in store.rows(op="softmax")] == ["eager"]
    assert "tuning" not in _eager_selection("softmax").record


def test_set_tuning_takes_the_modes_and_refuses_others(monkeypatch):
    for value, mode in ((True, "blocking"), (False, "off"), ("background", "background"), ("off", "off")):
        select.set_tuning(value)
        assert select.tuning_mode() == mode
    select.set_tuning(None)
    for env, mode in (("0", "off"), ("1", "blocking"), ("background", "background"), ("Background", "background")):
        monkeypatch.setenv("TIERED_OPS_TUNE", env)
        assert select.tuning_mode() == mode
    with pytest.raises(ValueError, match="set_tuning: expected True, False, None or one of off, blocking, background"):
        select.set_tuning("sometimes")


@pytest.mark.parametrize("helpers", ["0", "1"])
def test_an_exiting_process_keeps_what_was_stored_and_leaves_no_worker(tmp_path, helpers):
    """With a gate helper beside the worker too: neither outlives the script."""
    db = tmp_path / "exit.sqlite"
    script = textwrap.dedent("""
        import time, torch, tiered_ops
        from tiered_ops.decide import background
        from tiered_ops.tiers.catalog import get_op
        from tiered_ops.store.store import Store
        spec = get_op("softmax")
        spec.impls = {k: v for k, v in spec.impls.items() if k in ("eager", "triton")}
        for n in (64, 256, 1024):
            tiered_ops.softmax(torch.randn(4, n), -1)
        deadline = time.monotonic() + 120
        while background.pending() > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        h = background._s.runner.helpers
        print("worker", background._s.runner.pool.info["pid"], "pending", background.pending(), "helpers",
              0 if h is None else sum(p.worker is not None or p._spawned is not None for p in h.pools), flush=True)
    """)
    tag = f"bg-exit-{os.getpid()}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TIERED_OPS_TUNE="background", TIERED_OPS_DB=str(db),
                                TIERED_OPS_TEST_TAG=tag, TIERED_OPS_GATE_HELPERS=helpers))
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    pid, left = int(words[words.index("worker") + 1]), int(words[words.index("pending") + 1])
    assert left >= 1, r.stdout  # exited with a bucket queued or being measured
    assert words[words.index("helpers") + 1] == helpers, r.stdout  # the helper processes it had
    assert time.monotonic() - t0 < 120
    rows = Store(db).rows(op="softmax")
    assert {(r["bucket"], r["impl"]) for r in rows} >= {("[4,64,true]", "eager"), ("[4,64,true]", "triton")}, rows
    assert len(rows) < 6, "the exit waited for every queued bucket"
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    for d in Path("/proc").iterdir():  # no worker that inherited the tag is alive
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes()
            except OSError:
                continue
            assert f"TIERED_OPS_TEST_TAG={tag}".encode() not in env, f"process {d.name} outlived the script"


def test_a_first_call_imports_neither_triton_nor_dynamo(tmp_path):
    """What a process's first call pays beyond eager's: nothing of Triton's or dynamo's import (0.4 s and more; the
    fingerprint reads Triton's version from its file). The worker measures Triton later, in its own process."""
    script = textwrap.dedent("""
        import sys, torch, tiered_ops
        from tiered_ops.environment import triton_version
        x, t = torch.randn(16, 300), torch.randint(0, 300, (16,))
        before = set(sys.modules)
        tiered_ops.cross_entropy(x, t)
        print("new", sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("triton", "torch")))
        import triton
        print("versions", triton_version(), triton.__version__)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TIERED_OPS_TUNE="background", TIERED_OPS_DB=str(tmp_path / "s.sqlite")))
    assert r.returncode == 0, r.stderr[-3000:]
    new = next(ln for ln in r.stdout.splitlines() if ln.startswith("new"))
    assert "triton" not in new and "torch._dynamo" not in new, new
    versions = next(ln for ln in r.stdout.splitlines() if ln.startswith("versions")).split()
    assert versions[1] == versions[2], versions


@pytest.mark.gpu
def test_background_tuning_on_the_gpu_lands_under_the_callers_fingerprint(bg, private_store):
    """The worker sees the caller's GPU as cuda:0 (CUDA_VISIBLE_DEVICES): its rows must carry the fingerprint the
    caller decides by, or the bucket would be queued again forever."""
    x = torch.randn(4, 64, device="cuda")
    torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x, -1))
    assert _eager_selection("softmax").record["tuning"] == "queued for background tuning"
    assert tiered_ops.wait_for_tuning(timeout=540)
    tiered_ops.softmax(x, -1)
    sel = _eager_selection("softmax")
    assert "tuning" not in sel.record, sel.record
    assert background.pending() == 0, "the landed bucket was queued again"
    assert {r["device_key"] for r in Store(private_store).rows(op="softmax")} == {sel.record["device"]}


def test_warm_tuning_starts_the_worker_before_any_bucket_and_keeps_it(bg, private_store, monkeypatch, caplog):
    _only(monkeypatch, "plant_double", "eager")
    monkeypatch.setattr(background, "IDLE_S", 0.2)  # an idle spell, which would close a worker not kept warm
    caplog.set_level(logging.INFO, logger="tiered_ops")
    took = tiered_ops.warm_tuning(CPU, wait=True, timeout=120)
    assert took is not None and took > 0
    pool = background._s.runner.pool
    parts = pool.info["start_parts"]
    assert {"interpreter and package import", "fingerprint", "copy probe", "compiler warm-up"} <= set(parts), parts
    assert all(v >= 0 for v in parts.values()) and abs(sum(parts.values()) - took) < 0.05, (parts, took)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "started in" in said and "before any bucket was queued" in said and "compiler warm-up" in said, said
    pid = pool.worker.proc.pid
    time.sleep(1.0)  # several idle spells
    assert background._s.runner.pool is pool and pool.worker is not None and pool.worker.proc.pid == pid
    assert tiered_ops.warm_tuning(CPU, wait=True, timeout=5) == took  # asked again: the same worker
    caplog.clear()
    public("plant_double")(torch.randn(300))
    assert tiered_ops.wait_for_tuning(timeout=120)
    assert pool.worker.proc.pid == pid, "the bucket started a worker of its own"
    starts = [r for r in caplog.records if getattr(r, background.CANDIDATE, {}).get("impl") == background.WORKER_START]
    assert not starts, "the bucket waited for a worker start"
    assert Store(private_store).rows(op="plant_double", impl="eager")
    background.shutdown()
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)


def test_warm_tuning_names_why_its_worker_did_not_start(bg, monkeypatch):
    def broken(self):
        raise RuntimeError("a measurement worker for cpu could not start: planted")

    monkeypatch.setattr(background.Pool, "_ready", broken)
    with pytest.raises(RuntimeError, match="warm_tuning: the measurement worker for cpu could not start: .*planted"):
        tiered_ops.warm_tuning("cpu", wait=True, timeout=60)


def test_the_worker_times_a_candidate_before_its_gate_and_gates_it_on_asking():
    """``measure(gated=False)`` in the worker: timed, not ok, "not gated: ..."; the worker's gate task then passes
    the same row (its figures kept) as ok with its error, as the gate of a measurement would."""
    from tiered_ops.measure.worker import Pool

    spec = get_op("softmax")
    problem = spec.problem((8, 64), dim=-1)
    with Pool(CPU, [spec.reference.__module__], timeout_s=120, log=lambda s: None) as pool:
        row, why = pool.run(("measure", "softmax", "eager", problem, "fp32", "fwd_nograd", {"gated": False}), "m")
        assert why is None and row["ok"] == 0 and ungated(row), row
        assert row["caller_us"] > 0 and row.get("rel_error") is None, row
        done, why = pool.run(("gate", "softmax", "eager", problem, "fp32", "fwd_nograd", row), "gate")
    assert why is None and done["ok"] == 1 and not ungated(done) and done["rel_error"] < 1e-5, done
    assert done["caller_us"] == row["caller_us"] and done["p50_us"] == row["p50_us"], done


def test_a_sweep_takes_a_never_chosen_row_and_measures_a_waiting_one_again(private_store):
    """A row timed without its gate that a choice passed over (never chosen) is the sweep's evidence as it is; one no
    choice has looked at yet (a run stopped between timing and gate) is measured again."""
    from tiered_ops.measure.fingerprint import fingerprint
    from tiered_ops.measure.measure import base_row
    from tiered_ops.store.rows import UNGATED, WAITING
    from tiered_ops.sweep.bench import _fresh

    spec, store = get_op("softmax"), Store(private_store)
    problem, fp = spec.problem((4, 64), dim=-1), fingerprint(CPU)
    timed = dict(p20_us=4.0, p50_us=4.5, p80_us=5.0, host_us=4.0, caller_us=4.5)

    def row(name: str, **kw) -> dict:
        return dict(base_row(spec, spec.impls[name], problem, torch.float32, "fwd_nograd", fp), **timed, **kw)

    store.add([row("compile", ok=0, reason=f"{UNGATED}timed; eager, correct, is chosen over it: its gate never ran "
                                          "(never chosen)"),
               row("triton", ok=0, reason=WAITING), row("eager", ok=1)])
    assert set(_fresh(store, spec, problem, torch.float32, fp.key, "fwd_nograd")) == {"eager", "compile"}
    assert set(_fresh(store, spec, problem, torch.float32, fp.key, "fwd_nograd", waiting=True)) == {
        "eager", "compile", "triton"}
    store.add([row("triton", ok=1)])
    assert set(_fresh(store, spec, problem, torch.float32, fp.key, "fwd_nograd")) == {"eager", "compile", "triton"}
