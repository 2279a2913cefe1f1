"""How far apart the harness's caller times of one implementation land between processes, and why: the cases where
the regret grid's pick and its best differ are launch-bound (host time above kernel time), and a candidate's host time
read 12 us in one run and 22 us in the next. Each case is timed with the harness's own ``time_call`` (what a sweep
row holds: kernel p50, host time, caller time), in ``--procs`` fresh processes one after another (the order of the
implementations rotated), then in the same way with ``--load`` busy processes beside them (the CPU contention of
compile workers), then in one process over ``--rounds`` interleaved rounds. Usage (GPU machine):
    python3 scripts/diag/host_spread.py --procs 3 --load 12 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

CASES = [("layer_norm", "2000x768", "bf16"), ("layer_norm", "30000x1024", "fp16"), ("rms_norm", "1x2048", "bf16")]
IMPLS = ["eager", "compile", "triton", "cuda"]


def _child(order: list[str], rounds: int) -> None:
    import torch

    from tiered_ops.measure.measure import timed_call
    from tiered_ops.measure.timing import time_call
    from tiered_ops.registry import DTYPES
    from tiered_ops.tiers.catalog import get_op

    dev = torch.device("cuda")
    for op, shape, dt in CASES:
        spec = get_op(op)
        p = spec.problem(tuple(int(s) for s in shape.split("x")))
        inp = spec.make_inputs(p, DTYPES[dt], dev, 0)
        calls = {}
        for name in order:
            impl = spec.impls[name]
            calls[name] = timed_call(spec, impl, inp, "fwd_nograd")
            calls[name]()
            torch.cuda.synchronize()
            path = getattr(impl.unchecked or impl.fn, "__qualname__", repr(impl.unchecked or impl.fn))
            print(json.dumps({"case": f"{op} {shape} {dt}", "impl": name, "path": path[:60]}), flush=True)
        for r in range(rounds):
            for name in order:
                t = time_call(calls[name], dev)
                print(json.dumps({"case": f"{op} {shape} {dt}", "impl": name, "round": r, "p50": t.p50_us,
                                  "host": t.host_us, "caller": t.caller_us}), flush=True)


def _burn(stop: float) -> None:
    x = 0
    while time.time() < stop:
        x += 1


def _run(order: list[str], rounds: int) -> list[dict]:
    out = subprocess.run([sys.executable, __file__, "--child", ",".join(order), "--rounds", str(rounds)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        print(out.stderr[-2000:], file=sys.stderr)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--load", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if args.child:
        _child(args.child.split(","), args.rounds)
        return
    runs: list[tuple[str, list[dict]]] = []
    for i in range(args.procs):
        order = IMPLS[i % len(IMPLS):] + IMPLS[:i % len(IMPLS)]
        runs.append((f"proc{i}", _run(order, 1)))
    if args.load:
        stop = time.time() + 600
        burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.load)]
        for b in burners:
            b.start()
        try:
            for i in range(2):
                runs.append((f"load{args.load}-{i}", _run(IMPLS[i:] + IMPLS[:i], 1)))
        finally:
            for b in burners:
                b.terminate()
    runs.append((f"interleaved{args.rounds}", _run(IMPLS, args.rounds)))
    print(f"host {os.cpu_count()} CPUs; caller us (host us) per implementation, kernel p50 in brackets")
    for op, shape, dt in CASES:
        case = f"{op} {shape} {dt}"
        print(f"\n{case}")
        for label, rows in runs:
            cells = []
            for name in IMPLS:
                rs = [r for r in rows if r["case"] == case and r["impl"] == name and "host" in r]
                if not rs:
                    cells.append(f"{name}: -")
                    continue
                h = statistics.median(r["host"] for r in rs)
                c = statistics.median(r["caller"] for r in rs)
                k = statistics.median(r["p50"] for r in rs)
                spread = f" {min(r['host'] for r in rs):.1f}-{max(r['host'] for r in rs):.1f}" if len(rs) > 1 else ""
                cells.append(f"{name}: {c:.1f} ({h:.1f}{spread}) [{k:.1f}]")
            print(f"  {label:>14}: " + "; ".join(cells))
        paths = {r["impl"]: r["path"] for _, rows in runs for r in rows if r["case"] == case and "path" in r}
        print("  paths: " + "; ".join(f"{k}={v}" for k, v in paths.items()))


if __name__ == "__main__":
    main()
