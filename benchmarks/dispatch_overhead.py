"""Per-call dispatch overhead: ``tiered_ops.<op>`` minus the chosen implementation called directly, and the same for
a cached ``select_backend`` callable, per op at its launch-bound shape (a GPU: one row of 4096 in bf16; a CPU: 4 x 64
fp32), median of many back-to-back calls. Target on the GPU host: <= 1.0 us. Decisions come from the store in use
(TIERED_OPS_TUNE=0: nothing is measured; eager where nothing is stored), so the direct call is whatever is chosen.

    python benchmarks/dispatch_overhead.py [--csv out.csv] [--ops rms_norm,softmax]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

os.environ.setdefault("TIERED_OPS_TUNE", "0")  # the overhead is timed here, not a measurement

import tiered_ops  # noqa: E402


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int, cuda: bool) -> float:
    """Median over ``repeats`` of the host time per call of ``calls`` back-to-back calls (synchronized at the end of
    each batch on a GPU, so a launch-bound call is timed at the rate the host issues it)."""
    for _ in range(50):
        fn()
    out = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(out)


def cases(dev: torch.device) -> dict[str, tuple[tuple, dict]]:
    """op -> (call arguments, select_backend parameters) at the launch-bound default."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n, rows = (4096, 1) if dev.type == "cuda" else (64, 4)
    x, r, w = (torch.randn(rows, n, device=dev, dtype=dt) for _ in range(3))
    w = w[0]
    t = torch.randint(0, n, (rows,), device=dev)
    return {
        "rms_norm": ((x, (n,), w, 1e-6), dict(normalized_shape=(n,))),
        "fused_add_rms_norm": ((x, r, (n,), w, 1e-6), dict(normalized_shape=(n,))),
        "layer_norm": ((x, (n,), w, w, 1e-5), dict(normalized_shape=(n,))),
        "softmax": ((x, -1), dict(dim=-1)),
        "gelu": ((x,), {}),
        "cross_entropy": ((x, t), {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", help="write the table here too")
    p.add_argument("--ops", help="comma-separated ops (default: all measured here)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    rows = []
    for op, (a, params) in cases(dev).items():
        if args.ops and op not in args.ops.split(","):
            continue
        if op not in tiered_ops.OPS:
            continue
        public = getattr(tiered_ops, op)
        x = a[0]
        with torch.no_grad():
            public(*a)  # the slow path once: the call is cached
            sel = tiered_ops.select_backend(op, tuple(x.shape), x.dtype, dev, **params)
            chosen = tiered_ops.decide.decide._calls.get(next((k for k in tiered_ops.decide.decide._calls if k[0] == op
                                                        and k[-1] == 0), None))
            direct = (chosen or sel).fn
            t_pub = per_call_us(lambda: public(*a), args.calls, args.repeats, cuda)
            t_dir = per_call_us(lambda: direct(*a), args.calls, args.repeats, cuda)
            t_sel = per_call_us(lambda: tiered_ops.select_backend(op, tuple(x.shape), x.dtype, dev, **params)(*a),
                                args.calls, args.repeats, cuda)
        rows.append(dict(op=op, shape="x".join(map(str, x.shape)), dtype=str(x.dtype).removeprefix("torch."),
                         device=dev.type, chosen=(chosen or sel).name, direct_us=round(t_dir, 3),
                         public_us=round(t_pub, 3), public_overhead_us=round(t_pub - t_dir, 3),
                         select_backend_overhead_us=round(t_sel - t_dir, 3)))
    head = f"{'op':<20} {'shape':>8} {'chosen':>10} {'direct us':>10} {'op-direct':>10} {'select-direct':>14}"
    print(head)
    for r in rows:
        print(f"{r['op']:<20} {r['shape']:>8} {r['chosen']:>10} {r['direct_us']:10.2f} {r['public_overhead_us']:10.2f} "
              f"{r['select_backend_overhead_us']:14.2f}")
    print("target on the GPU host: op-direct <= 1.0 us")
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
