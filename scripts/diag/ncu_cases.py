"""Run a few (op, impl, shape, dtype) forward calls inside NVTX ranges named "prof", for Nsight Compute
(why the CUDA v2 forward reaches 94-99 % of copy bandwidth in fp32 and only 61-87 % in bf16):

  ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
      python3 scripts/diag/ncu_cases.py

Each case is warmed up outside the range (JIT, extension load), then called once inside it; the order of the
profiled kernels is printed first. scripts/gpu.sh stage ncu runs it.
"""

from __future__ import annotations

import sys

import torch

from tiered_ops.registry import DTYPES
from tiered_ops.tiers.catalog import get_op

CASES = [  # (op, impl, shape, dtype)
    ("softmax", "cuda", (4096, 32768), "bf16"),
    ("softmax", "triton", (4096, 32768), "bf16"),
    ("softmax", "cuda", (4096, 32768), "fp32"),
    ("softmax", "cuda", (512, 393216), "fp32"),  # giant rows: a cluster of 8 blocks a row
    ("softmax", "cuda", (1, 900000), "fp32"),  # a row only a cluster of 16 holds
    ("rms_norm", "cuda", (4096, 32768), "bf16"),
    ("rms_norm", "triton", (4096, 32768), "bf16"),
    ("layer_norm", "cuda", (16384, 4096), "bf16"),
    ("layer_norm", "triton", (16384, 4096), "bf16"),
]


def main() -> int:
    dev = torch.device("cuda")
    for k, (op, impl, shape, dt) in enumerate(CASES):
        spec = get_op(op)
        why = spec.impls[impl].why_not(dev, DTYPES[dt])
        if why:
            print(f"case {k}: {op} {impl} unavailable: {why}", file=sys.stderr)
            return 1
        inp = spec.make_inputs(spec.problem(shape), DTYPES[dt], dev, 0)
        fn = spec.impls[impl].fn
        with torch.no_grad():
            fn(*inp.args, **inp.kwargs)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("prof")
            fn(*inp.args, **inp.kwargs)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
        print(f"profiled case {k}: {op} {impl} {'x'.join(map(str, shape))} {dt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
