"""A fleet in miniature: two tuning processes, one per GPU, share one PostgreSQL store; a third reads what they decided.

One PostgreSQL server (started here from the server binaries on PATH, as the tests start theirs: tests/pgserver.py;
or given with ``--db URL``) holds the store. ``--procs`` processes (default 2) start together, process i on device
i of ``--devices`` (default: ``cuda:i`` of the visible GPUs; one GPU: every process on cuda:0; no GPU: every process
on the CPU), each tuning a DIFFERENT set of buckets: the ops of ``--ops`` are dealt out among them (process i takes
ops i, i + procs, ...), each at its first ``--per-op`` default problems, every call a blocking first call
(``select_backend(..., tune=True)``, as a model's first call of the op with tuning on). Then a third process reads
every decision with tuning off (``TIERED_OPS_TUNE=0``) and counts what it measured: once on each of
``--reader-devices`` (default: each device the tuning processes used, one after the other: on two GPUs, the reader on
cuda:0 reads what was decided on cuda:1 and the other way round).

Checked and written under ``--out`` (fleet.csv: one row per case and process; fleet.md: the summary):
- lost: a case a tuning process did not decide, or whose decision a reader does not find stored (the reader's
  pick differs from the tuner's, or the reader falls back to "no stored decision");
- made twice: a bucket both tuning processes measured, or a (bucket, implementation) timed more than once (rows of
  distinct timings: a gate's outcome stored as a second row of the same timing is one measurement);
- per tuning process, the measurements it made itself and the rows its buckets hold (on a GPU, blocking tuning hands a
  missing bucket to background tuning's worker by default, TIERED_OPS_BLOCKING_ASIDE: there the rows tell);
- the reader's measurements: the measuring calls it made plus the rows the store gained while it ran (both 0).
Exit status 1 on any loss, any duplicate or any measurement by the reader.

    python benchmarks/fleet.py --out DIR [--db postgresql://...] [--ops softmax,gelu,rms_norm,layer_norm]
        [--per-op 2] [--devices cuda:0,cuda:1] [--reader-devices cuda:1] [--impls eager,triton] [--shapes 8x64,16x64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from contended_tuning import start_together  # noqa: E402  (the same barrier as the contended-tuning benchmark)


def devices_for(procs: int, given: str | None) -> tuple[list[str], str]:
    """Each tuning process's device and a note of how they were chosen."""
    if given:
        devs = given.split(",")
        return [devs[i % len(devs)] for i in range(procs)], f"devices given: {given}"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return ["cpu"] * procs, "no GPU: every process on the CPU"
    if n < procs:
        return [f"cuda:{i % n}" for i in range(procs)], f"{n} GPU(s) for {procs} processes: they share cuda:0.." \
                                                        f"{n - 1} (process i on cuda:i mod {n})"
    return [f"cuda:{i}" for i in range(procs)], f"{n} GPUs: process i on cuda:i"


def plan(ops: list[str], procs: int, per_op: int, shapes: list[str] | None, device_type: str) -> list[list[dict]]:
    """The cases of each tuning process: the ops dealt out among them, so no two share a bucket."""
    from tiered_ops.tiers.catalog import get_op

    out: list[list[dict]] = [[] for _ in range(procs)]
    for k, op in enumerate(ops):
        spec = get_op(op)
        problems = ([spec.problem(tuple(int(x) for x in s.split("x"))) for s in shapes] if shapes
                    else spec.default_problems(device_type)[:per_op])
        out[k % procs] += [dict(op=op, shape=list(p.shape), kw=dict(p.kw)) for p in problems]
    return out


def _counting(impls: list[str] | None) -> Counter:
    """Keep only ``impls`` of every op (where given) and count the measuring calls per (op, bucket) from now on."""
    import tiered_ops.decide.claimed as claimed
    import tiered_ops.decide.decide as decide
    from tiered_ops.measure.measure import bucket_str
    from tiered_ops.tiers.catalog import all_ops

    if impls:
        for spec in all_ops():
            spec.impls = {k: v for k, v in spec.impls.items() if k in impls}
    counts: Counter = Counter()

    def wrap(measure: Any) -> Any:
        def counted(store: Any, spec: Any, impl: Any, problem: Any, *a: Any, **k: Any) -> dict:
            counts[(spec.name, bucket_str(spec.bucket(problem)))] += 1
            return measure(store, spec, impl, problem, *a, **k)
        return counted

    decide.measure_kept = wrap(decide.measure_kept)
    claimed.measure_kept = wrap(claimed.measure_kept)
    return counts


def worker(args: argparse.Namespace) -> int:
    """One process: tune (or, with --read, read) every case of --cases on --device, one JSON line per case."""
    import tiered_ops.decide.decide as decide

    counts = _counting(args.impls.split(",") if args.impls else None)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    todo = json.loads(Path(args.cases).read_text())
    start_together(args.ready)
    for c in todo:
        t0 = time.perf_counter()
        before = sum(counts.values())
        sel = decide.select_backend(c["op"], tuple(c["shape"]), dtype, dev, tune=not args.read, **c["kw"])
        r = sel.record
        print("CASE " + json.dumps(dict(op=c["op"], shape=c["shape"], bucket=r["bucket"], chosen=r["chosen"],
                                        stored=bool(r["candidates"]), reason=r["reason"], device=str(dev),
                                        measured=sum(counts.values()) - before, pid=os.getpid(),
                                        seconds=time.perf_counter() - t0)), flush=True)
    return 0


def _start(args: argparse.Namespace, cases: list[dict], device: str, tag: str, out: Path, env: dict[str, str],
           ready: list[Path], read: bool = False) -> subprocess.Popen:
    case_file = out / f"cases_{tag}.json"
    case_file.write_text(json.dumps(cases))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--cases", str(case_file), "--device", device]
    cmd += (["--impls", args.impls] if args.impls else []) + (["--read"] if read else [])
    cmd += ["--ready", *map(str, ready)] if ready else []
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(out / f"{tag}.log", "w"), text=True, env=env)


def _collect(p: subprocess.Popen, tag: str) -> tuple[list[dict], int]:
    out, _ = p.communicate()
    return [dict(json.loads(line[5:]), process=tag) for line in out.splitlines() if line.startswith("CASE ")], \
        p.returncode


def _server(args: argparse.Namespace) -> tuple[str, Any]:
    """The store's URL: --db, else a fresh database of a server started here (stopped at exit)."""
    if args.db:
        return args.db, None
    sys.path.insert(0, str(ROOT / "tests"))
    import pgserver  # the tests' PostgreSQL server: initdb + pg_ctl in a temporary folder, as another user under root

    why = pgserver.missing()
    if why:
        raise SystemExit(f"fleet: no PostgreSQL server to start ({why}); give one with --db postgresql://...")
    server = pgserver.Server()
    server.start()
    return server.url(server.new_database()), server


def stored(url: str) -> tuple[Counter, dict[tuple, int]]:
    """The rows stored per (op, bucket), and each (op, bucket, dtype, mode, context, device, implementation) stored
    more than once (whoever measured it: the tuning process, or on a GPU background tuning's worker it hands the bucket
    to)."""
    from tiered_ops.store.store import Store

    store = Store(url)
    try:
        rows = store.rows()
    finally:
        store.close()
    return Counter((r["op"], r["bucket"]) for r in rows), measured_twice(rows)


TIMING = ("p20_us", "p50_us", "p80_us", "caller_us")


def measured_twice(rows: list[dict]) -> dict[tuple, int]:
    """Each (op, bucket, dtype, mode, context, device, implementation) timed more than once: its rows' distinct
    timings. A row stored again with the timing it had (background tuning times a compiled tier ungated, then stores
    its gate's outcome as a second row of the same timing) is one measurement; a launch-bound bucket's host times taken
    again side by side (``recheck``'s origin) are a second look by design, not a second decision."""
    from tiered_ops.measure.recheck import ORIGIN

    timings: dict[tuple, set] = {}
    for r in rows:
        if str(r.get("origin") or "").startswith(ORIGIN):
            continue
        key = (r["op"], r["bucket"], r["dtype"], r["mode"], r["context"], r["device_key"], r["impl"])
        timings.setdefault(key, set()).add(tuple(r.get(c) for c in TIMING))
    return {k: len(v) for k, v in timings.items() if len(v) > 1}


def row_count(url: str) -> int:
    from tiered_ops.store.store import Store

    store = Store(url)
    try:
        return store.count()
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="where fleet.csv, fleet.md and the processes' logs go")
    p.add_argument("--db", help="a postgresql:// URL (default: start a server from the binaries on PATH)")
    p.add_argument("--procs", type=int, default=2, help="tuning processes (default 2)")
    p.add_argument("--ops", default="softmax,gelu,rms_norm,layer_norm", help="dealt out among the processes")
    p.add_argument("--per-op", type=int, default=2, help="default problems per op")
    p.add_argument("--shapes", help="comma-separated RxC shapes for every op instead of its default problems")
    p.add_argument("--devices", help="comma-separated devices of the tuning processes (default: one GPU each)")
    p.add_argument("--reader-devices", help="comma-separated devices, one reading process on each in turn (default: "
                                            "each device of the tuning processes)")
    p.add_argument("--impls", help="keep only these implementations of every op (e.g. eager,triton)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--read", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--ready", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.out:
        p.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    devs, note = devices_for(args.procs, args.devices)
    readers = args.reader_devices.split(",") if args.reader_devices else list(dict.fromkeys(devs))
    cases = plan(args.ops.split(","), args.procs, args.per_op, args.shapes.split(",") if args.shapes else None,
                 torch.device(devs[0]).type)
    t0 = time.perf_counter()
    url, server = _server(args)
    print(f"fleet: {note}; {sum(map(len, cases))} case(s) in {args.procs} processes; store {url}", flush=True)
    try:
        from tiered_ops.store.store import Store

        Store(url).close()  # the schema once, before the processes race for it
        t_server = time.perf_counter() - t0
        env = dict(os.environ, TIERED_OPS_DB=url, PYTHONPATH=os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        env.pop("TIERED_OPS_RETIME_S", None)
        ready = [out / f"tune{i}.ready" for i in range(args.procs)]
        for f in ready:
            f.unlink(missing_ok=True)
        t1 = time.perf_counter()
        procs = [_start(args, cases[i], devs[i], f"tune{i}", out, dict(env, TIERED_OPS_TUNE="1"),
                         [ready[i]] + [r for r in ready if r != ready[i]] if args.procs > 1 else [])
                 for i in range(args.procs)]
        tuned, failed = [], []
        for i, pr in enumerate(procs):
            got, rc = _collect(pr, f"tune{i}")
            tuned.append((got, time.perf_counter() - t1))
            if rc:
                failed.append(f"tune{i} exit {rc} (see {out / f'tune{i}.log'})")
        t_tune = time.perf_counter() - t1
        everything = [c for cs in cases for c in cs]
        reads = []
        for j, dev in enumerate(readers):
            rows_before, t2 = row_count(url), time.perf_counter()
            pr = _start(args, everything, dev, f"read{j}", out, dict(env, TIERED_OPS_TUNE="0"), [], read=True)
            got, rc = _collect(pr, f"read{j}")
            reads.append((dev, got, row_count(url) - rows_before, time.perf_counter() - t2))
            if rc:
                failed.append(f"read{j} exit {rc} (see {out / f'read{j}.log'})")
        t_read = time.perf_counter() - t1 - t_tune
        per_bucket, twice_rows = stored(url)
    finally:
        if server is not None:
            server.stop()
    return summarize(out, args, note, cases, tuned, reads, per_bucket, twice_rows, failed,
                     dict(server_s=t_server, tune_s=t_tune, read_s=t_read, total_s=time.perf_counter() - t0))


def summarize(out: Path, args: argparse.Namespace, note: str, cases: list[list[dict]],
              tuned: list[tuple[list[dict], float]], reads: list[tuple[str, list[dict], int, float]],
              per_bucket: Counter, twice_rows: dict, failed: list[str], times: dict[str, float]) -> int:
    """Check and write fleet.csv and fleet.md; the exit status."""
    import pandas as pd

    decided = {(d["op"], d["bucket"]): d for got, _ in tuned for d in got}
    lost = [f"tune{i}: {c['op']} {c['shape']} not decided" for i, cs in enumerate(cases)
            for c in cs[len(tuned[i][0]):]]
    for dev, read, _, _ in reads:
        seen = {(d["op"], d["bucket"]): d for d in read}
        lost += [f"{k[0]} {k[1]}: tuner chose {d['chosen']} on {d['device']}, reader on {dev} "
                 + (f"chose {seen[k]['chosen']}" if k in seen and seen[k]["stored"] else "found nothing stored")
                 for k, d in decided.items()
                 if k not in seen or not seen[k]["stored"] or seen[k]["chosen"] != d["chosen"]]
    by_proc = [{(d["op"], d["bucket"]) for d in got if d["measured"]} for got, _ in tuned]
    twice = sorted({k for i, a in enumerate(by_proc) for b in by_proc[i + 1:] for k in a & b})
    twice_txt = [f"{k[0]} {k[1]}: measured by more than one process" for k in twice]
    twice_txt += [f"{' '.join(map(str, k))}: timed {v} times" for k, v in sorted(twice_rows.items())]
    reader_measured = sum(d["measured"] for _, read, _, _ in reads for d in read)
    gained = sum(g for _, _, g, _ in reads)
    pd.DataFrame([d for got, _ in tuned for d in got] + [d for _, read, _, _ in reads for d in read]
                 ).to_csv(out / "fleet.csv", index=False)
    lines = [f"# fleet: {args.procs} tuning processes and a reader on one PostgreSQL store", "",
             f"{note}; readers on {', '.join(d for d, _, _, _ in reads)}; ops {args.ops}"
             + (f"; implementations {args.impls}" if args.impls else ""), "",
             "| process | device | cases | buckets measured here | measurements here | rows of its buckets "
             "| seconds (end) |",
             "|---|---|---|---|---|---|---|"]
    for i, (got, end) in enumerate(tuned):
        lines.append(f"| tune{i} | {got[0]['device'] if got else '-'} | {len(got)} of {len(cases[i])} | "
                     f"{len(by_proc[i])} | {sum(d['measured'] for d in got)} | "
                     f"{sum(per_bucket[k] for k in {(d['op'], d['bucket']) for d in got})} | {end:.1f} |")
    for j, (dev, read, rows, seconds) in enumerate(reads):
        lines.append(f"| read{j} | {dev} | {len(read)} of {sum(map(len, cases))} | - | "
                     f"{sum(d['measured'] for d in read)} | +{rows} while it ran | {seconds:.1f} (alone) |")
    lines += ["", f"decisions lost: {len(lost)}", *[f"- {x}" for x in lost],
              f"decisions made twice: {len(twice_txt)}", *[f"- {x}" for x in twice_txt],
              f"readers' measurements: {reader_measured} calls, {gained} rows gained",
              *[f"failed: {x}" for x in failed], "",
              "wall: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())]
    text = "\n".join(lines) + "\n"
    (out / "fleet.md").write_text(text)
    print(text)
    bad = lost or twice_txt or reader_measured or gained or failed
    print(f"fleet: {'FAILED' if bad else 'ok'} ({out / 'fleet.md'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
