"""Ranks tuning together against one process alone: do decisions made under load match decisions made alone?

``--procs`` processes (default 8, as the ranks of a job on one host) start together on one fresh store and call
``select_backend`` with tuning on for the same cases (each op's first ``--per-op`` default problems, inference;
bf16 on a GPU, fp32 on a CPU), each rank starting at its own offset in the list so that they miss overlapping buckets
at once. Rank r runs on GPU r mod the GPUs seen (``--same-gpu``: all on GPU 0). Then one process alone tunes the same
cases on a fresh store of its own. Then, where any rank's decision was provisional (timings taken on a busy machine:
``tiered_ops.decide.choice``), one quiet process re-times them on the shared store (``TIERED_OPS_RETIME_S=0``),
and the decisions are compared again.

Printed per case: the ranks' decisions, the process alone's, whether they are equal, and where not, the regret (the
alone process's caller time of the ranks' pick over its own pick's); then how many times each bucket was measured on
the shared store (once each is the target: one process measures a bucket, the others read its rows), how many
decisions were provisional, and the seconds each phase took. ``--csv`` writes one long-format row per case and phase.
Exit status 1 where a decision after the quiet re-time differs from the alone process's by more than a tie.

    python benchmarks/contended_tuning.py [--procs 8] [--ops softmax,rms_norm] [--per-op 2] [--csv out.csv]
        [--store-dir DIR] [--same-gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import all_ops, get_op

TIE = 1.05  # a pick within 5 % of the alone process's pick (its caller time there) counts as a tie, not a miss


def cases(ops: list[str], per_op: int, device_type: str) -> list[dict[str, Any]]:
    """Each op's first ``per_op`` default problems as JSON-able cases (op, shape, kw)."""
    out = []
    for op in ops:
        for p in get_op(op).default_problems(device_type)[:per_op]:
            out.append(dict(op=op, shape=list(p.shape), kw={k: v for k, v in p.kw.items()}))
    return out


def start_together(ready: list[str] | None) -> None:
    """A barrier between processes started at once: touch the first file, wait until every other one exists."""
    if ready:
        Path(ready[0]).touch()
        while not all(Path(p).exists() for p in ready[1:]):
            time.sleep(0.01)


def worker(args: argparse.Namespace) -> int:
    """One rank: tune every case (from its offset on), print one JSON line per decision."""
    import tiered_ops.decide.decide as decide

    todo = json.loads(Path(args.cases).read_text())
    rank, n = args.rank, max(1, args.of)
    todo = todo[rank * len(todo) // n:] + todo[:rank * len(todo) // n]
    if torch.cuda.is_available():
        dev = torch.device("cuda", 0 if args.same_gpu else rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    start_together(args.ready)
    for c in todo:
        t0 = time.perf_counter()
        sel = decide.select_backend(c["op"], tuple(c["shape"]), dtype, dev, tune=True, **c["kw"])
        r = sel.record
        print("CASE " + json.dumps(dict(op=c["op"], bucket=r["bucket"], chosen=r["chosen"],
                                        provisional=r.get("provisional"), seconds=time.perf_counter() - t0,
                                        candidates={x["impl"]: x["caller_us"] for x in r["candidates"]})), flush=True)
    return 0


def run_ranks(script: Path, store: str, case_file: Path, n: int, same_gpu: bool, env: dict[str, str],
              tmp: Path, tag: str) -> tuple[list[list[dict]], float]:
    ready = [tmp / f"{tag}{i}.ready" for i in range(n)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(script), "--worker", "--rank", str(i), "--of", str(n),
                               "--cases", str(case_file)] + (["--same-gpu"] if same_gpu else [])
                              + (["--ready", str(ready[i])] + [str(p) for p in ready if p != ready[i]] if n > 1
                                 else []),
                              stdout=subprocess.PIPE, text=True, env=dict(env, TIERED_OPS_DB=store)) for i in range(n)]
    outs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
        outs.append([json.loads(line[5:]) for line in out.splitlines() if line.startswith("CASE ")])
    return outs, time.perf_counter() - t0


def compare(together: list[list[dict]], alone: list[dict]) -> list[dict[str, Any]]:
    """Per case: the ranks' picks, the alone process's, equal or a tie, the regret."""
    ref = {(d["op"], d["bucket"]): d for d in alone}
    picks: dict[tuple, Counter] = {}
    busy: Counter = Counter()
    for rank in together:
        for d in rank:
            picks.setdefault((d["op"], d["bucket"]), Counter())[d["chosen"]] += 1
            busy[(d["op"], d["bucket"])] += d["provisional"] is not None
    rows = []
    for key, got in picks.items():
        a = ref.get(key)
        if a is None:
            continue
        times = a["candidates"]
        regret = max((times.get(p) or float("nan")) / times[a["chosen"]] for p in got) if times.get(a["chosen"]) \
            else float("nan")
        rows.append(dict(op=key[0], bucket=key[1], ranks=dict(got), alone=a["chosen"], equal=set(got) == {a["chosen"]},
                         regret=regret, tie=regret <= TIE, provisional=busy[key]))
    return rows


def report(title: str, rows: list[dict[str, Any]], seconds: float) -> int:
    print(f"\n{title} ({seconds:.1f} s)")
    misses = 0
    for r in rows:
        ranks = ", ".join(f"{k} x{v}" for k, v in sorted(r["ranks"].items()))
        mark = "equal" if r["equal"] else f"tie (regret {r['regret']:.3f})" if r["tie"] else \
            f"MISS (regret {r['regret']:.3f})"
        misses += not r["equal"] and not r["tie"]
        print(f"  {r['op']} {r['bucket']}: ranks {ranks}; alone {r['alone']}: {mark}"
              + (f"; provisional at {r['provisional']} rank(s)" if r["provisional"] else ""))
    return misses


def measured_counts(store_path: str) -> Counter:
    store = Store(store_path)
    try:
        return Counter((r["op"], r["bucket"], r["impl"]) for r in store.rows())
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--ops", help="comma-separated ops (default: every op)")
    p.add_argument("--per-op", type=int, default=2, help="default problems per op")
    p.add_argument("--csv", help="write one row per case and phase")
    p.add_argument("--store-dir", help="where the stores go (default: a temporary directory)")
    p.add_argument("--same-gpu", action="store_true", help="every rank on GPU 0")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--ready", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    ops = args.ops.split(",") if args.ops else sorted(s.name for s in all_ops())
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = Path(args.store_dir or tempfile.mkdtemp(prefix="contended_tuning_"))
    tmp.mkdir(parents=True, exist_ok=True)
    case_file = tmp / "cases.json"
    case_file.write_text(json.dumps(cases(ops, args.per_op, dev_type)))
    shared, alone_store = str(tmp / "shared.sqlite"), str(tmp / "alone.sqlite")
    for path in (shared, alone_store):
        for f in Path(path).parent.glob(Path(path).name + "*"):
            f.unlink()
    env = dict(os.environ)
    env.pop("TIERED_OPS_RETIME_S", None)
    script = Path(__file__).resolve()
    print(f"{len(json.loads(case_file.read_text()))} case(s) of {len(ops)} op(s) on {dev_type}; stores in {tmp}")
    together, t_together = run_ranks(script, shared, case_file, args.procs, args.same_gpu, env, tmp, "r")
    [alone], t_alone = run_ranks(script, alone_store, case_file, 1, args.same_gpu, env, tmp, "a")
    rows = compare(together, alone)
    misses = report(f"{args.procs} ranks together against one process alone", rows, t_together)
    counts = measured_counts(shared)
    twice = {k: v for k, v in counts.items() if v > 1}
    print(f"\nshared store: {len(counts)} (bucket, implementation) measured, {len(twice)} more than once"
          + "".join(f"\n  {k[0]} {k[1]} {k[2]}: {v} rows" for k, v in sorted(twice.items())))
    alone_busy = [f"{d['op']} {d['bucket']}" for d in alone if d["provisional"]]
    print(f"one process alone: {t_alone:.1f} s; {len(alone_busy)} of its decisions provisional (the machine was busy "
          f"for it too: the comparison is not against a quiet machine's)" if alone_busy else
          f"one process alone: {t_alone:.1f} s, no decision provisional")
    out = [dict(r, phase="together") for r in rows]
    if any(r["provisional"] for r in rows):
        [after], t_after = run_ranks(script, shared, case_file, 1, args.same_gpu, dict(env, TIERED_OPS_RETIME_S="0"),
                                     tmp, "q")
        rows = compare([after], alone)
        misses = report("after one quiet re-time of the provisional decisions", rows, t_after)
        out += [dict(r, phase="after re-time") for r in rows]
    print(f"\n{misses} decision(s) differ from the process alone beyond a tie ({TIE:g} x)")
    if args.csv:
        import pandas as pd

        pd.DataFrame([dict(r, ranks=json.dumps(r["ranks"]), procs=args.procs, device=dev_type) for r in out]
                     ).to_csv(args.csv, index=False)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
