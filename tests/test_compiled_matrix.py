"""benchmarks/compiled_matrix.py: the matrix's parts read side by side, the acceptance's counts from their cells."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.compiled_matrix import main, rows, table  # noqa: E402

FIELDS = ("config", "dtype", "mode", "workload", "variant", "ms_p50", "verdict", "rounds_slower", "verdict_vs_copy",
          "rounds_slower_vs_copy", "graph_breaks", "recompiles", "error")


def _write(path: Path, lines: list[tuple]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        w.writerows(lines)
    return path


def test_a_slower_row_a_break_and_a_failure_are_counted_and_a_rerun_replaces_its_row_whole(tmp_path):
    row = ("m", "fp16", "reduce-overhead", "prefill")
    part = _write(tmp_path / "p1.csv", [
        (*row, "stock", "0.766", "", "", "", "", "0", "0", ""),
        (*row, "stock-copy", "0.848", "tie", "3/5", "", "", "0", "0", ""),
        (*row, "tiered", "1.037", "slower", "5/5", "slower", "5/5", "0", "0", ""),
        ("m", "bf16", "default", "train", "stock", "14.7", "", "", "", "", "0", "0", ""),
        ("m", "bf16", "default", "train", "tiered", "", "", "", "", "", "2", "", "RuntimeError: boom"),
    ])
    lines, counts = table(rows([part], ["1"]))
    assert counts == dict(rows=2, timed=1, broken=1, failed=1, slower=1, slower_than_copy_too=1)
    slow = next(line for line in lines if "prefill" in line)
    assert "| 0.766 | 0.848 | 1.037 | 0.74x | slower 5/5 (slower 5/5) |" in slow
    assert "failed: RuntimeError: boom" in next(line for line in lines if "train" in line)

    rerun = _write(tmp_path / "p2.csv", [
        (*row, "stock", "0.774", "", "", "", "", "0", "0", ""),
        (*row, "tiered", "0.800", "tie", "3/5", "tie", "3/5", "0", "0", ""),
    ])
    lines, counts = table(rows([part, rerun], ["1", "rerun"]))
    assert counts["slower"] == 0
    assert "| 0.774 |  | 0.8 | 0.97x | tie 3/5 (tie 3/5) | " in next(line for line in lines if "prefill" in line)


def test_names_must_match_the_files(tmp_path, capsys):
    part = _write(tmp_path / "p.csv", [])
    try:
        main([str(part), "--names", "a,b"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("two names for one file were taken")
    assert "2 names for 1 files" in capsys.readouterr().err
