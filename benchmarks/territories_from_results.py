"""The figures the CUDA territories rest on, from results files: per CUDA kernel and case, the best compiler tier's
time over the kernel's (ratio) and the bar it must clear (1 + margin + noise, as ``tiered-ops check`` judges it).

Run: python benchmarks/territories_from_results.py [--headroom 1.15] [results.csv ...] (default: the committed
reports/<gpu>/results.csv of the GPUs reports/gpus.toml names current, the evidence the territories are judged on).
It prints, per kernel, every case with its figures on each file and the territory it falls in; then each declared
territory with its verdict on each file; then the cases that clear their bar with room to spare (ratio >= headroom x
bar) on every file, outside every held territory: candidates for a territory after the next sweep. A territory is
worth declaring where its cases clear the bar with such room on every current GPU: the evidence is measured again
after each change, and a case that clears its bar by a few percent flips with one noisy host batch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiered_ops.analysis.check import cases  # noqa: E402
from tiered_ops.analysis.gpus import FILE_NAME, load  # noqa: E402
from tiered_ops.analysis.territories import RETIRED, TERRITORIES  # noqa: E402

_GPUS = load(ROOT / "reports" / FILE_NAME if (ROOT / "reports" / FILE_NAME).is_file() else None)
DEFAULT = sorted(str(p) for p in Path("reports").glob("*/results.csv") if _GPUS.is_current(p.parent.name))  # CI's


def judged(files: list[str]) -> pd.DataFrame:
    """Every fresh CUDA case of each file, with the file's name (its folder) and the territory it falls in."""
    out = []
    for f in files:
        c = cases(pd.read_csv(ROOT / f if not Path(f).is_absolute() else f)).assign(file=Path(f).parent.name)
        c["territory"] = [next((t.name for t in TERRITORIES if (t.op, t.impl) == (r.op, r.impl)
                                and t.contains(r.rows, r.row_len, r.dtype, r.mode, r.context)), "-")
                          for r in c.itertuples()]
        out.append(c)
    df = pd.concat(out, ignore_index=True)
    df["headroom"] = df.ratio / df.need
    return df


def _fig(r: pd.Series) -> str:
    if r.verdict in ("failed", "no-compiler"):
        return r.verdict
    apart = "" if pd.isna(r.apart_h) else f" (apart {r.apart_h:.0f} h)"
    return f"{r.ratio:.2f}/{r.need:.2f} {r.best_impl}{'' if r.verdict == 'wins' else ' ' + r.verdict}{apart}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*", default=DEFAULT)
    ap.add_argument("--headroom", type=float, default=1.15, help="ratio over bar a candidate case needs on every file")
    args = ap.parse_args(argv)
    df = judged(args.results)
    files = list(dict.fromkeys(df.file))
    key = ["op", "impl", "problem", "dtype", "mode", "context"]
    print("# Per case: best compiler tier time / CUDA time, over the bar (1 + margin + noise); verdict if not won;")
    print("# (apart N h): the two rows were timed N hours apart and one is launch-sensitive, so the ratio compares")
    print("# the hosts of two runs as much as the implementations (a sweep's side-by-side rounds time them together)\n")
    for (op, impl), g in df.groupby(["op", "impl"], sort=False):
        print(f"## {op} {impl}\n")
        print("| case | rows | row length | " + " | ".join(files) + " | min headroom | territory |")
        print("|---|---|---|" + "---|" * len(files) + "---|---|")
        for k, c in g.groupby(key, sort=False):
            per = {r.file: _fig(r) for _, r in c.iterrows()}
            r0 = c.iloc[0]
            where = f"{r0.problem} {r0['dtype']} {r0['mode']}" + ("" if r0.context == "eager" else f" {r0.context}")
            print(f"| {where} | {r0.rows} | {r0.row_len} | " + " | ".join(per.get(f, "-") for f in files)
                  + f" | {c.headroom.min():.2f} | {r0.territory}{' (retired)' if r0.territory in RETIRED else ''} |")
        print()
    print("# Territories\n")
    print("| territory | state | " + " | ".join(f"{f}: won / cases" for f in files) + " | min headroom |")
    print("|---|---|" + "---|" * len(files) + "---|")
    for t in TERRITORIES:
        g = df[df.territory == t.name]
        per = [f"{int((g[g.file == f].verdict == 'wins').sum())} / {int((g.file == f).sum())}" for f in files]
        state = "retired" if t.name in RETIRED else "held"
        print(f"| {t.name} | {state} | " + " | ".join(per) + f" | {_f(g.headroom.min())} |")
    print(f"\n# Candidates: cases at >= {args.headroom:.2f}x their bar on every file, outside every held territory\n")
    cand = df[~df.territory.isin([t.name for t in TERRITORIES if t.name not in RETIRED])]
    agg = cand.groupby(key, sort=False).agg(n=("file", "nunique"), low=("headroom", "min"),
                                            territory=("territory", "first"), compared=("compared", "min"),
                                            apart=("apart_h", "max"))
    agg = agg[(agg.n == len(files)) & (agg.low >= args.headroom)]
    for k, r in agg.iterrows():
        alone = "" if "," in r.compared else f"; compared with {r.compared} alone (the other compiler tier failed)"
        apart = "" if pd.isna(r.apart) else f"; against a row timed {r.apart:.0f} h apart (launch-sensitive)"
        print(f"- {k[0]} {k[1]} {k[2]} {k[3]} {k[4]} {k[5]}: min headroom {r.low:.2f} (now in {r.territory}){alone}"
              f"{apart}")
    if agg.empty:
        print("- none")


def _f(v: float) -> str:
    return "-" if v != v else f"{v:.2f}"


if __name__ == "__main__":
    main()
