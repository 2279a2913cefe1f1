"""Where ``tiered_ops.<op>`` spends its time over the implementation it calls, part by part, on a GPU host: for a few
implementations forced into the per-call cache (so the public call runs exactly them), the marginal host time per
call of (a) the public call, (b) the CUDA runtime's capture query, (c) the C++ call key alone, each over the
implementation called directly, in interleaved rounds of back-to-back calls; on the default stream and on a side
stream (where the C++ key asks the runtime whether the stream captures).

    python scripts/diag/dispatch_parts.py [--rounds 40] [--calls 200] [--csv out.csv]

Needs the CUDA extension built (``scripts/gpu.sh build``): the C++ key is part of it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("TIERED_OPS_TUNE", "0")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tiered_ops  # noqa: E402
from benchmarks.dispatch_overhead import interleaved  # noqa: E402  (its batches and rotated rounds)
from tiered_ops.runtime import dispatch  # noqa: E402
from tiered_ops.runtime.memo import _hot  # noqa: E402
from tiered_ops.tiers import cuda_ext  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--csv")
    args = ap.parse_args()
    dev = torch.device("cuda")
    why = cuda_ext.load(dev)
    if why or dispatch._ckey is None:
        print(f"the C++ key is unavailable: {why}")
        return 1
    n = 4096
    x = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, device=dev, dtype=torch.bfloat16)
    t = torch.randint(0, n, (1,), device=dev)
    cases = [("cross_entropy", "compile", (x, t)), ("cross_entropy", "eager", (x, t)),
             ("rms_norm", "cuda", (x, (n,), w, 1e-6)), ("softmax", "eager", (x, -1))]
    query = torch._C._cuda_isCurrentStreamCapturing
    side = torch.cuda.Stream()
    rows = []
    with torch.no_grad():
        for op, tier, a in cases:
            spec = tiered_ops.get_op(op)
            impl = spec.impls[tier].unchecked
            public = getattr(tiered_ops, op)
            bound = inspect.signature(spec.reference).bind(*a)
            bound.apply_defaults()
            full = tuple(bound.arguments.values())
            ckey = dispatch._ckey
            for where in ("default", "side"):
                ctx = torch.cuda.stream(side) if where == "side" else contextlib.nullcontext()
                with ctx:
                    _hot.clear()
                    public(*a)  # the slow path once: its key cached, then the implementation forced under it
                    for k in list(_hot):
                        _hot[k] = impl
                    fns = {"direct": lambda: impl(*a), "public": lambda: public(*a),
                           "direct+query": lambda: (impl(*a), query()),
                           "direct+ckey": lambda: (impl(*a), ckey(op, *full))}
                    r = interleaved(fns, args.calls, args.rounds, True)
                d = r["direct"]
                row = dict(op=op, tier=tier, stream=where, direct_us=round(statistics.median(d), 3))
                for name in ("public", "direct+query", "direct+ckey"):
                    diffs = [v - u for v, u in zip(r[name], d)]
                    q = statistics.quantiles(diffs, n=10)
                    row[f"{name}_over_direct_us"] = round(statistics.median(diffs), 3)
                    row[f"{name}_p20_us"], row[f"{name}_p80_us"] = round(q[1], 3), round(q[7], 3)
                rows.append(row)
                print(f"{op:<14} {tier:<8} {where:<8} direct {row['direct_us']:8.2f} us   over it: public "
                      f"{row['public_over_direct_us']:6.2f}  capture query {row['direct+query_over_direct_us']:6.2f}"
                      f"  C++ key {row['direct+ckey_over_direct_us']:6.2f}")
    alone = interleaved({"query": query}, args.calls, 10, True)["query"]
    print(f"capture query alone: {statistics.median(alone):.3f} us per call")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
