"""The compiled-context decisions a GPU store's rows give, on any machine: per (op, problem, dtype, mode) measured
inside a compiled caller, what this tree picks from them (``measured_compiled``: training by kernel time, inference by
caller time) beside the pick by caller time alone, with each implementation's kernel and host time.

No gate runs and nothing is measured: each implementation counts as available on the store's device, and rows count
where their source is the current one (as ``_decide`` reads them).

    bash scripts/gpu_state.sh 11799ea:reports/nvidia-h100/models/store-ad1e7a0.sqlite   # the store, from history
    python benchmarks/compiled_picks.py .gpu_state/11799ea/reports/nvidia-h100/models/store-ad1e7a0.sqlite \
        --mode fwd+bwd
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiered_ops.decide.choice import _decide, measured_compiled  # noqa: E402
from tiered_ops.registry import DTYPES, Impl  # noqa: E402
from tiered_ops.store.store import Store  # noqa: E402
from tiered_ops.tiers.catalog import get_op  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", help="a GPU store (SQLite; read, never written)")
    ap.add_argument("--mode", help="one mode (default: every mode measured in a compiled caller)")
    args = ap.parse_args()
    Impl.why_not = lambda self, device, dtype=None: None  # type: ignore[method-assign]  # the store's device's
    print("op | problem | dtype | mode | this tree | by caller time | kernel / host us per implementation")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "store.sqlite"
        shutil.copy(args.store, copy)  # the store may need a migration: never written in place
        where = "context = 'compiled'" + (" and mode = ?" if args.mode else "")
        with contextlib.closing(sqlite3.connect(copy)) as db:
            keys = db.execute(f"select distinct op, bucket, dtype, device_key, mode from measurements where {where} "
                              "order by op, bucket", (args.mode,) if args.mode else ()).fetchall()
        store = Store(str(copy))
        for op, bucket, dtype, device_key, mode in keys:
            rows = store.latest(op, bucket, dtype, device_key, mode, context="compiled")  # as a decision reads them
            spec, dev, dt = get_op(op), torch.device("cuda"), DTYPES[dtype]
            mine = _decide(spec, measured_compiled(rows, mode)[0], dt, dev, "fastest", None, store)[0].name
            by_caller = _decide(spec, rows, dt, dev, "fastest", None, store)[0].name
            times = ", ".join(f"{r['impl']} {r['p50_us']:.1f} / {r['host_us']:.1f}" for r in rows
                              if r["p50_us"] is not None and r["host_us"] is not None)
            print(f"{op} | {rows[0]['problem']} | {dtype} | {mode} | {mine} | {by_caller} | {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
