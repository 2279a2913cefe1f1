"""Background tuning (a bucket measured through its worker), the sweep (a case measured in this process) and a miss
inside a compiled caller (its missing implementations measured in this process) keep the edge gate's record through
``EdgeGates``: the store's passes read once per bucket, case or miss, a new pass recorded once (from a row, or from a
gate's edge checks split over helpers), a recorded pass given to the worker or the gate so it is not checked again,
and a candidate failing an edge problem failed and nothing recorded for it."""

from __future__ import annotations

import pytest
import torch

from tiered_ops.decide import bucket, claimed
from tiered_ops.measure import case
from tiered_ops.measure.case import edge_store_key
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import EDGES, base_row, bucket_str
from tiered_ops.registry import DTYPE_NAMES
from tiered_ops.store.rows import UNGATED
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
TIMES = {"eager": (10.0, 12.0), "triton": (4.0, 5.0), "compile": (6.0, 7.0)}  # triton named first, then compile
NEW = {"eager": 2e-6, "compile": 4e-6}  # the worst edge error of a pass checked now; triton fails an edge problem
EDGE_FAIL = "edge case: wrong output at 1x1 seed 1: planted"


@pytest.fixture
def softmax(monkeypatch):
    spec = get_op("softmax")
    monkeypatch.setattr(spec, "impls", {n: spec.impls[n] for n in ("eager", "triton", "compile")})
    return spec


@pytest.fixture
def store_io(monkeypatch):
    """Every store read of an edge gate (one implementation's, or all of them at once) and every pass recorded."""
    io: dict[str, list] = {"edge_gate": [], "edge_gates": [], "put": []}
    read_one, read_all, put = Store.edge_gate, Store.edge_gates, Store.put_edge_gate
    monkeypatch.setattr(Store, "edge_gate", lambda self, key: io["edge_gate"].append(key) or read_one(self, key))
    monkeypatch.setattr(Store, "edge_gates", lambda self, key: io["edge_gates"].append(key) or read_all(self, key))
    monkeypatch.setattr(Store, "put_edge_gate",
                        lambda self, key, e, *a: io["put"].append((key[1], e)) or put(self, key, e, *a))
    return io


def _timed(spec, name, problem, mode, gated, edges):
    """A row as ``measure`` writes it: ``edges`` (a pass known or checked now) carried as ``EDGES``."""
    lo, hi = TIMES[name]
    row = dict(base_row(spec, spec.impls[name], problem, torch.float32, mode, fingerprint(CPU)), ok=int(gated),
               p20_us=lo, p50_us=(lo + hi) / 2, p80_us=hi, host_us=lo, host_p20_us=lo, host_p80_us=hi,
               caller_us=(lo + hi) / 2, first_call_s=0.01, rel_error=0.0 if gated else None,
               reason=None if gated else f"{UNGATED}timed; its gate runs only where it would be chosen")
    return row if edges is None else dict(row, **{EDGES: edges})


def _gated(name, row, edges):
    """A gate's row: a candidate not given a pass checks its edge problems (triton fails one)."""
    if edges is None and name == "triton":
        return dict(row, ok=0, rel_error=1.0, reason=EDGE_FAIL)
    return dict(row, ok=1, rel_error=0.0, reason=None, **{EDGES: edges if edges is not None else NEW[name]})


class _Pool:
    """The measuring worker's replies (``_timed``, ``_gated``); ``given``: the pass each task was handed."""

    def __init__(self, given: list):
        self.given = given

    def start(self):
        return None  # running already

    def run(self, task, what):
        kind, op, name, problem, _dname, mode, extra, *rest = task
        spec = get_op(op)
        if kind == "measure":
            self.given.append(("measure", name, extra.get("edges")))
            gated = extra.get("gated", True)
            return _timed(spec, name, problem, mode, gated, extra.get("edges", NEW[name] if gated else None)), None
        self.given.append(("gate", name, rest[0]))
        return _gated(name, extra, rest[0]), None


class _Runner:
    """Background tuning's runner, as ``bucket.tune`` sees it: one worker, one gate helper beside it."""

    stopping = False

    def __init__(self, pool: _Pool):
        self.pool, self.stores = pool, {}

    def pool_for(self, job):
        return self.pool

    def helpers_for(self, job):
        return [object()]  # one helper up: a gate's edge checks are split (``bucket.split_edges``, faked)

    def requeue(self, job):
        pytest.fail(f"{job} queued again")

    def queued(self):
        return 0


def test_a_background_bucket_reads_the_edge_gates_once_and_records_each_new_pass_once(softmax, private_store,
                                                                                      store_io, monkeypatch):
    monkeypatch.setenv("TIERED_OPS_FIRST_CALLS_ASIDE", "0")
    split: list = []

    def split_edges(main, helpers, task, checks, what):
        split.append(task[2])
        return (None, "a share failed") if task[2] == "triton" else (NEW[task[2]], f"{checks} edge checks in 2")

    monkeypatch.setattr(bucket, "split_edges", split_edges)
    given: list = []
    me, fp = _Runner(_Pool(given)), fingerprint(CPU)
    for rows_n in (4, 256):  # two buckets: the second is given the passes the first recorded
        problem = softmax.problem((rows_n, 64), dim=-1)
        key = ("softmax", bucket_str(softmax.bucket(problem)), DTYPE_NAMES[torch.float32], fp.key, "fwd_nograd")
        job = bucket.Job(key, softmax, problem, torch.float32, CPU, "fwd_nograd", list(softmax.impls),
                         str(private_store), lambda j: None)
        given.clear(), split.clear()
        bucket.tune(me, job)
        assert job.landed and job.chosen == "compile", job
        assert store_io["edge_gate"] == [] and len(store_io["edge_gates"]) == (1 if rows_n == 4 else 2), store_io
        newest = {r["impl"]: r for r in Store(private_store).latest(*key)}
        assert newest["triton"]["ok"] == 0 and newest["triton"]["reason"] == EDGE_FAIL, newest["triton"]
        assert newest["compile"]["ok"] == 1 and all(EDGES not in r for r in newest.values()), newest
        if rows_n == 4:  # eager's pass from its row, compile's from the split checks: each recorded once
            assert given == [("measure", "eager", None), ("measure", "triton", None), ("measure", "compile", None),
                             ("gate", "triton", None), ("gate", "compile", NEW["compile"])], given
            assert split == ["triton", "compile"], split
        else:  # the recorded passes handed on, not checked again; triton, never passed, is checked again
            assert given == [("measure", "eager", NEW["eager"]), ("measure", "triton", None),
                             ("measure", "compile", NEW["compile"]), ("gate", "triton", None),
                             ("gate", "compile", NEW["compile"])], given
            assert split == ["triton"], split
        assert sorted(store_io["put"]) == [("compile", NEW["compile"]), ("eager", NEW["eager"])], store_io["put"]
    store = Store(private_store)
    assert store.count("edge_gates") == 2
    assert store.edge_gate(edge_store_key(softmax, softmax.impls["eager"], torch.float32, fp, "fwd_nograd")) == 2e-6


def test_a_sweep_reads_the_edge_gates_once_per_case_and_records_each_new_pass_once(softmax, private_store, store_io,
                                                                                   monkeypatch):
    from tiered_ops.sweep import bench

    given: list = []

    def measure(spec, impl, problem, dtype, device, mode, **kw):
        given.append(("measure", impl.name, kw.get("edges")))
        gated = kw.get("gated", True)
        return _timed(spec, impl.name, problem, mode, gated, kw.get("edges", NEW[impl.name] if gated else None))

    def gate_row(spec, impl, problem, dtype, device, mode, row, edges=None):
        given.append(("gate", impl.name, edges))
        return _gated(impl.name, row, edges)

    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "gate_row", gate_row)
    monkeypatch.setattr(bench, "copy_bandwidth_gbps", lambda device: 1.0)
    store = Store(private_store)
    problems = [softmax.problem((n, 64), dim=-1) for n in (4, 256)]  # two cases
    df = bench.sweep([softmax], {"softmax": problems}, [torch.float32], CPU, store, progress=False,
                     log=lambda s: None, modes=["fwd_nograd"], cost_metadata=False, prune=None)
    assert store_io["edge_gate"] == [] and len(store_io["edge_gates"]) == 2, store_io  # one read per case
    case = [("measure", "eager"), ("measure", "triton"), ("measure", "compile"), ("gate", "triton"),
            ("gate", "compile")]
    assert [g[:2] for g in given] == case * 2, given
    assert [g[2] for g in given] == [None, None, None, None, None,  # the first case: nothing recorded yet
                                     NEW["eager"], None, NEW["compile"], None, NEW["compile"]], given
    assert sorted(store_io["put"]) == [("compile", NEW["compile"]), ("eager", NEW["eager"])], store_io["put"]
    rows = df.set_index(["problem", "impl"])
    for p in problems:
        assert rows.loc[(str(p), "triton"), "ok"] == 0 and rows.loc[(str(p), "triton"), "reason"] == EDGE_FAIL
        assert rows.loc[(str(p), "compile"), "ok"] == 1 and rows.loc[(str(p), "eager"), "ok"] == 1
    assert EDGES not in df.columns


def test_a_compiled_miss_reads_the_edge_gates_once_and_records_each_new_pass_once(softmax, private_store, store_io,
                                                                                  monkeypatch):
    given: list = []

    def measure(spec, impl, problem, dtype, device, mode, **kw):  # timed, then gated: triton fails an edge problem
        given.append((impl.name, kw.get("edges"), kw.get("context")))
        row = _timed(spec, impl.name, problem, mode, False, None)
        return dict(_gated(impl.name, row, kw.get("edges")), context=kw.get("context", "eager"))

    monkeypatch.setattr(case, "measure", measure)
    store, fp = Store(private_store), fingerprint(CPU)
    for rows_n in (4, 256):  # two compiled misses: the second is given the passes the first recorded
        problem = softmax.problem((rows_n, 64), dim=-1)
        key5 = ("softmax", bucket_str(softmax.bucket(problem)), DTYPE_NAMES[torch.float32], fp.key, "fwd_nograd")
        given.clear()
        rows = claimed.measure_compiled(store, softmax, problem, torch.float32, CPU, "fwd_nograd", key5,
                                        list(softmax.impls.values()))
        assert store_io["edge_gate"] == [] and len(store_io["edge_gates"]) == (1 if rows_n == 4 else 2), store_io
        known = {} if rows_n == 4 else NEW  # the recorded passes handed on, not checked again
        assert given == [(n, known.get(n), "compiled") for n in ("eager", "triton", "compile")], given
        assert sorted(store_io["put"]) == [("compile", NEW["compile"]), ("eager", NEW["eager"])], store_io["put"]
        newest = {r["impl"]: r for r in rows}
        assert sorted(newest) == ["compile", "eager", "triton"] and all(r["context"] == "compiled"
                                                                        for r in newest.values()), newest
        assert newest["triton"]["ok"] == 0 and newest["triton"]["reason"] == EDGE_FAIL, newest["triton"]
        assert newest["compile"]["ok"] == 1 and all(EDGES not in r for r in newest.values()), newest
    assert store.count("edge_gates") == 2
