"""benchmarks/compiled_models.py on the CPU: each variant of a row compiled and timed in a process of its own, its
graph breaks counted, and a worker that fails or dies a row with its error."""

from __future__ import annotations

import csv
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from test_patch import needs_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import compiled_models, compiled_schedule, compiled_worker  # noqa: E402


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Path, list[dict]]:
    """``compiled_models.main --quick *args`` into a folder of ``tmp_path`` with tuning off for this test alone
    (``--quick``'s own default would stay in the process's environment); its rows, as written."""
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    out = tmp_path / "out"
    assert compiled_models.main(["--quick", *args, "--out-dir", str(out)]) == 0
    with open(out / "compiled_models.csv") as f:
        return out, list(csv.DictReader(f))


def _events(out: Path) -> list[dict]:
    """The run's events file: each worker request's stage, start and end."""
    with open(out / "compiled_models_events.csv") as f:
        return [dict(e, start=float(e["start"]), end=float(e["end"])) for e in csv.DictReader(f)]


@needs_hf
def test_one_row_each_variant_in_its_own_process_and_a_dead_worker_is_a_row(tmp_path, monkeypatch):
    out, rows = _run(tmp_path, monkeypatch, "--configs", "llama-tiny", "--workloads", "prefill", "--variants",
                     "stock,stock-copy,tiered", "--inject-failure", "stock-copy:prefill:exit")
    rows = {r["variant"]: r for r in rows}
    assert set(rows) == {"stock", "stock-copy", "tiered"}
    for v in ("stock", "tiered"):
        r = rows[v]
        assert (r["config"], r["dtype"], r["mode"], r["workload"], r["shape"]) == (
            "llama-tiny", "bf16", "default", "prefill", "1x16")
        assert r["error"] == ""
        assert int(r["graph_breaks"]) >= 0 and int(r["recompiles"]) >= 0 and int(r["graphs"]) >= 1
        assert float(r["ms_p20"]) <= float(r["ms_p50"]) <= float(r["ms_p80"])
        assert float(r["first_call_s"]) > 0
        assert float(r["rel_err"]) < 1e-2  # the compiled first step against the stock eager step
        assert float(r["probe_us"]) > 0  # the host probe timed beside the rounds
    assert rows["stock-copy"]["probe_us"] == ""  # a dead worker probed nothing
    pids = {rows[v]["pid"] for v in rows}  # a process of its own per variant, none of them this one
    assert len(pids) == 3 and str(os.getpid()) not in pids
    assert rows["tiered"]["store"] == "fresh" and rows["stock"]["store"] == ""  # stock never opens a store
    assert rows["stock"]["graph_breaks"] == "0"  # stock transformers Llama traces whole
    assert rows["tiered"]["verdict"] in ("faster", "slower", "tie")
    assert rows["tiered"]["rounds_slower"].endswith("/2")
    assert "swapped" in rows["tiered"]["note"]
    dead = rows["stock-copy"]
    assert "died" in dead["error"] and "exit code 3" in dead["error"] and dead["ms_p50"] == ""
    md = (out / "compiled_models.md").read_text()
    assert "failed: compile: the worker died (exit code 3)" in md


@needs_hf
def test_a_worker_that_raises_answers_its_error_and_ends(monkeypatch):
    # serve() run here, in this process, over a pipe: it builds, says ready, then fails where it was told to
    cfg = compiled_models.configs(True)["llama-tiny"]
    spec = dict(config=cfg, dtype="bf16", mode="default", workload="decode", variant="stock", shape=(2, 1),
                device="cpu", backend="eager", warmup=0, carried=False, fail="raise")
    parent, child = mp.Pipe()
    parent.send(("compile",))
    old = signal.getsignal(signal.SIGINT)
    try:
        compiled_worker.serve(child, spec)
    finally:
        signal.signal(signal.SIGINT, old)
    assert parent.recv()[0] == "ready"
    kind, text = parent.recv()
    assert kind == "error" and text == "compile: RuntimeError: injected failure (--inject-failure)"


@needs_hf
def test_the_next_run_compiles_after_the_tiered_worker_and_reads_its_store(tmp_path, monkeypatch):
    out, rows = _run(tmp_path, monkeypatch, "--configs", "llama-tiny", "--workloads", "decode", "--variants",
                     "stock,tiered-next,tiered")
    rows = {r["variant"]: r for r in rows}
    assert set(rows) == {"stock", "tiered", "tiered-next"} and all(r["error"] == "" for r in rows.values())
    assert rows["tiered-next"]["store"] == "tiered's" and rows["tiered"]["store"] == "fresh"
    assert "swapped" in rows["tiered-next"]["note"] and rows["tiered-next"]["verdict"] in ("faster", "slower", "tie")
    compiles = {e["variant"]: e for e in _events(out) if e["stage"] == "compile"}
    assert compiles["tiered-next"]["start"] >= compiles["tiered"]["end"]  # its store holds the tuning when it reads
    for bad in ("stock,tiered-next", "stock,tiered,stock-2"):  # said before any worker starts
        with pytest.raises(SystemExit):
            compiled_models.parse(["--variants", bad])


def test_the_plan_covers_both_dtypes_every_family_and_the_modes():
    args = compiled_models.parse([])
    rows = list(compiled_models.plan(args))
    table = compiled_models.configs(False)
    assert len(table) >= 4
    assert {c["family"] for c in table.values()} >= {"llama", "qwen3", "gpt2"}
    assert {c["dtype"] for c in table.values()} == {"bf16", "fp16"}
    vocab = {c["kwargs"]["vocab_size"] for c in table.values()}
    assert min(vocab) == 32000 and max(vocab) == 151936
    assert all(c["batch"] > 1 and c["kwargs"].get("num_hidden_layers", c["kwargs"].get("n_layer")) == 2
               for c in table.values())
    for name in table:
        modes = {m for n, _, _, m, _ in rows if n == name}
        assert {"default", "reduce-overhead"} <= modes
    autotuned = {n for n, _, _, m, _ in rows if m in ("max-autotune", "max-autotune-no-cudagraphs")}
    assert len(autotuned) == 1
    # their GEMM search runs for minutes a variant beyond decode: decode alone unless asked
    assert {w for *_, m, w in rows if m in compiled_models.MORE_MODES} == {"decode"}
    more = compiled_models.parse(["--autotune-workloads", "decode,prefill"])
    assert {w for *_, m, w in compiled_models.plan(more) if m in compiled_models.MORE_MODES} == {"decode", "prefill"}
    assert {w for *_, w in rows} == {"prefill", "decode", "train"}


def test_the_control_joins_every_row_but_the_searching_modes_and_each_variant_has_its_own_caches(monkeypatch, tmp_path):
    args = compiled_models.parse([])  # on the GPU: auto
    if args.variants == "auto":
        assert compiled_schedule.variants(args, "decode") == ["stock", "stock-copy", "tiered"]
        assert compiled_schedule.variants(args, "prefill", "reduce-overhead") == ["stock", "stock-copy", "tiered"]
        assert compiled_schedule.variants(args, "train") == ["stock", "stock-copy", "tiered"]
        assert compiled_schedule.variants(args, "decode", "max-autotune") == ["stock", "tiered"]
    assert compiled_models.parse(["--quick"]).variants == "stock,tiered"
    named = compiled_models.parse(["--variants", "stock,tiered"])
    assert compiled_schedule.variants(named, "decode") == ["stock", "tiered"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert compiled_schedule.own_caches("tiered") == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor" / "tiered")}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    caches = [compiled_schedule.own_caches(v) for v in ("stock", "stock-copy", "tiered")]
    assert len({c["TRITON_CACHE_DIR"] for c in caches}) == len({c["TORCHINDUCTOR_CACHE_DIR"] for c in caches}) == 3


@needs_hf
@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_reduce_overhead_training_on_a_gpu_runs_whole_in_cuda_graphs(tmp_path, monkeypatch):
    # Inductor's reduce-overhead on a training step, each variant in its own process: stock traces whole, records CUDA
    # graphs (no skips), and its compiled first step matches the eager one; tiered's row is counted, never skipped.
    _, rows = _run(tmp_path, monkeypatch, "--device", "cuda", "--backend", "inductor", "--configs", "llama-tiny",
                   "--modes", "reduce-overhead", "--workloads", "train")
    rows = {r["variant"]: r for r in rows}
    assert set(rows) == {"stock", "tiered"}
    stock = rows["stock"]
    assert stock["error"] == "" and stock["graph_breaks"] == "0" and stock["cudagraph_skips"] == "0"
    assert stock["recompiles"] == "0" and float(stock["rel_err"]) < 5e-2
    assert rows["tiered"]["error"] == "" and int(rows["tiered"]["graph_breaks"]) >= 0
    assert rows["tiered"]["verdict"] in ("faster", "slower", "tie")


def test_parts_cover_the_plan_once_each_with_a_share_of_every_config_and_mode():
    whole = [k[:1] + k[2:] for k in compiled_models.plan(compiled_models.parse([]))]
    assert len(whole) == len(set(whole))
    for n in (1, 2, 3, 4, 7):
        parts = [[k[:1] + k[2:] for k in compiled_models.plan(compiled_models.parse(["--part", f"{i}/{n}"]))]
                 for i in range(1, n + 1)]
        assert sorted(r for p in parts for r in p) == sorted(whole)  # every row once, none twice
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    thirds = [compiled_models.plan(compiled_models.parse(["--part", f"{i}/3"])) for i in (1, 2, 3)]
    for p in thirds:  # each call a fair share: every config, each workload about as often, the modes alike
        assert {k[0] for k in p} == set(compiled_models.configs(False))
        assert sorted(Counter(k[4] for k in p if k[3] not in compiled_models.MORE_MODES).values()) == [3, 3, 4]
        assert Counter(k[3] for k in p)["default"] == Counter(k[3] for k in p)["reduce-overhead"] == 5
        assert sum(k[3] in compiled_models.MORE_MODES for k in p) <= 1  # the GPU-searching rows in different calls
    for bad in ("0/3", "4/3", "1", "a/b"):
        with pytest.raises(SystemExit):
            compiled_models.parse(["--part", bad])


class _FakeWorker:
    """A worker that answers a compile after ``busy_s`` seconds, its span from when it got the request."""

    def __init__(self, busy_s: float) -> None:
        self.busy_s, self.asked = busy_s, None

    def send(self, msg):
        self.asked = time.time()

    def ask(self, msg, timeout, what="start"):
        if msg is not None:
            self.send(msg)
        time.sleep(max(0.0, self.asked + self.busy_s - time.time()))
        return dict(first_call_s=self.busy_s, rel_err=0.0, note="", graph_breaks=0, t0=self.asked, t1=time.time())


def _fake_row(mode: str) -> compiled_schedule.Row:
    row = object.__new__(compiled_schedule.Row)
    row.key, row.mode = ("cfg", {}, "bf16", mode, "prefill"), mode
    row.alive = {v: _FakeWorker(0.2) for v in ("stock", "tiered")}
    row.rows = {v: dict(pid=1) for v in row.alive}
    row.first, row.events = {}, []
    return row


def test_a_batch_compiles_together_but_a_gpu_searching_mode_alone_and_with_tune_alone_each_tiered_alone():
    rows = [_fake_row("default"), _fake_row("max-autotune"), _fake_row("reduce-overhead")]
    compiled_schedule.compile_all(rows, 10, together=True)
    for row in (rows[0], rows[2]):  # each beside the 3 other variants of the together rows
        assert [row.rows[v]["first_call_beside"] for v in ("stock", "tiered")] == [3, 3]
    assert [rows[1].rows[v]["first_call_beside"] for v in ("stock", "tiered")] == [0, 0]
    tuned = [_fake_row("default"), _fake_row("default")]
    compiled_schedule.compile_all(tuned, 10, together=True, tune_alone=True)  # stock together, each tiered alone
    for row in tuned:
        assert [row.rows[v]["first_call_beside"] for v in ("stock", "tiered")] == [1, 0]
    alone = [_fake_row("default")]
    compiled_schedule.compile_all(alone, 10, together=False)  # one row a batch: each variant alone, as before
    assert [alone[0].rows[v]["first_call_beside"] for v in ("stock", "tiered")] == [0, 0]


@needs_hf
def test_batched_rows_compile_together_and_nothing_compiles_while_a_row_is_timed(tmp_path, monkeypatch):
    out, rows = _run(tmp_path, monkeypatch, "--configs", "llama-tiny", "--workloads", "prefill,decode", "--parallel",
                     "2")
    assert [(r["workload"], r["variant"]) for r in rows] == [("prefill", "stock"), ("prefill", "tiered"),
                                                             ("decode", "stock"), ("decode", "tiered")]
    for r in rows:
        assert r["error"] == "" and float(r["ms_p50"]) > 0
        assert int(r["first_call_beside"]) >= 1 and "beside" in r["note"]  # said in the row
    events = _events(out)
    busy = [e for e in events if e["stage"] in ("start", "compile")]
    timed = [e for e in events if e["stage"] in ("warm", "time")]
    assert len([e for e in busy if e["stage"] == "compile"]) == 4 and len(timed) == 2 * (2 + 2 * 2)
    for t in timed:  # no worker started or compiled while any call was timed
        assert not [b for b in busy if b["start"] < t["end"] and b["end"] > t["start"]], t
    compiles = [e for e in busy if e["stage"] == "compile"]
    assert max(e["start"] for e in compiles) < min(e["end"] for e in compiles)  # all four at once
    first_row_end = max(t["end"] for t in timed if t["workload"] == "prefill")  # one row timed after the other
    assert first_row_end < min(t["start"] for t in timed if t["workload"] == "decode")
    assert {e["pid"] for e in events} == {r["pid"] for r in rows}


def test_a_rerun_with_done_keeps_the_rows_timed_for_every_variant_and_runs_the_rest(tmp_path, monkeypatch):
    done = tmp_path / "done.csv"
    base = dict(config="llama-tiny", dtype="bf16", mode="default", shape="1x16", error="", ms_p20="1.0",
                ms_p50="2.0", ms_p80="3.0", pid="77")
    old = [dict(base, workload="prefill", variant="stock"), dict(base, workload="prefill", variant="tiered"),
           dict(base, workload="decode", variant="stock"),
           dict(base, workload="decode", variant="tiered", ms_p50="", error="compile: the worker died"),
           dict(base, workload="train", variant="stock")]  # train: its tiered row never came
    with open(done, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(base) + ["workload", "variant"])
        w.writeheader()
        w.writerows(old)
    kept = compiled_models.finished(str(done), ["stock", "tiered"])
    assert [(r["workload"], r["variant"]) for r in kept] == [("prefill", "stock"), ("prefill", "tiered")]
    assert kept[0]["ms_p50"] == 2.0
    by_row = compiled_models.finished(str(done), lambda r: ["stock"] if r["workload"] == "train"
                                      else ["stock", "tiered"])
    assert [(r["workload"], r["variant"]) for r in by_row] == [("prefill", "stock"), ("prefill", "tiered"),
                                                               ("train", "stock")]
    stock_only = compiled_models.finished(str(done), ["stock"])  # a run of stock alone: every stock row is done
    assert [(r["workload"], r["variant"]) for r in stock_only] == [("prefill", "stock"), ("decode", "stock"),
                                                                   ("train", "stock")]
    # every row of this plan is done: nothing runs, the kept rows are written again, once
    out, rows = _run(tmp_path, monkeypatch, "--configs", "llama-tiny", "--workloads", "prefill", "--done", str(done),
                     "--done", str(done))
    assert [(r["workload"], r["variant"], r["pid"]) for r in rows] == [("prefill", "stock", "77"),
                                                                       ("prefill", "tiered", "77")]
    assert "2 rows taken from" in (out / "compiled_models.md").read_text()


@needs_hf
@pytest.mark.gpu
@pytest.mark.timeout(500)
def test_a_gpu_batch_compiles_together_the_autotune_row_alone_and_times_nothing_beside_a_compile(tmp_path, monkeypatch):
    # Inductor on a GPU, 4 rows a batch: the default rows' variants compile at once (beside 3 others), the
    # max-autotune-no-cudagraphs rows' one at a time (its GEMM search times kernels on the GPU: beside none), and no
    # warm-up or timed call overlaps any worker's start or compile.
    out, rows = _run(tmp_path, monkeypatch, "--device", "cuda", "--backend", "inductor", "--configs", "llama-tiny",
                     "--modes", "default,max-autotune-no-cudagraphs", "--workloads", "prefill,decode", "--parallel",
                     "4")
    assert len(rows) == 8 and all(r["error"] == "" and float(r["ms_p50"]) > 0 for r in rows)
    for r in rows:
        assert r["first_call_beside"] == ("3" if r["mode"] == "default" else "0"), r
    events = _events(out)
    busy = [e for e in events if e["stage"] in ("start", "compile")]
    for t in (e for e in events if e["stage"] in ("warm", "time")):
        assert not [b for b in busy if b["start"] < t["end"] and b["end"] > t["start"]], t


def test_a_worker_counts_its_live_child_processes():
    if not os.path.isdir(f"/proc/{os.getpid()}/task"):
        assert compiled_worker.children() == -1
        return
    before = compiled_worker.children()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert compiled_worker.children() == before + 1
    finally:
        child.kill()
        child.wait()
    assert compiled_worker.children() == before


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="the OS pins no thread")
def test_every_worker_is_timed_from_one_cpu_unless_told_otherwise(capsys):
    mine = sorted(os.sched_getaffinity(0))
    assert compiled_models.parse(["--quick"]).timing_cpu == mine[-1]
    assert compiled_models.parse(["--quick", "--timing-cpu", "none"]).timing_cpu is None
    assert compiled_models.parse(["--quick", "--timing-cpu", str(mine[0])]).timing_cpu == mine[0]
    with pytest.raises(SystemExit):
        compiled_models.parse(["--quick", "--timing-cpu", str(max(mine) + 1)])
    assert "--timing-cpu: " in capsys.readouterr().err

    seen = {}

    def thread() -> None:  # pinned in a thread of its own: this process's other threads keep their CPUs
        compiled_worker.pin(mine[0])
        seen["pinned"] = os.sched_getaffinity(0)

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert seen["pinned"] == {mine[0]} and sorted(os.sched_getaffinity(0)) == mine


def test_a_worker_whose_host_probe_is_far_from_stocks_says_so_in_its_note():
    from benchmarks.compiled_schedule import host_notes

    notes = host_notes({"stock": 1000.0, "stock-copy": 1100.0, "tiered": 1800.0})
    assert set(notes) == {"tiered"} and "1.80x stock's" in notes["tiered"] and "slower" in notes["tiered"]
    assert "faster" in host_notes({"stock": 2000.0, "tiered": 1000.0})["tiered"]
    assert host_notes({"tiered": 1800.0}) == {}  # no stock probe (its worker died): nothing to compare with
