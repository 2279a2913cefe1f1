"""The compiled-model matrix side by side: the rows of one or more runs of benchmarks/compiled_models.py (its
compiled_models.csv, one per part) as one table, a line per (config, dtype, mode, workload), each variant's median
beside stock's, with the verdicts the runs wrote (models_rows' rules: faster or slower only beyond the spread with every
round agreeing; the tiered variants against stock and against the control, stock-copy, where it ran), the graph breaks
and recompiles of every variant, failures, and a count of what the acceptance asks: rows with a break, failed
variants, tiered rows slower than stock. Nothing is measured here; every number is a cell of the files read.

    python benchmarks/compiled_matrix.py part1.csv part2.csv part3.csv --names 1,2,3 --md matrix.md
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

KEY = ("config", "dtype", "mode", "workload")
TIERED = ("tiered", "tiered-next")


def rows(paths: list[Path], names: list[str]) -> dict[tuple, dict[str, dict]]:
    """(config, dtype, mode, workload) -> variant -> its CSV row (with ``part``: the name of the file it came from).
    A row present in two files is the later file's, all its variants (a rerun replaces the row it ran again: no row
    sets times from two runs side by side)."""
    out: dict[tuple, dict[str, dict]] = {}
    for path, name in zip(paths, names):
        mine: dict[tuple, dict[str, dict]] = {}
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                mine.setdefault(tuple(r[k] for k in KEY), {})[r["variant"]] = {**r, "part": name}
        out.update(mine)
    return out


def _ms(r: dict | None) -> float | None:
    try:
        return float(r["ms_p50"]) if r else None
    except (KeyError, ValueError):
        return None


def table(matrix: dict[tuple, dict[str, dict]]) -> tuple[list[str], dict[str, int]]:
    """Markdown lines of the side-by-side table and the counts (rows, broken rows, failed variants, slower rows)."""
    lines = ["| config | dtype | mode | workload | stock ms | stock-copy ms | tiered ms | speed-up | verdict (vs copy) "
             "| tiered-next ms | verdict (vs copy) | breaks | recompiles | part |",
             "|---|---|---|---|---:|---:|---:|---:|---|---:|---|---|---|---|"]
    counts = dict(rows=0, timed=0, broken=0, failed=0, slower=0, slower_than_copy_too=0)
    for key in sorted(matrix):
        v = matrix[key]
        counts["rows"] += 1
        stock, copy, tiered, nxt = (v.get(n) for n in ("stock", "stock-copy", "tiered", "tiered-next"))
        breaks = sum(int(r.get("graph_breaks") or 0) for r in v.values())
        failed = [n for n, r in v.items() if r.get("error")]
        counts["broken"] += breaks > 0
        counts["failed"] += len(failed)
        for n in TIERED:
            r = v.get(n)
            if r and r.get("verdict") == "slower":
                counts["slower"] += 1
                counts["slower_than_copy_too"] += r.get("verdict_vs_copy") == "slower"
        counts["timed"] += _ms(stock) is not None and _ms(tiered) is not None

        def cell(r: dict | None) -> str:
            return "" if _ms(r) is None else f"{_ms(r):.4g}"

        def verdict(r: dict | None) -> str:
            if not r:
                return ""
            if r.get("error"):
                return "failed: " + r["error"][:60]
            v_copy = f" ({r['verdict_vs_copy']} {r['rounds_slower_vs_copy']})" if r.get("verdict_vs_copy") else ""
            return f"{r.get('verdict') or 'not timed'} {r.get('rounds_slower') or ''}".strip() + v_copy

        up = f"{_ms(stock) / _ms(tiered):.2f}x" if _ms(stock) and _ms(tiered) else ""
        recompiles = "/".join(r.get("recompiles") or "" for r in v.values())
        part = ",".join(sorted({r["part"] for r in v.values()}))
        lines.append(f"| {' | '.join(key)} | {cell(stock)} | {cell(copy)} | {cell(tiered)} | {up} | {verdict(tiered)} "
                     f"| {cell(nxt)} | {verdict(nxt)} | {breaks} | {recompiles} | {part} |")
    return lines, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", type=Path, help="compiled_models.csv files, in order (a later one's rows win)")
    ap.add_argument("--names", help="comma-separated part names, one per file (default 1, 2, ...)")
    ap.add_argument("--md", type=Path, help="write the table here too")
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else [str(i + 1) for i in range(len(args.csv))]
    if len(names) != len(args.csv):
        ap.error(f"--names: {len(names)} names for {len(args.csv)} files")
    lines, counts = table(rows(args.csv, names))
    summary = (f"{counts['rows']} rows ({counts['timed']} timed with stock and tiered); rows with a graph break: "
               f"{counts['broken']}; failed variants: {counts['failed']}; tiered variants slower than stock: "
               f"{counts['slower']} (of them slower than the control too: {counts['slower_than_copy_too']})")
    text = "\n".join([summary, "", *lines]) + "\n"
    print(text, end="")
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
