"""benchmarks/models_summary.py: the per-GPU page lists every tiered row slower than stock and every tiered training
peak above stock's, from the per-model CSVs."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import models_summary  # noqa: E402


def _row(variant, workload, ms, verdict="", peak=None):
    return dict(model="m", variant=variant, workload=workload, context="compile", ms_p50=ms, verdict=verdict,
                peak_mib=peak, note="", device="GPU X")


def test_slower_rows_and_heavier_peaks_are_listed(tmp_path):
    (tmp_path / "models").mkdir()
    pd.DataFrame([_row("stock", "decode", 1.0), _row("tiered", "decode", 1.2, "slower"),
                  _row("tiered-fused", "decode", 1.0, "tie"),
                  _row("stock", "train", 10.0, peak=100.0), _row("tiered", "train", 9.0, "faster", 99.9),
                  _row("tiered-fused", "train", 9.0, "faster", 100.4),
                  _row("stock-copy", "train", 10.0, "tie", 100.2)]).to_csv(tmp_path / "models" / "m.csv", index=False)
    page = models_summary.summary(tmp_path)
    assert "Rows of a tiered variant slower than stock: 1:\n- m decode compile tiered: 0.83x" in page
    assert ("Training peaks of a tiered variant above stock's: 1:\n"
            "- m train compile tiered-fused: 100.4 MiB against stock's 100.0 (the control's: 100.2)") in page
    assert "| 100.0 / 99.9 / 100.4 / - / - / - |" in page  # stock / tiered / tiered-fused / liger / the -lce two
    assert "tiered-lce above liger-lce" not in page  # no fused-loss rows in this run


def test_the_fused_loss_variants_have_their_columns_and_peaks(tmp_path):
    """tiered-lce and liger-lce (the LM head + loss fused; training only): their times beside the others, their peaks
    in the memory column, tiered-lce's peak above stock's or liger-lce's listed."""
    (tmp_path / "models").mkdir()
    pd.DataFrame([_row("stock", "train", 10.0, peak=100.0), _row("tiered", "train", 9.0, "faster", 90.0),
                  _row("liger", "train", 9.5, "faster", 95.0), _row("tiered-lce", "train", 8.0, "faster", 60.0),
                  _row("liger-lce", "train", 8.5, "faster", 55.0),
                  _row("tiered-lce", "prefill", None)]).to_csv(tmp_path / "models" / "m.csv", index=False)
    page = models_summary.summary(tmp_path)
    assert "| 8.000 | faster | 8.500 (1.18x) | 100.0 / 90.0 / - / 95.0 / 60.0 / 55.0 |" in page
    assert ("Training peaks of tiered-lce above liger-lce's (both with the fused LM head + loss): 1:\n"
            "- m train compile: 60.0 MiB against liger-lce's 55.0") in page
    assert "Training peaks of a tiered variant above stock's: 0." in page
    assert "Rows without a figure" not in page  # tiered-lce's prefill: training only, by design


def test_a_verdict_needs_every_paired_round_to_agree():
    """A row is slower (faster) only when the medians lie outside each other's p20-p80 and the variant was slower
    (faster) than stock in every round; one round the other way makes it a tie."""
    from benchmarks import models_rows as models

    stock, slow = [[10.0, 10.1, 10.2]] * 3, [[10.5, 10.6, 10.7]] * 3
    k = models.rounds_slower(slow, stock)
    assert k == 3
    s_stats, m_stats = models.spread(sum(stock, [])), models.spread(sum(slow, []))
    assert models.verdict(m_stats, s_stats, k, 3) == "slower"
    assert models.verdict(s_stats, m_stats, models.rounds_slower(stock, slow), 3) == "faster"
    mixed = [[10.5, 10.6, 10.7], [9.0, 9.1, 9.2], [10.5, 10.6, 10.7], [10.5, 10.6, 10.7], [10.5, 10.6, 10.7]]
    stock5 = stock + stock[:2]
    k = models.rounds_slower(mixed, stock5)
    assert k == 4
    assert models.verdict(models.spread(sum(mixed, [])), models.spread(sum(stock5, [])), k, 5) == "tie"


def test_a_verdict_needs_the_control_to_agree():
    """Where the run timed the control (stock-copy, an unpatched copy of stock), a row is slower (faster) only where it
    is slower (faster) than both stock and the control: a gap to stock that the control shows too is the run's noise."""
    from benchmarks import models_rows as models

    assert models.agreed("slower", "slower") == "slower"
    assert models.agreed("slower", "tie") == "tie"
    assert models.agreed("faster", "slower") == "tie"
    assert models.agreed("faster", None) == "faster"


def test_the_page_lists_rows_where_the_control_reads_apart_from_stock(tmp_path):
    (tmp_path / "models").mkdir()
    pd.DataFrame([_row("stock", "decode", 1.0), _row("stock-copy", "decode", 1.1, "slower"),
                  _row("tiered", "decode", 1.1, "tie")]).to_csv(tmp_path / "models" / "m.csv", index=False)
    page = models_summary.summary(tmp_path)
    assert "reads faster or slower than stock: 1:\n- m decode compile: slower (1.100 against 1.000 ms" in page
    assert "Rows of a tiered variant slower than stock: 0." in page
