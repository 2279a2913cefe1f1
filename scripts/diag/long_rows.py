"""Kernel time of each tier of a row-wise op at long rows (do_bench medians), as a fraction of the copy bandwidth
measured in the same run by the harness (copy_bandwidth_gbps; bytes: the op's own count). Usage:
    python3 scripts/diag/long_rows.py softmax --shapes 4096x65536 512x393216 12x250000 --dtype fp32,bf16
    python3 scripts/diag/long_rows.py layer_norm --shapes 16x64x256x256 --trailing 3   (normalized over 3 dims)"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tiered_ops.measure.timing import copy_bandwidth_gbps
from tiered_ops.registry import DTYPE_NAMES, DTYPES
from tiered_ops.tiers.catalog import get_op


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("--shapes", nargs="+", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--impls", default="eager,compile,triton,cuda")
    ap.add_argument("--trailing", type=int, help="normalize over this many trailing dims (normalized_shape)")
    args = ap.parse_args()
    spec = get_op(args.op)
    impls = args.impls.split(",")
    peak = copy_bandwidth_gbps(torch.device("cuda"))  # the harness's own: 1 GiB copied, read + written
    print(f"copy: {peak:.0f} GB/s ({torch.cuda.get_device_name()})")
    print(f"{'shape':>14} {'dtype':>5} " + " ".join(f"{i:>16}" for i in impls))
    for dt_name in args.dtype.split(","):
        dtype = DTYPES[dt_name]
        for shape in args.shapes:
            dims = tuple(int(s) for s in shape.split("x"))
            kw = {"normalized_shape": dims[-args.trailing:]} if args.trailing else {}
            p = spec.problem(dims, **kw)
            inputs = spec.make_inputs(p, dtype, torch.device("cuda"), 0)
            nbytes = spec.bytes_moved(p, dtype)
            cells = []
            for name in impls:
                fn = spec.impls[name].fn
                fn(*inputs.args, **inputs.kwargs)
                ms = triton.testing.do_bench(lambda fn=fn, i=inputs: fn(*i.args, **i.kwargs), warmup=25, rep=200,
                                             return_mode="median")
                cells.append(f"{ms * 1e3:9.1f}us {nbytes / ms / 1e6 / peak:4.2f}")
            print(f"{shape:>14} {DTYPE_NAMES[dtype]:>5} " + " ".join(f"{c:>16}" for c in cells), flush=True)
            del inputs  # the next shape's inputs may need the memory
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
