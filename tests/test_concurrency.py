"""Sweeps sharing one store (a SQLite file, a PostgreSQL database): each candidate is claimed before it is measured,
so none is measured twice; a claim held by a dead or stuck sweep expires and is taken over."""

import inspect
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import pytest
import torch

from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import base_row
from tiered_ops.registry import DTYPE_NAMES
from tiered_ops.store.store import Store
from tiered_ops.sweep import bench
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
MULADD = get_op("muladd")
SIZES = [(64 * 2**i,) for i in range(8)]
MODES = ["fwd_nograd", "fwd+bwd"]
IMPLS = ["eager", "compile"]

def fake_measure(spec, impl, problem, dtype, device, mode="fwd_nograd", **kw):
    """A stand-in for measure: a fixed row after a pause (the claiming is under test, not the timing; a CPU timing
    taken on a busy machine may be flagged as contended and rightly redone)."""
    import time

    from tiered_ops.measure.fingerprint import fingerprint
    from tiered_ops.measure.measure import base_row

    time.sleep(0.1)
    return dict(base_row(spec, impl, problem, dtype, mode, fingerprint(device)), ok=1, p50_us=1.0, caller_us=1.0)


def _key(spec, impl, problem, mode, dtype=torch.float32):
    return (spec.name, impl, str(problem), DTYPE_NAMES[dtype], mode, fingerprint(CPU).key, spec.impls[impl].source_hash)


def _sweep(store, problems, log=lambda s: None):
    return bench.sweep([MULADD], {"muladd": problems}, [torch.float32], CPU, store, progress=False, log=log,
                       modes=MODES, impls=IMPLS, cost_metadata=False)


def _counts(store):
    return Counter((r["impl"], r["problem"], r["mode"]) for r in store.rows())


def busy_measure(spec, impl, problem, dtype, device, mode="fwd_nograd", **kw):
    """fake_measure on a machine two sweeps keep busy: every timing is flagged as contended."""
    from tiered_ops.measure.measure import flag_contended

    return flag_contended(fake_measure(spec, impl, problem, dtype, device, mode), "p80/p20 = 3.0 over 10 blocks")


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "contended"])
def test_two_sweeps_on_one_store_measure_each_candidate_once(tmp_path, store_target, monkeypatch, busy):
    """Under the default settings (the contention check on): also when every timing is flagged as contended, which
    is what two sweeps on one machine do to each other, no candidate is measured twice."""
    monkeypatch.delenv("TIERED_OPS_CONTENTION_CHECK", raising=False)
    path = store_target
    Store(path).close()
    code = inspect.getsource(fake_measure) + inspect.getsource(busy_measure) + textwrap.dedent(f"""
        import pathlib, sys, time
        import torch
        from tiered_ops.sweep import bench
        from tiered_ops.tiers.catalog import get_op
        from tiered_ops.store.store import Store
        bench.measure = {"busy_measure" if busy else "fake_measure"}
        spec = get_op("muladd")
        me, other = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
        me.touch()
        while not other.exists():  # start together: both sweeps want the same first candidate
            time.sleep(0.01)
        df = bench.sweep([spec], {{"muladd": [spec.problem(s) for s in {SIZES!r}]}}, [torch.float32],
                         torch.device("cpu"), Store({str(path)!r}), progress=False, log=print, modes={MODES!r},
                         impls={IMPLS!r}, cost_metadata=False)
        print("rows", len(df), int(df.ok.sum()))
    """)
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(me), str(other)], stdout=subprocess.PIPE, text=True)
             for me, other in (ready, ready[::-1])]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    n = len(SIZES) * len(MODES) * len(IMPLS)
    for out in outs:  # each sweep returns every candidate, measured by itself or by the other
        assert f"rows {n} {n}" in out, out
    counts = _counts(Store(path))
    assert len(counts) == n and set(counts.values()) == {1}, counts
    measured = [int(line.split()[0]) for out in outs for line in out.splitlines() if " measured now, " in line]
    assert sum(measured) == n, outs
    if busy:  # each sweep says what it took from the other as it was, and why
        assert all("the busy machine was likely the two sweeps" in out for out in outs if " 0 taken from" not in out)


def test_a_claim_is_refused_while_its_owner_lives_and_taken_when_it_is_dead_or_expired(store_target):
    path = store_target
    key = _key(MULADD, "eager", MULADD.problem((64,)), "fwd_nograd")
    mine, other = Store(path), Store(path)
    assert other.claim(key, ttl_s=60)
    assert not mine.claim(key, ttl_s=60)  # a live owner (this very process, another store)
    assert other.claim(key, ttl_s=60)  # renewing one's own claim
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other.release(key)
    other.owner = (socket.gethostname(), int(dead.stdout), "a-finished-sweep")
    assert other.claim(key, ttl_s=60)
    assert mine.claim(key, ttl_s=60)  # its owner is a process of this host that no longer exists
    mine.release(key)
    other.owner = ("another-host", os.getpid(), "a-remote-sweep")  # its liveness cannot be checked: its deadline
    assert other.claim(key, ttl_s=60)
    assert not mine.claim(key, ttl_s=60)
    other.release(key)
    assert other.claim(key, ttl_s=-1)  # already past its deadline
    assert mine.claim(key, ttl_s=60)
    other.close()
    mine.close()  # closing releases the store's claims
    assert Store(path).count("claims") == 0


def test_a_sweep_waits_for_a_claimed_candidate_and_measures_it_when_the_claim_expires(store_target, monkeypatch):
    monkeypatch.setattr(bench, "measure", fake_measure)
    path = store_target
    problems = [MULADD.problem((64,))]
    stuck = Store(path)
    stuck.owner = ("another-host", 1, "a-stuck-sweep")  # liveness cannot be checked from here: only its deadline
    key = _key(MULADD, "eager", problems[0], "fwd_nograd")
    assert stuck.claim(key, ttl_s=1.5)
    said = []
    t0 = time.monotonic()
    df = _sweep(Store(path), problems, said.append)
    assert time.monotonic() - t0 >= 1.0  # it waited for the claim
    assert any("claimed by another sweep" in s for s in said), said
    assert len(df) == 4 and set(_counts(Store(path)).values()) == {1}


def test_a_sweep_takes_a_candidate_another_sweep_stored_while_it_waited(store_target, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "measure", lambda *a, **k: calls.append(a[1].name) or fake_measure(*a, **k))
    path = store_target
    problem = MULADD.problem((64,))
    key = _key(MULADD, "compile", problem, "fwd+bwd")
    claimed, failed = threading.Event(), []

    def other_sweep() -> None:  # claims one candidate, measures it for a while, stores it
        try:
            store = Store(path)
            assert store.claim(key, ttl_s=60)
            claimed.set()
            time.sleep(2.0)
            store.add([dict(base_row(MULADD, MULADD.impls["compile"], problem, torch.float32, "fwd+bwd",
                                     fingerprint(CPU)), ok=1, p50_us=2.0, caller_us=2.0)])
            store.release(key)
        except Exception as e:  # pragma: no cover - reported below
            failed.append(e)
            claimed.set()

    t = threading.Thread(target=other_sweep)
    t.start()
    assert claimed.wait(30)
    df = _sweep(Store(path), [problem])
    t.join()
    assert not failed, failed
    assert sorted(calls) == ["compile", "eager", "eager"]  # the claimed one was not measured here
    row = df[(df.impl == "compile") & (df["mode"] == "fwd+bwd")].iloc[0]
    assert row.caller_us == 2.0  # the other sweep's measurement
    assert set(_counts(Store(path)).values()) == {1}


@pytest.mark.parametrize("force", [False, True])
def test_a_sweep_alone_releases_every_claim(store_target, monkeypatch, force):
    monkeypatch.setattr(bench, "measure", fake_measure)
    store = Store(store_target)
    _sweep(store, [MULADD.problem((64,))])
    df = bench.sweep([MULADD], {"muladd": [MULADD.problem((64,))]}, [torch.float32], CPU, store, force=force,
                     progress=False, log=lambda s: None, modes=MODES, impls=IMPLS, cost_metadata=False)
    assert len(df) == 4 and len(store.rows()) == (8 if force else 4)
    assert store.count("claims") == 0


def test_a_bench_into_a_store_that_cannot_be_written_fails_with_one_line(tmp_path, monkeypatch, capsys):
    """It would measure for nothing and exit 0: it exits non-zero at once, saying which store and why."""
    from tiered_ops.cli import cli

    path = tmp_path / "ro.sqlite"
    Store(path).close()
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("measured into a store that cannot keep it"))
    with pytest.raises(ValueError, match="opened read-only on request; a sweep would save none"):
        _sweep(Store(path, read_only=True), [MULADD.problem((64,))])
    monkeypatch.setattr(cli, "_store", lambda args: Store(path, read_only=True))
    rc = cli.main(["bench", "--ops", "muladd", "--shapes", "64", "--dtype", "fp32", "--in-process", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: store: ") and "cannot be written" in err[-1], err
