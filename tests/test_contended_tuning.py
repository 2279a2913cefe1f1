"""Decisions made under load are as good as decisions made alone: a decision from rows timed on a busy machine is
provisional and timed again after a back-off, and processes sharing a store claim a bucket before measuring it (one
measures, the others read its rows), a claim of a killed process blocking nobody past its lease."""

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
import torch

from tiered_ops.cli.cli import main
from tiered_ops.decide import choice as provisional  # the provisional decisions' rules live in choice
from tiered_ops.decide import claimed, decide
from tiered_ops.measure import measure as measure_mod
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.store.rows import contended
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
SOFTMAX = get_op("softmax")


def slow_softmax():
    """softmax with eager and ``again``, a correct implementation ten times eager's work."""
    import torch

    from tiered_ops.registry import Impl, Tier
    from tiered_ops.tiers.catalog import get_op

    def again(x, dim=-1):
        for _ in range(9):
            torch.softmax(x, dim)
        return torch.softmax(x, dim)

    softmax = get_op("softmax")
    softmax.impls = {"eager": softmax.impls["eager"], "again": Impl("again", Tier.COMPILE, again, (softmax.source,))}


def fixed_measure(store, spec, impl, problem, dtype, device, mode="fwd_nograd", **kw):
    """A stand-in for ``measure_kept`` with a quiet machine's figures, eager 10 x faster than ``again`` (the claiming
    and deciding are under test, not the timing: on a 2-core machine shared with other work a real timing can read
    anything), after the pause a measurement takes."""
    import time

    from tiered_ops.measure.fingerprint import fingerprint
    from tiered_ops.measure.measure import base_row

    time.sleep(0.2)
    us = {"eager": 5.0, "again": 50.0}[impl.name]
    return dict(base_row(spec, impl, problem, dtype, mode, fingerprint(device)), ok=1, p20_us=0.95 * us, p50_us=us,
                p80_us=1.05 * us, host_us=us, caller_us=us, rel_error=1e-7)


def busy(measure):
    """``measure`` (as ``measure_kept``) on a machine the other processes keep busy: every timing flagged contended."""
    from tiered_ops.measure.measure import flag_contended

    def busy_measure(*a, **k):
        row = measure(*a, **k)
        return flag_contended(row, "the timing thread waited for a CPU 60% of the time (limit 30%)") if row["ok"] \
            else row

    return busy_measure


@pytest.fixture
def softmax2(monkeypatch):
    monkeypatch.setattr(SOFTMAX, "impls", dict(SOFTMAX.impls))
    slow_softmax()
    monkeypatch.setattr(decide, "measure_kept", fixed_measure)
    decide.set_tuning(True)
    yield
    provisional.cancel_all()
    decide.set_tuning(None)


def _key(shape):
    return ("softmax", measure_mod.bucket_str(SOFTMAX.bucket(SOFTMAX.problem(shape))), "fp32", fingerprint(CPU).key,
            "fwd_nograd")


def _rows(store, shape):
    op, bucket, dtype, dev, mode = _key(shape)
    return store.rows(op=op, bucket=bucket, dtype=dtype, device_key=dev, mode=mode)


def test_a_busy_pass_decides_provisionally_says_so_and_is_timed_again_after_its_back_off(softmax2, monkeypatch,
                                                                                         caplog):
    monkeypatch.setenv("TIERED_OPS_RETIME_S", "2")
    monkeypatch.setattr(decide, "measure_kept", busy(fixed_measure))
    with caplog.at_level(logging.WARNING, logger="tiered_ops.decide.provisional"):
        sel = decide.select_backend("softmax", (8, 64))
    # every row contended: no decision by their absence, eager on record as provisional
    why = sel.record["provisional"]
    assert sel.name == "eager" and why.startswith("provisional: the timings of 2 of 2"), sel.record
    assert "no correct timed implementation" in sel.record["reason"]
    assert any("decision provisional" in m and "timed again in" in m for m in caplog.messages), caplog.messages
    store = decide.get_store()
    assert all(contended(r) for r in _rows(store, (8, 64))) and len(_rows(store, (8, 64))) == 2
    at = provisional.retime_at(store, SOFTMAX, _key((8, 64)), store.latest(*_key((8, 64))))
    if time.time() < at - 0.5:  # before the back-off: the cached provisional decision
        assert decide.select_backend("softmax", (8, 64)) is sel
    monkeypatch.setattr(decide, "measure_kept", fixed_measure)  # the machine is quiet now
    time.sleep(max(0.0, at - time.time()) + 0.3)  # the timer dropped the cached decision: the next call re-times it
    again = decide.select_backend("softmax", (8, 64))
    assert again.name == "eager" and "provisional" not in again.record, again.record
    assert Counter(r["impl"] for r in _rows(store, (8, 64))) == {"eager": 2, "again": 2}
    assert provisional.note(SOFTMAX, store.latest(*_key((8, 64)))) is None


def test_the_fastest_candidate_timed_busy_never_loses_by_its_absence(softmax2, monkeypatch):
    """The issue's 8x128: eager's rows contended, the slower tier's clean, so the choice among clean rows is the
    slower one: provisional, and eager again once timed quietly."""
    monkeypatch.setenv("TIERED_OPS_RETIME_S", "3600")

    def eager_busy(store, spec, impl, *a, **k):
        row = fixed_measure(store, spec, impl, *a, **k)
        return busy(lambda *_a, **_k: row)() if impl.name == "eager" else row

    monkeypatch.setattr(decide, "measure_kept", eager_busy)
    sel = decide.select_backend("softmax", (8, 128))
    assert sel.name == "again" and "provisional: the timings of 1 of 2" in sel.record["provisional"], sel.record
    assert "chosen among the clean one(s) (again)" in sel.record["provisional"]
    # not due yet: a later process takes the provisional decision as it is, measuring nothing
    decide.clear_cache()
    monkeypatch.setattr(decide, "measure_kept", lambda *a, **k: pytest.fail("re-timed before its back-off"))
    assert decide.select_backend("softmax", (8, 128)).record["provisional"]
    # due: every correct candidate timed again in one pass
    monkeypatch.setenv("TIERED_OPS_RETIME_S", "0")
    monkeypatch.setattr(decide, "measure_kept", fixed_measure)
    decide.clear_cache()
    final = decide.select_backend("softmax", (8, 128))
    assert final.name == "eager" and "provisional" not in final.record, final.record


def test_the_back_off_doubles_with_each_busy_pass_in_a_row(softmax2, monkeypatch):
    monkeypatch.setenv("TIERED_OPS_RETIME_S", "10")
    monkeypatch.setenv("TIERED_OPS_CLAIM_WAIT_S", "0")
    monkeypatch.setattr(decide, "measure_kept", busy(fixed_measure))
    store, key = decide.get_store(), _key((8, 64))
    decide.select_backend("softmax", (8, 64))
    rows = store.latest(*key)
    newest = max(r["timestamp"] for r in rows)
    assert provisional.busy_streak(store, SOFTMAX, key) == 1
    assert provisional.retime_at(store, SOFTMAX, key, rows) == pytest.approx(newest + 10)
    todo, again = provisional.to_measure(store, SOFTMAX, key, rows, now=newest + 11)
    assert again and sorted(i.name for i in todo) == ["again", "eager"]
    store.add([dict(r, timestamp=time.time()) for r in rows])  # a second busy pass
    rows = store.latest(*key)
    assert provisional.busy_streak(store, SOFTMAX, key) == 2
    assert provisional.retime_at(store, SOFTMAX, key, rows) == pytest.approx(max(r["timestamp"] for r in rows) + 20)


def test_a_claim_held_elsewhere_is_waited_for_a_bounded_time_then_taken_at_the_end_of_its_lease(softmax2, monkeypatch):
    store, key = decide.get_store(), _key((8, 64))
    other = Store(store.path)
    other.owner = ("another-host", os.getpid(), "a-rank-elsewhere")  # its liveness cannot be checked: its lease
    assert other.claim(claimed.bucket_key(SOFTMAX, key), ttl_s=1.5)
    monkeypatch.setenv("TIERED_OPS_CLAIM_WAIT_S", "0.3")
    t0 = time.perf_counter()
    sel = decide.select_backend("softmax", (8, 64))
    assert time.perf_counter() - t0 < 1.2 and not _rows(store, (8, 64))  # waited, measured nothing
    assert "another process sharing the store is measuring it" in sel.record["provisional"], sel.record
    monkeypatch.setenv("TIERED_OPS_CLAIM_WAIT_S", "30")
    decide.clear_cache()
    t0 = time.perf_counter()
    sel = decide.select_backend("softmax", (8, 64))
    assert time.perf_counter() - t0 < 10 and "provisional" not in sel.record  # taken once the lease ran out
    assert Counter(r["impl"] for r in _rows(store, (8, 64))) == {"eager": 1, "again": 1}
    other.close()


def test_decisions_list_marks_the_provisional_ones(softmax2, monkeypatch, capsys, private_store):
    monkeypatch.setenv("TIERED_OPS_RETIME_S", "3600")
    decide.select_backend("softmax", (8, 64))
    monkeypatch.setattr(decide, "measure_kept", busy(fixed_measure))
    decide.select_backend("softmax", (8, 192))
    decide.get_store().close()
    decide.use_store(None)
    assert main(["decisions", "list", "--db", str(private_store)]) == 0
    out = capsys.readouterr().out
    assert "2 decision(s), 1 provisional" in out, out
    line = [x for x in out.splitlines() if "[8,192" in x]
    assert line and "eager (nothing correct timed clean) - provisional: the timings of 2 of 2" in line[0], out
    assert main(["decisions", "list", "--provisional", "--db", str(private_store)]) == 0
    out = capsys.readouterr().out
    assert "[8,64" not in out and "[8,192" in out, out



def test_in_background_tuning_a_due_busy_bucket_is_queued_with_every_timed_candidate(softmax2, monkeypatch):
    monkeypatch.setenv("TIERED_OPS_RETIME_S", "3600")
    monkeypatch.setattr(decide, "measure_kept", busy(fixed_measure))
    decide.select_backend("softmax", (8, 64))  # a busy pass, blocking
    queued = []

    def request(spec, problem, dtype, device, mode, context, key, impls, store, hook):
        queued.append((key, impls))
        return None, "not queued: the test's"

    monkeypatch.setattr(decide.background, "request", request)
    decide.set_tuning("background")
    sel = decide.select_backend("softmax", (8, 64))
    assert not queued and sel.record["provisional"], sel.record  # its back-off has not passed: nothing queued
    monkeypatch.setenv("TIERED_OPS_RETIME_S", "0")
    decide.clear_cache()
    sel = decide.select_backend("softmax", (8, 64))
    assert queued == [(_key((8, 64)), ["eager", "again"])] and sel.record["provisional"], (queued, sel.record)

# --- processes sharing one store -----------------------------------------------------------------------------------

SHAPES = [(8, 64), (8, 128), (8, 160), (8, 192)]
SCRIPT = "".join(map(inspect.getsource, (slow_softmax, fixed_measure, busy))) + textwrap.dedent("""
    import json, pathlib, sys, time
    import torch
    import tiered_ops
    from tiered_ops.decide import decide
    slow_softmax()
    how, shapes, ready = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    decide.measure_kept = busy(fixed_measure) if how == "busy" else fixed_measure
    if how == "killed":
        measuring = pathlib.Path(ready[0])

        def stuck(*a, **k):
            measuring.touch()
            time.sleep(600)
        decide.measure_kept = stuck
        ready = []
    if ready:  # start together: the same buckets missed at once
        pathlib.Path(ready[0]).touch()
        while not all(pathlib.Path(p).exists() for p in ready[1:]):
            time.sleep(0.01)
    out = {}
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(*shape)
            torch.testing.assert_close(tiered_ops.softmax(x), torch.softmax(x.double(), -1).float())
            r = decide.select_backend("softmax", tuple(shape)).record
            out[r["bucket"]] = [r["chosen"], r.get("provisional")]
    print("DECISIONS " + json.dumps(out))
""")


def _env(target, **extra):
    env = dict(os.environ, TIERED_OPS_DB=str(target), TIERED_OPS_CONTENTION_CHECK="0", TIERED_OPS_CLAIM_WAIT_S="120",
               TIERED_OPS_CLAIM_LEASE_S="600", TIERED_OPS_RETIME_S="3600")
    return env | extra


def _start(target, how, shapes, ready=(), **extra):
    return subprocess.Popen([sys.executable, "-c", SCRIPT, how, json.dumps(shapes), *map(str, ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(target, **extra))


def _decisions(procs):
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.split("DECISIONS ", 1)[1]))
    return out


def _ranks(tmp_path, target, how, n=4, **extra):
    """``n`` processes started together on one store, each on two shapes of SHAPES, every shape missed by two
    processes at once: 8x64 and 8x128 first, then 8x160 and 8x192."""
    ready = [tmp_path / f"{how}{i}.ready" for i in range(n)]
    procs = [_start(target, how, [SHAPES[i % 2], SHAPES[2 + (i // 2) % 2]], [ready[i]] + ready[:i] + ready[i + 1:],
                    **extra) for i in range(n)]
    return _decisions(procs)


def _quiet_reference():
    """The decisions one quiet process makes alone (this one, on its private store)."""
    ref = {}
    for shape in SHAPES:
        r = decide.select_backend("softmax", shape).record
        assert "provisional" not in r, r
        ref[r["bucket"]] = r["chosen"]
    return ref


def _counts(target):
    store = Store(target)
    try:
        return Counter((r["bucket"], r["impl"]) for r in store.rows(op="softmax"))
    finally:
        store.close()


def test_ranks_on_one_store_reach_the_quiet_decisions_measuring_each_bucket_once(softmax2, tmp_path, store_target):
    """Four processes on two cores miss overlapping buckets at once, a fifth killed while it measured holds a claim:
    each bucket is measured once (by whichever process claimed it), nobody waits for the dead one's lease, and every
    decision is the one a quiet process makes alone."""
    ref = _quiet_reference()
    Store(store_target).close()
    killed = _start(store_target, "killed", [SHAPES[1]], [tmp_path / "killed.measuring"])
    deadline = time.time() + 120
    while not (tmp_path / "killed.measuring").exists():
        assert time.time() < deadline and killed.poll() is None, killed.stderr.read() if killed.poll() else "slow"
        time.sleep(0.05)
    os.kill(killed.pid, signal.SIGKILL)  # mid-measurement: its bucket's claim and the measuring slot stay behind
    killed.wait()
    t0 = time.perf_counter()
    got = _ranks(tmp_path, store_target, "quiet")
    assert time.perf_counter() - t0 < 120  # not blocked until the dead process's 600 s lease ran out
    for decisions in got:
        for bucket, (chosen, why) in decisions.items():
            assert (chosen, why) == (ref[bucket], None), (bucket, decisions, ref)
    counts = _counts(store_target)
    assert set(counts) == {(b, i) for b in ref for i in ("eager", "again")} and set(counts.values()) == {1}, counts


def test_ranks_timed_on_a_busy_machine_decide_provisionally_and_one_quiet_re_time_makes_them_final(softmax2, tmp_path,
                                                                                                   store_target):
    ref = _quiet_reference()
    Store(store_target).close()
    got = _ranks(tmp_path, store_target, "busy")
    for decisions in got:
        whys = [why for _, why in decisions.values()]
        assert all(why and why.startswith("provisional: the timings of 2 of 2") for why in whys), decisions
    counts = _counts(store_target)
    assert set(counts.values()) == {1} and len(counts) == 2 * len(SHAPES), counts  # the busy pass: once each
    [after] = _decisions([_start(store_target, "quiet", SHAPES, TIERED_OPS_RETIME_S="0")])
    assert after == {b: [c, None] for b, c in ref.items()}, (after, ref)
    assert set(_counts(store_target).values()) == {2}


@pytest.mark.gpu
def test_a_gpus_measuring_slot_is_named_by_its_uuid_so_every_index_it_is_seen_under_shares_it():
    key = claimed.slot_key(torch.device("cuda", 0))
    assert key[5] == str(torch.cuda.get_device_properties(0).uuid) and key[5] != "cuda:0", key
    if torch.cuda.device_count() > 1:
        assert claimed.slot_key(torch.device("cuda", 1)) != key
