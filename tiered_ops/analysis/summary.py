"""The one-screen summary that opens a per-GPU report: per op, how many cases each tier wins (the picture,
``winners.png``, shows where: op × shape × dtype × mode, coloured by the winning tier, annotated with the margin),
how far the winners of the large cases are from the copy limit (bytes moved over the winner's kernel time, against
the copy bandwidth measured in the same run: the results' ``frac_copy``), and where a CUDA kernel defends a
territory (``check``'s findings on the same rows). Computed from the results, never typed by hand."""

from __future__ import annotations

import math

import pandas as pd

from ..tiers.catalog import get_op
from .check import check
from .territories import RETIRED, TERRITORIES, rows_and_len

TIERS = ("eager", "compile", "triton", "cuda")
# the cases whose winners are held to the copy limit: those moving at least this many bytes (launch-bound cases are
# far from it by nature)
LARGE_BYTES = 64 << 20
# the columns ``check`` needs (results of an older schema or a hand-made frame may lack them: no territory line)
CHECK_COLUMNS = ("device_key", "source_hash", "problem", "context")


def bytes_moved(df: pd.DataFrame) -> pd.Series:
    """Bytes one call moves, from a row's bandwidth and kernel time (NaN where the row has no bandwidth)."""
    return df.gbps * df.p50_us * 1e3


def copy_fractions(w: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """The winners (``analysis.winners``) with the fraction of the copy bandwidth their own row reaches
    (``frac_copy``: bytes moved over the kernel time) and the bytes the case moves."""
    key = ["op", "problem", "dtype", "mode"]
    rows = df[key + ["impl", "frac_copy", "gbps", "p50_us"]].rename(columns={"impl": "winner"})
    rows = rows.assign(moved=bytes_moved(rows)).drop(columns=["gbps", "p50_us"])
    return w.merge(rows.drop_duplicates(key + ["winner"], keep="last"), on=key + ["winner"], how="left")


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _copy_cell(g: pd.DataFrame, not_copy_bound: bool = False) -> str:
    if not_copy_bound:
        return "not copy-bound (Speed targets)"
    big = g[(g.moved >= LARGE_BYTES) & g.frac_copy.notna()]
    if big.empty:
        return "-"
    low = big.loc[big.frac_copy.idxmin()]
    return (f"{100 * big.frac_copy.median():.0f} % (lowest {100 * low.frac_copy:.0f} %: {low.winner} "
            f"{low['problem'].split(',')[0]} {low['dtype']}; {_n(len(big), 'case')})")


def territories(df: pd.DataFrame) -> dict[str, list[str]]:
    """Per op, the territories its CUDA kernel defends on these rows and those it fails (``check``)."""
    if not set(CHECK_COLUMNS) <= set(df.columns):
        return {}
    out: dict[str, list[str]] = {}
    # the territories of kernels this process has (a catalogue trimmed by a caller has fewer): the others say nothing
    mine = [t for t in TERRITORIES if get_op(t.op).impls.get(t.impl) is not None]
    names = {t.name for t in mine}
    for f in check(df, territories=mine, retired={k: v for k, v in RETIRED.items() if k in names}):
        if f.kind == "defends":
            out.setdefault(f.op, []).append(f"{f.territory} ({_n(f.won, 'case')})")
        elif f.fails and f.territory:
            out.setdefault(f.op, []).append(f"{f.territory} **fails: {f.kind}**")
    return out


def summary(w: pd.DataFrame, df: pd.DataFrame, not_copy_bound: dict[str, str] | None = None) -> list[str]:
    """Markdown lines: the picture, then one row per op (wins per tier, ties, the winners' copy fraction per mode
    over the large cases, the territories its CUDA kernel defends). ``not_copy_bound``: ops whose limit is not the
    copy bandwidth (op -> why, from the speed targets' exceptions): no copy fraction is printed for them."""
    not_copy_bound = not_copy_bound or {}
    if w.empty:
        return ["## Summary", "", "No case has a correct timed implementation."]
    w = copy_fractions(w, df)
    modes = list(dict.fromkeys(w["mode"]))
    defended = territories(df)
    lines = ["## Summary", "", "![winning tier per case](winners.png)", "",
             "| op | cases | " + " | ".join(TIERS) + " | ties | "
             + " | ".join(f"winners' % of copy, {m}" for m in modes) + " | CUDA defends |",
             "|---|---|" + "---|" * len(TIERS) + "---|" + "---|" * len(modes) + "---|"]
    for op, g in w.groupby("op", sort=False):
        counts = g.tier.value_counts()
        lines.append(f"| [{op}](cases.md#{op}) | {len(g)} | " + " | ".join(str(int(counts.get(t, 0))) for t in TIERS)
                     + f" | {int(g.tie.sum())} | "
                     + " | ".join(_copy_cell(g[g["mode"] == m], op in not_copy_bound) for m in modes)
                     + f" | {'; '.join(defended.get(op, [])) or '-'} |")
    counts = w.tier.value_counts()
    lines += ["", f"{len(w)} cases: " + ", ".join(f"{t} wins {int(counts.get(t, 0))}" for t in TIERS)
              + f"; {int(w.tie.sum())} are a tie (the runner-up's p20-p80 overlaps the winner's). The % of copy is the "
              f"median over the cases moving at least {LARGE_BYTES >> 20} MiB of the winner's bytes moved over its "
              "kernel time, against the copy bandwidth measured in the same run; "
              "a territory is a region where a CUDA kernel must beat the compiler tiers by its margin "
              "(`tiered-ops check`); the picture outlines the cells a CUDA kernel wins inside one."]
    if left := [f"No copy fraction for {op}: {why}." for op, why in not_copy_bound.items() if op in set(w.op)]:
        lines += ["", *left]
    return lines


def margin_label(margin: float, tie: bool) -> str:
    """The text of a cell of the picture: the margin over the runner-up, or ``tie``."""
    return "tie" if tie else "-" if margin != margin or math.isinf(margin) else f"{margin:.2f}x"


def row_labels(cases: list[tuple[str, str]]) -> list[str]:
    """The picture's row labels for (op, problem) pairs: the op and the shape, with the parameters that tell apart
    two problems of one op and one shape (uniform and power-law segment lengths, broadcast operands)."""
    def parts(problem: str) -> list[str]:
        return problem.split(",")

    out = []
    for op, problem in cases:
        shape = parts(problem)[0]
        twins = [parts(q) for o, q in cases if o == op and parts(q)[0] == shape]
        if len(twins) == 1:
            out.append(f"{op} {shape}")
            continue
        shared = set.intersection(*(set(t[1:]) for t in twins))
        extra = ",".join(x for x in parts(problem)[1:] if x not in shared)
        out.append(f"{op} {shape} {extra[:28]}".rstrip())
    return out


def in_territory(w: pd.DataFrame) -> list[bool]:
    """Per winner (``analysis.winners``), whether it is a CUDA kernel inside a territory it holds (declared, not
    retired): the picture outlines those cells."""
    held = [t for t in TERRITORIES if t.name not in RETIRED]
    out = []
    for r in w.itertuples():
        mine = [t for t in held if t.op == r.op and t.impl == r.winner] if r.tier == "cuda" else []
        try:
            rows, row_len = rows_and_len(r.op, r.problem) if mine else (0, 0)
        except ValueError:
            mine = []
        out.append(any(t.contains(rows, row_len, r.dtype, r.mode, "eager", r.problem) for t in mine))
    return out
