"""The compile tier's host time per call at one shape as its compiled function gathers other shapes: the regret grid's
worker (every point of every op, each gated over the edge problems) read layer_norm 30000x1024 fp16 at 70-85 us a
call where the tuning process read at most 46.7. Host time as the harness takes it (``timing.time_call``), with one
graph, then after ``--shapes`` other shapes (no_grad and grad-enabled calls: the gate runs both), then with a fresh
``torch.compile`` of the same function holding this shape alone. Usage (GPU machine):
    python3 scripts/diag/compile_host.py --op layer_norm --shape 30000x1024 --dtype fp16 --shapes 40
"""

from __future__ import annotations

import argparse
import time

import torch

from tiered_ops.measure.measure import timed_call
from tiered_ops.measure.timing import time_call
from tiered_ops.registry import DTYPES
from tiered_ops.tiers.catalog import get_op


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="layer_norm")
    ap.add_argument("--shape", default="30000x1024")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--shapes", type=int, default=40)
    args = ap.parse_args()
    dev, dtype, spec = torch.device("cuda"), DTYPES[args.dtype], get_op(args.op)
    dims = tuple(int(s) for s in args.shape.split("x"))
    inp = spec.make_inputs(spec.problem(dims), dtype, dev, 0)

    def report(label: str) -> None:
        for name in ("compile", "triton", "eager"):
            t = time_call(timed_call(spec, spec.impls[name], inp, "fwd_nograd"), dev)
            print(f"{label:>44} {name:>8}: caller {t.caller_us:6.1f} us, host {t.host_us:6.1f}, kernel {t.p50_us:6.1f}",
                  flush=True)

    report("one shape")
    fn, t0 = spec.impls["compile"].fn, time.perf_counter()
    for k in range(args.shapes):
        other = spec.make_inputs(spec.problem((dims[0] // 2 + 7 * k + 1, dims[-1])), dtype, dev, 0)
        with torch.no_grad():
            fn(*other.args, **other.kwargs)
        if k % 4 == 0:  # the gate's calls with gradients on: graphs of another grad mode
            x, *rest = other.args
            fn(x.detach().requires_grad_(), *rest, **other.kwargs)
    torch.cuda.synchronize()
    print(f"compiled {args.shapes} more shapes in {time.perf_counter() - t0:.1f} s", flush=True)
    report(f"after {args.shapes} more shapes")
    torch._dynamo.reset()
    report("after torch._dynamo.reset (this shape again)")


if __name__ == "__main__":
    main()
