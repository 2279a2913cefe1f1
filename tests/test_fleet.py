"""benchmarks/fleet.py, the fleet in miniature, on the CPU: two processes tune disjoint buckets at once through one
PostgreSQL store and a third reads every decision with tuning off; nothing is lost, nothing measured twice, the reader
measures nothing. On a GPU host the same runs one process per GPU: ``bash scripts/gpu.sh build fleet``."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import fleet  # noqa: E402
from tiered_ops.measure import recheck  # noqa: E402


def test_two_processes_tune_disjoint_buckets_on_one_postgresql_store_and_a_reader_measures_nothing(pg_url, tmp_path):
    out = tmp_path / "fleet"
    # eager alone at two tiny shapes per op keeps the run short on 2 cores: the processes and the store are under test
    rc = fleet.main(["--out", str(out), "--db", pg_url, "--ops", "softmax,gelu", "--shapes", "4x32,8x64",
                     "--impls", "eager"])
    summary = (out / "fleet.md").read_text()
    assert rc == 0, summary
    rows = pd.read_csv(out / "fleet.csv")
    tuners = rows[rows.process.str.startswith("tune")]
    # each process tuned its own op's two buckets and measured each once
    assert {p: tuple(g.op.unique()) for p, g in tuners.groupby("process")} == {"tune0": ("softmax",),
                                                                               "tune1": ("gelu",)}, tuners
    assert len(tuners) == 4 and len(set(zip(tuners.op, tuners.bucket))) == 4 and (tuners.measured == 1).all(), tuners
    assert tuners.pid.nunique() == 2
    [reader] = [g for p, g in rows.groupby("process") if p.startswith("read")]
    assert len(reader) == 4 and reader.stored.all() and (reader.measured == 0).all(), reader
    assert reader.pid.nunique() == 1 and reader.pid.iloc[0] not in set(tuners.pid)
    key = ["op", "bucket"]
    both = tuners.merge(reader, on=key, suffixes=("", "_read"))
    assert (both.chosen == both.chosen_read).all(), both
    assert "decisions lost: 0" in summary and "decisions made twice: 0" in summary
    assert "0 calls, 0 rows gained" in summary
    assert "| tune0 | cpu | 2 of 2 | 2 | 2 | 2 |" in summary, summary  # two buckets, one row each (eager)


def _case(op: str, bucket: str, measured: int, process: str, chosen: str = "eager", stored: bool = True) -> dict:
    return dict(op=op, shape=[4, 32], bucket=bucket, chosen=chosen, stored=stored, reason="", device="cpu",
                measured=measured, pid=1, seconds=0.1, process=process)


def _summary(tmp_path, tuned, reads, twice_rows=None) -> tuple[int, str]:
    args = SimpleNamespace(procs=2, ops="softmax,gelu", impls=None)
    cases = [[dict(op="softmax", shape=[4, 32])], [dict(op="gelu", shape=[4, 32])]]
    rc = fleet.summarize(tmp_path, args, "test", cases, tuned, reads, Counter(), twice_rows or {}, [],
                         {"total_s": 1.0})
    return rc, (tmp_path / "fleet.md").read_text()


def test_the_summary_fails_on_a_lost_decision_a_bucket_measured_twice_or_a_reader_that_measured(tmp_path):
    a, b = _case("softmax", "[4,32]", 1, "tune0"), _case("gelu", "[4,32]", 1, "tune1")
    ok = [("cpu", [dict(a, measured=0, process="read0"), dict(b, measured=0, process="read0")], 0, 0.1)]
    assert _summary(tmp_path, [([a], 1.0), ([b], 1.0)], ok)[0] == 0
    # the reader finds nothing stored for gelu: lost
    rc, text = _summary(tmp_path, [([a], 1.0), ([b], 1.0)], [("cpu", [ok[0][1][0], dict(ok[0][1][1], stored=False)],
                                                               0, 0.1)])
    assert rc == 1 and "decisions lost: 1" in text and "gelu [4,32]: tuner chose eager" in text, text
    # a process that never reported its case: lost
    rc, text = _summary(tmp_path, [([a], 1.0), ([], 1.0)], ok)
    assert rc == 1 and "tune1: gelu [4, 32] not decided" in text, text
    # both processes measured softmax's bucket, and the store holds two rows of it
    rc, text = _summary(tmp_path, [([a], 1.0), ([b, dict(a, process="tune1")], 1.0)], ok,
                        {("softmax", "[4,32]", "fp32", "fwd_nograd", "eager", "cpu", "eager"): 2})
    assert rc == 1 and "decisions made twice: 2" in text, text
    # the reader measured
    rc, text = _summary(tmp_path, [([a], 1.0), ([b], 1.0)], [("cpu", ok[0][1], 1, 0.1)])
    assert rc == 1 and "1 rows gained" in text, text


def test_a_gates_outcome_stored_again_is_one_measurement_a_second_timing_is_two():
    def row(impl: str, p50: float, **kw) -> dict:
        return dict(op="softmax", bucket="[4,32]", dtype="fp32", mode="fwd_nograd", context="eager", device_key="cpu",
                    impl=impl, p20_us=p50 - 1, p50_us=p50, p80_us=p50 + 1, caller_us=p50 + 2, **kw)

    key = ("softmax", "[4,32]", "fp32", "fwd_nograd", "eager", "cpu", "triton")
    timed, gated = row("triton", 10.0, ok=0), row("triton", 10.0, ok=1)  # timed ungated, then its gate's outcome
    side = row("triton", 9.0, origin=recheck.ORIGIN + "eager")  # a launch-bound bucket's host times taken again
    assert fleet.measured_twice([timed, gated, side, row("eager", 12.0)]) == {}
    assert fleet.measured_twice([timed, gated, row("triton", 11.0)]) == {key: 2}
