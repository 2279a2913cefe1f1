"""benchmarks/compare_sweeps.py as a maintainer runs it on two sweeps' results: spans, time ratios, and the
decisions compared as the report's --repeat compares them (caller time, ties left out)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import compare_sweeps  # noqa: E402


def _rows(times: dict[tuple[str, str], float], t0: float) -> pd.DataFrame:
    """One row per (problem, impl): kernel-bound (host well under the kernel), a 1 % spread each side."""
    out = []
    for i, ((problem, impl), us) in enumerate(times.items()):
        out.append(dict(id=i, op="softmax", problem=problem, dtype="bf16", mode="fwd_nograd", impl=impl,
                        tier=impl, context="eager", p20_us=us * 0.99, p50_us=us, p80_us=us * 1.01, host_us=1.0,
                        host_p20_us=0.9, host_p80_us=1.1, caller_us=us, ok=1, reason=None, timestamp=t0 + 10 * i))
    return pd.DataFrame(out)


def test_sweeps_compared_by_span_ratio_and_decision(tmp_path: Path, capsys) -> None:
    a = _rows({("64x64", "triton"): 10.0, ("64x64", "cuda"): 20.0, ("8x8", "triton"): 10.0,
               ("8x8", "cuda"): 10.1}, t0=0.0)
    b = _rows({("64x64", "triton"): 30.0, ("64x64", "cuda"): 20.0, ("8x8", "triton"): 10.0,
               ("8x8", "cuda"): 10.05}, t0=100.0)
    pa, pb, md = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "out.md"
    a.to_csv(pa, index=False)
    b.assign(timestamp=b.timestamp * 2).to_csv(pb, index=False)
    assert compare_sweeps.main([str(pa), str(pb), "--names", "two", "one", "--md", str(md)]) == 0
    text = md.read_text()
    assert text == capsys.readouterr().out
    assert "| two | 4 | 4 | 4 | 30 |" in text and "| one | 4 | 4 | 4 | 60 |" in text
    # 64x64: triton wins in one sweep, cuda in the other; 8x8 ties in both and is not compared
    assert "the same in 0 of 1 cases" in text
    assert "- differs: softmax 64x64 bf16 fwd_nograd: triton (2.00x) then cuda (1.50x)" in text
    # the ratios 10/30, 20/20, 10/10, 10.1/10.05: median 1.000; the 64x64 triton rows alone apart
    assert "4 rows timed in both: median time ratio two / one 1.000" in text
    assert "p20-p80 ranges overlap in 3 of 4" in text
