"""Two sweeps of the same cases side by side (e.g. one spread over two GPUs with ``--gpus all`` and one on one GPU):
how long each took, whether their times agree, and whether they pick the same winners.

    python benchmarks/compare_sweeps.py A/results.csv B/results.csv [--names two-gpus one-gpu] [--md out.md]
        [--without liger,quack]

Per sweep: its rows (the last stored per op, problem, dtype, mode, impl and context) and the span of their timestamps
(first to last stored measurement: the sweep's measuring time, without its start-up and export). For each row timed in
both sweeps, the ratio of their medians (A / B) and whether their p20-p80 ranges overlap. The decisions are
compared as the report's ``--repeat`` compares them (``tiered_ops.analysis.report.agreement``): the fastest correct
implementation as a caller sees it (kernel or host time, whichever bounds the call), a tie where the caller-side
p20-p80 ranges overlap, and only cases tied in neither sweep and timed with the same implementations counted.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import pandas as pd

from tiered_ops.analysis.report import agreement

KEY = ["op", "problem", "dtype", "mode", "impl", "context"]
CASE = ["op", "problem", "dtype", "mode", "context"]


def _latest(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (op, problem, dtype, mode, impl, context): the last stored (a gate or a host timing beside another
    implementation stores a row again)."""
    return df.sort_values("id").drop_duplicates(KEY, keep="last")


def _timed(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["p50_us"].notna()]


def _ran(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["ok"] == 1) & df["p50_us"].notna()]


def compare(a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str]) -> list[str]:
    lines = ["| sweep | implementations x cases x modes | timed | correct and timed | measuring span s |",
             "|---|---:|---:|---:|---:|"]
    for name, df in zip(names, (a, b)):
        span = df["timestamp"].max() - df["timestamp"].min()
        last = _latest(df)
        lines.append(f"| {name} | {len(last)} | {len(_timed(last))} | {len(_ran(last))} | {span:.0f} |")
    a, b = _latest(a), _latest(b)
    pairs = _timed(a).merge(_timed(b), on=KEY, suffixes=("_a", "_b"))
    ratios = (pairs["p50_us_a"] / pairs["p50_us_b"]).tolist()
    overlap = ((pairs["p20_us_a"] <= pairs["p80_us_b"]) & (pairs["p20_us_b"] <= pairs["p80_us_a"])).sum()
    lines.append("")
    if ratios:
        q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else [ratios[0]] * 9
        lines.append(f"{len(pairs)} rows timed in both: median time ratio {names[0]} / {names[1]} "
                     f"{statistics.median(ratios):.3f} (p10 {q[0]:.3f}, p90 {q[-1]:.3f}); p20-p80 ranges overlap in "
                     f"{overlap} of {len(pairs)}.")
    same, compared, differ = agreement(a, b)
    lines.append(f"Decisions (the fastest correct implementation as a caller sees it, as `tiered-ops report --repeat` "
                 f"compares them): the same in {same} of {compared} cases tied in neither sweep and timed with the "
                 f"same implementations in both.")
    lines += [f"- differs: {line} ({names[0]} then {names[1]}; margin: the runner-up's time over the winner's)"
              for line in differ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--names", nargs=2, default=["A", "B"])
    p.add_argument("--md", help="also write the lines here")
    p.add_argument("--without", default="", help="implementations left out of both (comma-separated: peers that "
                   "only one sweep carried, e.g. liger,quack)")
    args = p.parse_args(argv)
    drop = {s for s in args.without.split(",") if s}
    a, b = (df[~df["impl"].isin(drop)] for df in (pd.read_csv(args.a), pd.read_csv(args.b)))
    lines = compare(a, b, tuple(args.names))
    print("\n".join(lines))
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
