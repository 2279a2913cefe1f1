"""The one-screen summary a sweep ends with: the winner of each (op, problem, dtype) per mode with its margin over the
runner-up, and in one line each, the implementations that cannot run or be timed here. Every figure in it is in the
rendered report too (``report.render``), which holds the per-implementation tables."""

from __future__ import annotations

import math

import pandas as pd

from ..store.rows import CONTENDED, PRUNED, UNAVAILABLE, UNGATED
from .analysis import latest, no_winner, winners

WIDTH = 160  # no line of the summary is longer
MAX_CASES = 40  # rows of the winner table shown; the rest are counted, and in the report
NOT_TIMED = "correct; not timed: "  # the reason of a row gated but not timed here (the Triton interpreter)


def _cut(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _cell(w: pd.Series | None, rows: pd.DataFrame) -> str:
    """A case's winner and its margin over the runner-up ("tie": their ranges overlap; no margin without a timed
    runner-up), or why it has none."""
    if w is None:
        return no_winner(rows).strip("()").split(":")[0]
    if w.tie:
        return f"{w.winner} tie"
    return w.winner if w.margin is None or math.isnan(w.margin) else f"{w.winner} {w.margin:.2f}x"


def winner_table(df: pd.DataFrame, max_cases: int = MAX_CASES) -> list[str]:
    """The winner of each (op, problem, dtype) per mode, one line per (op, problem, dtype)."""
    df = latest(df)
    w = winners(df).set_index(["op", "problem", "dtype", "mode"]) if len(df) else None
    modes = list(dict.fromkeys(df["mode"]))
    cases = list(dict.fromkeys(zip(df.op, df.problem, df.dtype)))
    groups = df.groupby(["op", "problem", "dtype", "mode"], sort=False).groups
    body = []
    for op, problem, dtype in cases:
        cells = []
        for mode in modes:
            k = (op, problem, dtype, mode)
            row = w.loc[k] if w is not None and k in w.index else None
            cells.append(_cell(row, df.loc[groups[k]] if k in groups else df[:0]))
        body.append([op, problem, dtype, *cells])
    head = ["op", "problem", "dtype", *modes]
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    fmt = lambda r: _cut("  ".join(f"{v:<{n}}" for v, n in zip(r, widths)).rstrip())  # noqa: E731
    lines = [fmt(head), *(fmt(r) for r in body[:max_cases])]
    if len(body) > max_cases:
        lines.append(f"... {len(body) - max_cases} more (op, problem, dtype) in the report")
    return lines


def not_here(df: pd.DataFrame) -> list[str]:
    """One line per kind of row without a time that a choice can use: implementations that cannot run
    (``unavailable: ...``), those gated but not timed (the Triton interpreter), those that failed (their gate, a
    crash, a hang), and timings taken on a busy machine; with the number of rows of each, which implementations and
    why."""
    why = df["reason"].astype(object).fillna("").astype(str) if "reason" in df else pd.Series("", index=df.index)
    passed = (PRUNED, UNGATED, UNAVAILABLE, CONTENDED, NOT_TIMED)
    failed = (df.ok != 1) & ~why.map(lambda w: w.startswith(passed))
    kinds = [(why.str.startswith(UNAVAILABLE), UNAVAILABLE, "cannot run here"),
             (why.str.startswith(NOT_TIMED), NOT_TIMED, "correct but not timed here"),
             (failed, "", "failed (never chosen)"),
             (why.str.startswith(CONTENDED), CONTENDED, "timed on a busy machine (not used: run again when idle)")]
    lines = []
    for mask, prefix, said in kinds:
        hit = df[mask]
        if hit.empty:
            continue
        short = why[hit.index].str.removeprefix(prefix).str.split(";").str[0].map(_words)
        told: dict[str, list[str]] = {}  # what is said of an implementation -> the implementations it is said of
        for impl, reasons in short.groupby(hit.impl, sort=False):
            first, more = reasons.iloc[0], reasons.nunique() - 1
            told.setdefault(first + (f"; {more} other reason(s)" if more else ""), []).append(str(impl))
        parts = [f"{', '.join(impls)} ({reason})" for reason, impls in told.items()]
        lines.append(_cut(f"{len(hit)} of {len(df)} rows {said}: " + "; ".join(parts)))
    return lines


def _words(text: str, width: int = 70) -> str:
    """``text`` cut to at most ``width`` characters at a word's end."""
    return text if len(text) <= width else text[:width].rsplit(" ", 1)[0] + " ..."


def summary(df: pd.DataFrame) -> list[str]:
    """The sweep's summary: the winner table, a legend, and what could not run or be timed here."""
    if not len(df):
        return ["nothing measured"]
    return ["winner per case and mode, with its margin over the runner-up (tie: their p20-p80 ranges overlap):",
            *winner_table(df), *not_here(df)]
