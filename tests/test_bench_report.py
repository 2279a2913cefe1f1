"""A sweep leaves a report: `tiered-ops bench` writes results.csv, the rendered Markdown and its plots into one folder
it names, and prints a one-screen summary whose counts agree with the folder's."""

import re
from pathlib import Path

import pandas as pd

from tiered_ops.analysis.screen import WIDTH, summary
from tiered_ops.cli.cli import main
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.store.rows import UNAVAILABLE

# muladd's two eager implementations, and gelu's eager and CUDA ones (muladd has no CUDA tier): a CUDA row cannot run
SWEEP = ["bench", "--ops", "muladd,gelu", "--impls", "eager,eager_addcmul,cuda", "--shapes", "64x64", "300x7",
         "--mode", "fwd_nograd,fwd+bwd", "--no-progress", "--in-process", "--no-meta", "--device", "cpu"]


def test_bench_writes_a_report_folder_and_a_short_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERED_OPS_REPORT", str(tmp_path / "reports"))
    assert main(SWEEP) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "reports" / fingerprint(__import__("torch").device("cpu")).slug
    df = pd.read_csv(folder / "results.csv")
    assert len(df) == 16  # 2 shapes x 2 modes x (2 implementations of muladd + 2 of gelu)
    text = (folder / "README.md").read_text()
    assert f"; {len(df)} measurements;" in text
    for png in ("muladd-gbps.png", "gelu-gbps.png", "winners.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    said = re.search(r"^(\d+) measurements, stored in .*\nreport: (\S+)/README\.md", out, re.M)
    assert said and int(said[1]) == len(df) and Path(said[2]) == folder, out
    summary_lines = out[out.index("winner per case"):].splitlines()
    paths = [line for line in out.splitlines() if str(tmp_path) in line]  # this test's paths are long
    assert len(summary_lines) <= 60 and max(len(line) for line in out.splitlines() if line not in paths) <= WIDTH
    assert "nan" not in out.lower()
    cuda = df[df.impl == "cuda"]
    assert f"{len(cuda)} of {len(df)} rows cannot run here: cuda (" in out  # one line, not a row per case
    cases = (folder / "cases.md").read_text()
    assert "| 300x7 |" in cases and "**" in cases  # the per-op tables are in the report's cases page


def test_bench_out_names_the_folder_and_no_report_writes_none(tmp_path, capsys):
    mine = tmp_path / "mine"
    assert main(SWEEP + ["--out", str(mine)]) == 0
    assert (mine / "README.md").exists() and f"report: {mine}/README.md" in capsys.readouterr().out
    other = tmp_path / "other"
    assert main(SWEEP + ["--no-report", "--out", str(other)]) == 0
    assert not other.exists() and "report:" not in capsys.readouterr().out


def test_report_needs_no_command(tmp_path, capsys):
    assert main(SWEEP + ["--no-report"]) == 0
    csv = tmp_path / "r.csv"
    assert main(["export", "--csv", str(csv)]) == 0
    assert main(["report", "--results", str(csv), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "README.md").read_text()
    assert "Measured by: `not recorded`" in text
    assert f"; {len(pd.read_csv(csv))} measurements;" in text  # the count `export` said it wrote


def _row(impl: str, tier: str, problem: str, mode: str, us: float | None, ok: int = 1, reason: str | None = None):
    return dict(device_key="cpu", op="softmax", impl=impl, tier=tier, problem=problem, dtype="fp32", mode=mode,
                ok=ok, caller_us=us, p20_us=us, p50_us=us, p80_us=us, reason=reason, timestamp=1.0)


def test_the_summary_has_no_nan_and_one_line_per_kind_of_row_without_a_time():
    rows = []
    for k in range(30):
        problem = f"{8 * (k + 1)}x4096,dim=-1"
        rows += [_row("eager", "eager", problem, "fwd_nograd", 10.0 + k),
                 _row("compile", "compile", problem, "fwd_nograd", None, ok=1, reason="contended: busy"),
                 _row("cuda", "cuda", problem, "fwd_nograd", None, ok=0, reason=UNAVAILABLE + "runs on cuda only"),
                 _row("triton", "triton", problem, "fwd_nograd", None,
                      reason="correct; not timed: the Triton interpreter is for correctness, not speed")]
    lines = summary(pd.DataFrame(rows))
    text = "\n".join(lines)
    assert "nan" not in text.lower() and max(map(len, lines)) <= WIDTH
    assert "30 of 120 rows cannot run here: cuda (runs on cuda only)" in text
    assert "30 of 120 rows correct but not timed here: triton (the Triton interpreter" in text
    assert "30 of 120 rows timed on a busy machine (not used: run again when idle): compile (busy)" in text
    assert "failed" not in text  # nothing failed: no such line
    assert sum("softmax" in line for line in lines) == 30 and len(lines) <= 60
    rows.append(_row("triton", "triton", "8x4096,dim=-1", "fwd", None, ok=0, reason="gate: max rel error 3e-2 > 1e-5"))
    assert "1 of 121 rows failed (never chosen): triton (gate: max rel error 3e-2 > 1e-5)" in "\n".join(
        summary(pd.DataFrame(rows)))
    assert re.search(r"^softmax\s+8x4096,dim=-1\s+fp32\s+eager$", text, re.M), text


def test_the_summary_of_a_sweep_without_one_usable_row_names_why():
    """Every row timed on a busy machine, or unable to run: no case has a winner, and the summary says why instead
    of failing on an empty table of winners (the CLI's bench crashed there)."""
    rows = [_row("eager", "eager", "8x65536,dim=-1", "bwd", None, reason="contended: busy"),
            _row("compile", "compile", "8x65536,dim=-1", "bwd", None, ok=0, reason="first call raised: RuntimeError"),
            _row("cuda", "cuda", "8x65536,dim=-1", "bwd", None, ok=0, reason=UNAVAILABLE + "runs on cuda only")]
    text = "\n".join(summary(pd.DataFrame(rows)))
    assert "1 of 3 rows timed on a busy machine" in text and "1 of 3 rows cannot run here" in text
    assert "1 of 3 rows failed (never chosen): compile" in text
    assert re.search(r"^softmax\s+8x65536,dim=-1\s+fp32\s+\S", text, re.M), text
