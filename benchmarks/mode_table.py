"""GB/s of each tier per mode from a results CSV (``tiered-ops export``), as Markdown: one table per mode.

    python benchmarks/mode_table.py reports/nvidia-h200/results.csv [--modes fwd_nograd,fwd+bwd]

Every figure is a kernel median from that file; a cell is empty where the implementation failed the gate
(the reason is in the CSV) and marked * where it won its (problem, dtype, mode) on per-call time.
"""

from __future__ import annotations

import argparse

import pandas as pd

TIERS = ["eager", "eager_addcmul", "compile", "triton", "cuda"]


def tables(df: pd.DataFrame, modes: list[str]) -> str:
    df = df[df.impl.isin(TIERS)].copy()
    df["shape"] = df.problem.str.split(",").str[0]
    ok = df[(df.ok == 1) & df.caller_us.notna()]
    best = ok.loc[ok.groupby(["op", "problem", "dtype", "mode"]).caller_us.idxmin()]
    won = set(zip(best.op, best.problem, best.dtype, best["mode"], best.impl))
    out = []
    for mode in modes:
        m = df[df["mode"] == mode]
        impls = [t for t in TIERS if t in set(m.impl)]
        out += [f"### {mode} (GB/s; * = fastest per call)", "",
                "| op | shape | dtype | copy GB/s | " + " | ".join(impls) + " |",
                "|---|---|---|---|" + "---|" * len(impls)]
        for (op, problem, dtype), g in m.groupby(["op", "problem", "dtype"], sort=True):
            cells = []
            for impl in impls:
                r = g[g.impl == impl]
                if r.empty or r.iloc[0].ok != 1 or pd.isna(r.iloc[0].gbps):
                    cells.append("fails gate" if not r.empty and r.iloc[0].ok != 1 else "")
                    continue
                star = "*" if (op, problem, dtype, mode, impl) in won else ""
                cells.append(f"{r.iloc[0].gbps:.0f}{star}")
            copy = g.copy_gbps.dropna()
            out.append(f"| {op} | {problem.split(',')[0]} | {dtype} | {copy.iloc[0]:.0f} | " + " | ".join(cells) + " |"
                       if len(copy) else f"| {op} | {problem} | {dtype} | - | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--modes", default="fwd_nograd,fwd,bwd,fwd+bwd")
    a = p.parse_args()
    print(tables(pd.read_csv(a.csv), a.modes.split(",")))


if __name__ == "__main__":
    main()
