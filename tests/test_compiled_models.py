"""benchmarks/compiled_models.py on the CPU: each variant of a row compiled and timed in a process of its own, its
graph breaks counted, and a worker that fails or dies a row with its error."""

from __future__ import annotations

import csv
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path

import pytest
from test_patch import needs_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import compiled_models, compiled_worker  # noqa: E402


@needs_hf
def test_one_row_each_variant_in_its_own_process_and_a_dead_worker_is_a_row(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    out = tmp_path / "out"
    rc = compiled_models.main(["--quick", "--configs", "llama-tiny", "--workloads", "prefill", "--variants",
                               "stock,stock-copy,tiered", "--inject-failure", "stock-copy:prefill:exit",
                               "--out-dir", str(out)])
    assert rc == 0
    with open(out / "compiled_models.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
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
    assert {w for *_, w in rows} == {"prefill", "decode", "train"}


@needs_hf
@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_reduce_overhead_training_on_a_gpu_runs_whole_in_cuda_graphs(tmp_path, monkeypatch):
    # Inductor's reduce-overhead on a training step, each variant in its own process: stock traces whole, records CUDA
    # graphs (no skips), and its compiled first step matches the eager one; tiered's row is counted, never skipped.
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    out = tmp_path / "out"
    rc = compiled_models.main(["--quick", "--device", "cuda", "--backend", "inductor", "--configs", "llama-tiny",
                               "--modes", "reduce-overhead", "--workloads", "train", "--out-dir", str(out)])
    assert rc == 0
    with open(out / "compiled_models.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"stock", "tiered"}
    stock = rows["stock"]
    assert stock["error"] == "" and stock["graph_breaks"] == "0" and stock["cudagraph_skips"] == "0"
    assert stock["recompiles"] == "0" and float(stock["rel_err"]) < 5e-2
    assert rows["tiered"]["error"] == "" and int(rows["tiered"]["graph_breaks"]) >= 0
    assert rows["tiered"]["verdict"] in ("faster", "slower", "tie")
