"""tiered-ops report from a small results file produced by a real CPU bench run: Markdown, CSV and plots."""

import pandas as pd

from tiered_ops.cli import main
from tiered_ops.report import winners
from tiered_ops.store import COLUMN_NAMES


def test_report_from_a_real_cpu_bench(private_store, tmp_path, capsys):
    assert main(["--db", str(private_store), "bench", "--ops", "muladd", "--impls", "eager,eager_addcmul",
                 "--shapes", "64x64", "300x7", "--modes", "fwd_nograd,fwd+bwd", "--no-progress", "--in-process"]) == 0
    csv, meta = tmp_path / "results.csv", tmp_path / "meta.jsonl"
    assert main(["--db", str(private_store), "export", "--csv", str(csv), "--meta", str(meta)]) == 0
    out = tmp_path / "report"
    assert main(["report", "--results", str(csv), "--meta", str(meta), "--out", str(out),
                 "--command", "tiered-ops bench --ops muladd ..."]) == 0
    text = (out / "README.md").read_text()
    df = pd.read_csv(out / "results.csv")
    assert list(df.columns) == ["id", *COLUMN_NAMES] and len(df) == 8  # 2 shapes x 2 modes x 2 impls
    w = winners(df)
    assert len(w) == 4
    for r in w.itertuples():  # every winner in the Markdown, with its margin (or tie) and time from the CSV
        margin = "tie" if r.tie else f"{r.margin:.2f}x"
        assert f"| {r.problem} | fp32 | {r.mode} | **{r.winner}** | {r.us:.1f} | {margin} |" in text
    assert "Measured by: `tiered-ops bench --ops muladd ...`" in text and "torch " in text
    assert "Rendered by: `tiered-ops report --results" in text
    for png in ("muladd-gbps.png", "winners.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
