"""The store's one interface on both backends (a SQLite file, a database of a real PostgreSQL server): rows and the
queries decisions make, cost metadata, schema migrations, writers in several processes, an interrupted sweep that
resumes, rows of another measurement method measured again."""

import subprocess
import sys
import textwrap

import pytest
import torch

from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import base_row
from tiered_ops.method import METHOD_VERSION
from tiered_ops.store.store import COLUMN_NAMES, SCHEMA_VERSION, STORE_ERRORS, Store, StoreError
from tiered_ops.sweep import bench
from tiered_ops.tiers.catalog import get_op

ROW = dict(op="x", impl="a", tier="eager", mode="fwd", problem="1", bucket="[1]", dtype="fp32", device_key="d", ok=1,
           source_hash="h", timestamp=1.0)
CPU = torch.device("cpu")
MULADD = get_op("muladd")


def fake_measure(spec, impl, problem, dtype, device, mode="fwd_nograd", **kw):
    """A stand-in for measure (the store is under test, not the timing)."""
    return dict(base_row(spec, impl, problem, dtype, mode, fingerprint(device)), ok=1, p50_us=1.0, caller_us=1.0)


def _sweep(store, problems):
    return bench.sweep([MULADD], {"muladd": problems}, [torch.float32], CPU, store, progress=False,
                       log=lambda s: None, modes=["fwd_nograd", "fwd+bwd"], impls=["eager", "compile"],
                       cost_metadata=False)


def test_rows_latest_buckets_and_metadata(store_target):
    store = Store(store_target)
    store.add([dict(ROW, p50_us=3.0), dict(ROW, p50_us=0.1 + 0.2, timestamp=2.0),
               dict(ROW, impl="b", bucket="[2]", p50_us=1.5)])
    assert [(r["impl"], r["p50_us"]) for r in store.latest("x", "[1]", "fp32", "d", "fwd")] == [("a", 0.1 + 0.2)]
    assert store.buckets("x", "fp32", "d", "fwd") == ["[1]", "[2]"]
    rows = store.rows(impl="a")
    assert list(rows[0]) == ["id", *COLUMN_NAMES] and [r["p50_us"] for r in rows] == [3.0, 0.1 + 0.2]  # 8-byte floats
    assert {r["method"] for r in store.rows()} == {METHOD_VERSION} and store.count() == 3
    store.put_meta("x", "a", "d", "h", {"loc": 10})
    store.put_meta("x", "a", "d", "h", {"loc": 12})  # replaces
    assert store.get_meta("x", "a", "d", "h") == {"loc": 12} and store.get_meta("x", "b", "d", "h") is None
    assert [(m["impl"], m["meta"]) for m in store.meta_rows()] == [("a", {"loc": 12})]
    with pytest.raises(ValueError, match="no column named colour"):
        store.rows(colour="red")
    # the device's shortest correct kernel, any op: the latency a prediction scales bandwidth-bound buckets from
    store.add([dict(ROW, op="y", p50_us=0.2, ok=0), dict(ROW, op="y", p50_us=0.25),
               dict(ROW, device_key="e", p50_us=0.01)])
    assert store.shortest_kernel("d") == 0.25 and store.shortest_kernel("none") is None


def test_a_passed_edge_gate_is_kept_per_source_dtype_device_and_versions(store_target):
    store = Store(store_target)
    key = ("x", "a", "h", "bf16", "d", 1, "2.11", "3.6")
    assert store.edge_gate(key) is None and store.count("edge_gates") == 0
    store.put_edge_gate(key, 1e-3)
    store.put_edge_gate(key, 2e-3)  # replaces
    assert store.edge_gate(key) == 2e-3 and store.count("edge_gates") == 1
    for i, other in enumerate(("y", "b", "h2", "fp16", "d2", 0, "2.12", "3.7")):  # any part differs: not that gate
        assert store.edge_gate(key[:i] + (other,) + key[i + 1:]) is None, i
    with pytest.raises(ValueError, match="key has 3 values"):
        store.put_edge_gate(key[:3], 0.0)


def test_every_implementations_edge_gate_is_read_in_one_query(store_target):
    store = Store(store_target)
    key = ("x", "a", "h", "bf16", "d", 1, "2.11", "3.6")
    store.put_edge_gate(key, 1e-3)
    store.put_edge_gate(("x", "b", "h2") + key[3:], 2e-3)
    for i, other in ((0, "y"), (3, "fp16"), (4, "d2"), (5, 0), (6, "2.12"), (7, "3.7")):  # another op, dtype...
        store.put_edge_gate(key[:i] + (other,) + key[i + 1:], 5e-3)
    assert store.edge_gates(("x", None, None) + key[3:]) == {("a", "h"): 1e-3, ("b", "h2"): 2e-3}
    assert store.edge_gates(("x", None, None, "fp32") + key[4:]) == {}


def test_an_add_is_all_or_nothing(store_target):
    store = Store(store_target)
    with pytest.raises(STORE_ERRORS):
        store.add([ROW, dict(ROW, op=None)])
    assert store.rows() == []
    store.add([ROW])  # the store still works after the failed transaction
    assert store.count() == 1


def test_merge_adds_each_measurement_once(store_target):
    store = Store(store_target)
    store.add([ROW])
    assert store.merge([ROW, dict(ROW, timestamp=5.0, origin="pack:p.json")]) == 1
    assert store.merge([ROW, dict(ROW, timestamp=5.0, origin="pack:p.json")]) == 0
    assert [(r["timestamp"], r["origin"]) for r in store.rows()] == [(1.0, None), (5.0, "pack:p.json")]


def test_a_store_newer_than_this_code_is_refused(store_target):
    store = Store(store_target)
    store._write(lambda: store._exec("UPDATE meta SET value='999' WHERE key='schema_version'"))
    with pytest.raises(StoreError, match="schema version 999, newer than this tiered_ops"):
        Store(store_target)


def test_a_schema_4_store_is_migrated_its_buckets_typed_and_its_rows_stale(store_target):
    """A store of the previous schema (no method, no origin, buckets as a|b|c) opens migrated: its buckets are the
    typed JSON of the same tuples, and its rows, of no known method, are stale."""
    softmax = get_op("softmax")
    eager = softmax.impls["eager"]
    store = Store(store_target)
    later = ("method", "origin", "context", "peak_bytes")  # the columns of schemas 5 and 6
    for column in later:
        store._write(lambda c=column: store._exec(f"ALTER TABLE measurements DROP COLUMN {c}"))
    store._write(lambda: store._exec("UPDATE meta SET value='4' WHERE key='schema_version'"))
    old = [c for c in COLUMN_NAMES if c not in later]
    row = dict(ROW, op="softmax", impl="eager", source_hash=eager.source_hash)
    for bucket in ("64|300|True", "8|0|False|tanh"):
        store._write(lambda b=bucket: store._exec(
            f"INSERT INTO measurements ({', '.join(old)}) VALUES ({', '.join('?' * len(old))})",
            tuple(dict(row, bucket=b).get(c) for c in old)))
    store.close()
    migrated = Store(store_target)
    assert migrated._version() == SCHEMA_VERSION
    rows = migrated.rows()
    assert [r["bucket"] for r in rows] == ['[64,300,true]', '[8,0,false,"tanh"]']
    assert [(r["method"], r["origin"], r["context"]) for r in rows] == [(None, None, "eager")] * 2
    assert softmax.fresh_impl(rows[0]) is None  # same source, unknown method: stale
    migrated.add([dict(row, bucket=rows[0]["bucket"])])
    assert softmax.fresh_impl(migrated.rows()[-1]) is eager


def test_two_processes_writing_at_once_lose_nothing(store_target):
    code = textwrap.dedent(f"""
        import sys
        from tiered_ops.store.store import Store
        store = Store(sys.argv[2])
        row = {ROW!r}
        for i in range(150):
            store.add([dict(row, problem=sys.argv[1] + str(i))])
    """)
    Store(store_target).close()
    procs = [subprocess.Popen([sys.executable, "-c", code, tag, store_target]) for tag in ("a", "b")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    problems = [r["problem"] for r in Store(store_target).rows()]
    assert len(problems) == 300 and len(set(problems)) == 300


def test_an_interrupted_sweep_keeps_what_it_measured_and_resumes(store_target, monkeypatch):
    calls = []

    def interrupted(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(a[1].name)
        return fake_measure(*a, **k)

    problems = [MULADD.problem((64,))]
    monkeypatch.setattr(bench, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _sweep(Store(store_target), problems)
    store = Store(store_target)
    assert store.count() == 2 and store.count("claims") == 0
    monkeypatch.setattr(bench, "measure", lambda *a, **k: calls.append(a[1].name) or fake_measure(*a, **k))
    df = _sweep(store, problems)
    assert len(df) == 4 and len(calls) == 4  # the two it had not measured, nothing twice
    assert len({(r["impl"], r["mode"]) for r in store.rows()}) == store.count() == 4


def test_rows_of_another_measurement_method_are_measured_again(store_target, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "measure", lambda *a, **k: calls.append(a[1].name) or fake_measure(*a, **k))
    problems = [MULADD.problem((64,))]
    store = Store(store_target)
    older = [dict(fake_measure(MULADD, MULADD.impls[i], problems[0], torch.float32, CPU, m), method=v)
             for i, m, v in [("eager", "fwd_nograd", METHOD_VERSION + 1), ("compile", "fwd_nograd", None),
                             ("eager", "fwd+bwd", METHOD_VERSION), ("compile", "fwd+bwd", METHOD_VERSION)]]
    store.merge(older)
    _sweep(store, problems)
    assert sorted(calls) == ["compile", "eager"]  # the two of another (or no) method, not the current ones
    assert [r["method"] for r in store.rows()[4:]] == [METHOD_VERSION] * 2


def test_the_device_fingerprint_holds_the_host_cpu_model():
    from tiered_ops.measure.fingerprint import host_cpu

    fp = fingerprint(CPU)
    assert fp.host == host_cpu() and fp.key.endswith(f"|host{fp.host}")
    try:
        models = [ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    if models:
        assert fp.host == " ".join(models[0])
