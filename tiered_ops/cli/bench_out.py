"""What `tiered-ops bench` prints and writes once its sweep is done: the summary, the report folder, and with
``--tables`` every measurement per op; and its log lines, wrapped."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pandas as pd

from ..analysis.analysis import decisions, policy_disagreements, shown, table, winner_per_mode, winners
from ..analysis.report import render_frame
from ..analysis.screen import WIDTH, summary


def wrapped(text: str) -> None:
    """A sweep's line on stdout, wrapped at WIDTH characters."""
    print(textwrap.fill(text, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))


def report_and_summary(df: pd.DataFrame, metas: dict, args: argparse.Namespace, out: Path, store_path: object
                       ) -> None:
    """Print the sweep's summary; unless ``--no-report``, write its report folder ``out`` and say where it is."""
    print()
    for line in summary(df):
        print(line)
    if len(df) and not args.no_report:
        command = ("tiered-ops bench " + " ".join(args.argv)).strip()
        files = render_frame(df, out, metas, command, f"{command} (at the end of the sweep)")
        plots = sum(f.suffix == ".png" for f in files)
        print(f"\n{len(df)} measurements, stored in {store_path}")
        print(f"report: {out}/README.md (with results.csv and {plots} plot(s))")


def tables(df: pd.DataFrame, specs: list, metas: dict) -> None:
    """``bench --tables``: every measurement per op, the winners, the decision under each policy, the winner per
    mode."""
    note: list[str] = []
    rows = shown(df, note) if len(df) else df
    for spec in specs:
        print()
        print(table(rows, spec.name))
    for line in note:
        print(line)
    w = winners(df)
    if len(w):
        print("\nwinners:")
        cols = ["op", "problem", "dtype", "mode", "winner", "tier", "caller_us", "margin", "tie"]
        print(w[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        d = decisions(df, metas)
        print("\ndecision under each policy (cold_start_N: N expected calls; CUDA pays its extension build):")
        print(d.to_string(index=False))
        print(f"policies disagree on {policy_disagreements(d)} of {len(d)} (op, problem, dtype, mode)")
        modes, flips = winner_per_mode(w, df)
        if modes.shape[1] > 1:
            print(f"\nwinner per mode (differs across modes for {flips} of {len(modes)} (op, problem, dtype)):")
            print(modes.to_string())
