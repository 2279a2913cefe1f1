"""Replay a regret grid's tuning-off picks offline, on any machine: what this tree's nearest-bucket prediction picks
at each point of ``benchmarks/grid.csv`` from a GPU sweep's store, against the picks the grid run recorded, each
judged by the grid's own timings (``tiered_ops.analysis.targets.regrets``). With ``--tuned``, the tuning-on picks
instead: what this tree's policy picks from the tuning's own rows of each point (the grid run's ``tuned.csv``).

No gate runs and nothing is measured: each implementation's rows count where their source is the one the grid run
measured (its ``source_hash`` in grid.csv), every implementation counts as available on the store's device, and the
pick is the fastest policy's over the predicted rows. A point whose prediction would be read from another dtype or
other flags is gated on first use by a real call; here it is taken as it is. The grid run decided from its own
copy of the store, which holds more than the sweep's (the GPU script's targets stage tunes the dispatch table's
buckets into it first: cross_entropy 1x4096 was the nearest bucket of 1x32000 there), so a point may differ from the
recorded pick for that reason alone. Compare the replays of two trees (run this file at each), not a replay with the
recorded picks: that says how the prediction moved, not what a run on the GPU will read.

    bash scripts/gpu_state.sh 11799ea:reports/nvidia-h100/sweep-5454260/store.sqlite.xz   # a superseded sweep's
    git restore --source=11799ea -- reports/nvidia-h100/targets/tree-5454260           # store and grid, from history
    python benchmarks/replay_picks.py --store .gpu_state/11799ea/reports/nvidia-h100/sweep-5454260/store.sqlite \
        --targets reports/nvidia-h100/targets/tree-5454260
    python benchmarks/replay_picks.py --tuned --targets reports/nvidia-h200/targets
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

from tiered_ops.analysis.analysis import latest
from tiered_ops.analysis.targets import regret_summary, regrets
from tiered_ops.decide.choice import _decide
from tiered_ops.decide.predict import nearest_rows
from tiered_ops.registry import DTYPES, Impl, OpSpec
from tiered_ops.store.store import Store
from tiered_ops.sweep.live import grid_problem, load_grid
from tiered_ops.tiers.catalog import get_op


def _count_rows_the_grid_measured(grid: pd.DataFrame) -> None:
    """Rows count where their source is the one the grid run measured; every implementation is available."""
    measured = {(o, i): h for o, i, h in zip(grid.op, grid.impl, grid.source_hash)}
    OpSpec.fresh_impl = lambda self, row: (  # type: ignore[method-assign]
        self.impls.get(row["impl"]) if measured.get((self.name, row["impl"])) == row["source_hash"] else None)
    Impl.why_not = lambda self, device, dtype: None  # type: ignore[method-assign]


def replay(store: Store, device_key: str, grid: pd.DataFrame, picks: pd.DataFrame, points_csv: str) -> pd.DataFrame:
    """``picks`` with ``selected`` replaced by this tree's tuning-off pick at each point."""
    _count_rows_the_grid_measured(grid)
    points = {(pt.op, str(grid_problem(pt.op, pt.shape, pt.params)), pt.dtype, pt.mode): pt
              for pt in load_grid(points_csv)}
    out = []
    for r in picks.itertuples():
        pt = points[(r.op, r.problem, r.dtype, r.mode)]
        spec, problem, dtype = get_op(r.op), grid_problem(pt.op, pt.shape, pt.params), DTYPES[r.dtype]
        near = nearest_rows(store, spec, problem, dtype, r.dtype, device_key, r.mode)
        out.append("eager" if near is None else
                   _decide(spec, near.rows, dtype, torch.device("cuda"), "fastest", None, store)[0].name)
    return picks.assign(selected=out)


def replay_tuned(grid: pd.DataFrame, picks: pd.DataFrame, tuned: pd.DataFrame) -> pd.DataFrame:
    """``picks`` with ``tuned`` replaced by this tree's pick from the tuning's own newest rows of each point; a point
    the tuning stored no rows of (decided from the sweep's rows already in the store) keeps its recorded pick."""
    _count_rows_the_grid_measured(grid)
    rows, out = latest(tuned), []
    for r in picks.itertuples():
        g = rows[(rows.op == r.op) & (rows.problem == r.problem) & (rows.dtype == r.dtype) & (rows["mode"] == r.mode)]
        recs = g.astype(object).where(g.notna(), None).to_dict("records")  # NaN as None, as the store gives them
        out.append(_decide(get_op(r.op), recs, DTYPES[r.dtype], torch.device("cuda"), "fastest", None, None)[0].name
                   if recs else r.tuned)
    return picks.assign(tuned=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", help="the sweep's store the grid run decided from (read, not written; tuning off)")
    p.add_argument("--targets", required=True, help="the grid run's folder: grid.csv and picks.csv (and tuned.csv)")
    p.add_argument("--points", default="benchmarks/grid.csv", help="the grid's points")
    p.add_argument("--tuned", action="store_true", help="replay the tuning-on picks from the grid run's tuned.csv")
    args = p.parse_args(argv)
    if not args.tuned and not args.store:
        p.error("--store is needed to replay the tuning-off picks (or --tuned for the tuning-on ones)")
    grid = pd.read_csv(Path(args.targets) / "grid.csv")
    picks = pd.read_csv(Path(args.targets) / "picks.csv")
    col, regret_col = ("tuned", "regret_tuned") if args.tuned else ("selected", "regret")
    if args.tuned:
        new = replay_tuned(grid, picks, pd.read_csv(Path(args.targets) / "tuned.csv"))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "store.sqlite"
            shutil.copy(args.store, copy)  # the store may need a migration: never written in place
            device_key = sqlite3.connect(copy).execute("select device_key from measurements limit 1").fetchone()[0]
            new = replay(Store(str(copy)), device_key, grid, picks, args.points)
    before = {(x["op"], x["problem"], x["dtype"]): x for x in regrets(grid, picks)}
    for x in regrets(grid, new):
        b = before[(x["op"], x["problem"], x["dtype"])]
        if b[col] != x[col]:
            print(f"{x['op']:<20} {x['problem'][:36]:<36} {x['dtype']:<5} {b[col]} {b[regret_col]:.3f} -> "
                  f"{x[col]} {x[regret_col]:.3f}")
    for name, table in (("the grid run's picks", picks), ("replayed", new)):
        n, geo, worst = regret_summary(grid, table, tuned=args.tuned)
        print(f"{name}: {n} points, geomean {geo:.3f}, max {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
