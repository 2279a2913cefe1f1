"""benchmarks/speed_of_light.py: its cases are valid problems of the ops, its verdicts read the right rows, and it runs
end to end on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import speed_of_light as sol  # noqa: E402
from tiered_ops.sweep.live import grid_problem, load_grid  # noqa: E402


def _rows(*rows):
    """Rows whose kernel time is their caller time (GPU-bound); frac_copy is the kernel's, as the harness stores it."""
    return pd.DataFrame([dict(impl=i, tier=t, ok=ok, caller_us=us, p50_us=us, frac_copy=f, reason=r)
                         for i, t, ok, us, f, r in rows])


CASE = dict(case="c", op="rms_norm", shape="8x8", dtype="bf16", mode="fwd+bwd", ours=["triton", "cuda"],
            copy_at_least=0.75, vs_eager_at_least=1.3)


def test_every_committed_case_is_a_problem_of_its_op_with_a_bar():
    cases = json.loads((ROOT / "benchmarks" / "speed_of_light.json").read_text())
    points = load_grid(ROOT / "benchmarks" / "speed_of_light.json")
    assert len(points) == len(cases) >= 8
    for c, pt in zip(cases, points):
        grid_problem(pt.op, pt.shape, pt.params)  # raises on a shape or parameter the op does not take
        assert c["ours"] and any(k.endswith("_at_least") for k in c), c["case"]


def test_the_best_correct_row_of_ours_is_judged():
    rows = _rows(("triton", "triton", True, 100.0, 0.8, ""), ("cuda", "cuda", False, 50.0, 0.9, "wrong"),
                 ("eager", "eager", True, 140.0, 0.5, ""), ("compile", "compile", True, 120.0, 0.6, ""))
    v = sol.verdict(CASE, rows)
    assert (v["best"], v["copy"], v["vs_eager"], v["holds"]) == ("triton", 0.8, 1.4, True)


def test_a_bar_missed_or_a_rival_pruned_or_missing_is_said():
    rows = _rows(("triton", "triton", True, 100.0, 0.7, ""), ("eager", "eager", True, 140.0, 0.5, ""))
    assert sol.verdict(CASE, rows)["holds"] is False  # 70 % of copy against a bar of 75 %
    rows = _rows(("cuda", "cuda", True, 100.0, 0.9, ""), ("eager", "eager", True, 20.0, 0.5, "pruned: short"))
    v = sol.verdict(CASE, rows)
    assert v["holds"] is False and "eager" in v["why"]
    v = sol.verdict(CASE, _rows(("eager", "eager", True, 20.0, 0.5, "")))
    assert v["holds"] is False and "triton/cuda" in v["why"]


def test_the_copy_fraction_is_the_callers_and_the_kernel_fraction_the_rows():
    rows = _rows(("triton", "triton", True, 100.0, 0.9, ""), ("eager", "eager", True, 140.0, 0.5, ""))
    rows["p50_us"] = [50.0, 140.0]
    v = sol.verdict(CASE, rows)
    # the kernel's 50 us at 0.9 of copy: the bytes' copy time is 45 us, 0.45 of the 100 us caller time; the copy bar
    # (0.75) asks for a caller time of 60 us
    assert (v["copy"], v["kernel_copy"], v["bar_us"], v["holds"]) == (0.45, 0.9, 60.0, False)
    v = sol.verdict(CASE, rows.drop(columns="p50_us"))
    assert v["copy"] is None and "kernel_copy" not in v and v["holds"] is False


def test_a_host_floor_above_the_bar_time_is_said_where_the_bar_fails():
    v = dict(case="c", shape="8x8", dtype="bf16", mode="fwd+bwd", holds=False, bar_us=80.0)
    assert "host floor 95.0 us is above the 80.0 us" in sol.with_floor(v, 95.0)["why"]
    assert "why" not in sol.with_floor(v, 60.0)
    assert "why" not in sol.with_floor(dict(v, holds=True), 95.0)
    both = sol.with_floor(dict(v, why="no correct timing of eager"), 95.0)["why"]
    assert both.startswith("no correct timing of eager; the step's host floor")
    cases = [dict(CASE, case="c")]
    assert "| 95.0 (80.0) |" in sol.table([dict(sol.with_floor(v, 95.0), best="triton", best_us=100.0)], cases)


def test_the_step_floor_is_timed_on_the_cpu():
    import torch

    p = grid_problem("rms_norm", (4, 64), {})
    assert sol.step_floor_us("rms_norm", p, "fp32", torch.device("cpu")) > 0


@pytest.mark.slow
def test_it_runs_end_to_end_on_the_cpu(tmp_path):
    cases = [dict(case="tiny softmax", op="softmax", shape="4x64", dtype="fp32", mode="fwd_nograd", params={},
                  ours=["eager"], copy_at_least=0.0)]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    rc = sol.main(["--cases", str(tmp_path / "cases.json"), "--out-dir", str(tmp_path), "--in-process",
                   "--device", "cpu"])
    md = (tmp_path / "speed_of_light.md").read_text()
    assert "| tiny softmax | 4x64 | fp32 | fwd_nograd | eager |" in md
    assert rc == (0 if "| yes" in md else 1)
    assert set(pd.read_csv(tmp_path / "speed_of_light.csv").impl) >= {"eager"}


def test_an_only_that_matches_no_case_is_an_error_naming_the_ops(capsys):
    with pytest.raises(SystemExit):
        sol.main(["--only", "sofmax", "--in-process", "--device", "cpu"])
    err = capsys.readouterr().err
    assert "--only sofmax" in err and "rms_norm" in err and "softmax" in err


def test_two_cases_of_one_name_are_an_error_naming_it(tmp_path, capsys):
    case = {"case": "layer_norm over three dims", "op": "layer_norm", "shape": "2x4x8x8", "dtype": "fp32",
            "mode": "fwd_nograd", "params": {"normalized_shape": [4, 8, 8]}, "ours": ["cuda"], "copy_at_least": 0.8}
    (tmp_path / "cases.json").write_text(json.dumps([case, dict(case, dtype="bf16")]))
    with pytest.raises(SystemExit):
        sol.main(["--cases", str(tmp_path / "cases.json"), "--in-process", "--device", "cpu"])
    assert "named more than once: layer_norm over three dims" in capsys.readouterr().err
