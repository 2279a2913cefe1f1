"""Where a compiled tier's edge gate spends its seconds: each edge problem's check timed apart in a fresh process (after
the worker's compiler warm-up), then dynamo's compile-time table. Usage:
    python3 scripts/diag/gate_cost.py rms_norm:compile layer_norm:triton softmax:triton [--dtype bf16] [--grad]"""

from __future__ import annotations

import argparse
import time

import torch

from tiered_ops.measure.gate import check_defaults, check_one
from tiered_ops.measure.serve import _warm_up
from tiered_ops.registry import DTYPES
from tiered_ops.tiers.catalog import get_op


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="op:impl")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--grad", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = time.perf_counter()
    _warm_up(dev)
    print(f"warm-up {time.perf_counter() - t:.2f} s")
    for case in a.cases:
        op, name = case.split(":")
        spec = get_op(op)
        impl, dtype = spec.impls[name], DTYPES[a.dtype]
        total = time.perf_counter()
        for e in spec.edge_problems():
            t = time.perf_counter()
            _, why = check_one(spec, impl, e, dtype, dev, seed=len(e.shape), grad=a.grad)
            print(f"{op} {name} {e}: {time.perf_counter() - t:.3f} s {why or 'ok'}")
        t = time.perf_counter()
        _, why = check_defaults(spec, impl, spec.edge_problems()[0], dtype, dev, a.grad)
        print(f"{op} {name} defaults: {time.perf_counter() - t:.3f} s {why or 'ok'}")
        print(f"== {op} {name}: edges {time.perf_counter() - total:.2f} s")
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
