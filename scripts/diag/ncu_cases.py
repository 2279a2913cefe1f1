"""Run a few (op, impl, shape, dtype, mode) calls inside NVTX ranges named "prof", for Nsight Compute:

  ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
      python3 scripts/diag/ncu_cases.py [--set bf16|sol]

``bf16`` (the default): why the CUDA v2 forward reaches 94-99 % of copy bandwidth in fp32 and only 61-87 % in bf16.
``bwd``: the norms' training step at 8192x4096 bf16, each op's CUDA kernels beside its Triton tier's.
``sol``: the speed-of-light cases whose bars are not met (benchmarks/speed_of_light.json): every kernel each of our
tiers launches there, a training step's backward kernels included, beside the compile tier's.
``limits``: the CUDA kernels of layer_norm over three dims alone (few enough for ``ncu --replay-mode application``,
which reruns the script for each pass).

The giant-row softmax's own launch (rows in a cluster of blocks) is in no set: under Nsight Compute, in kernel and in
application replay alike, the cooperative launch loses its clusters and the kernel stops it (``LaunchFailed``), which
ends the process and, under application replay, every profile of the run. Its profile comes from
``scripts/diag/softmax_plans.cu`` with ``NCU_PLAN=1`` (the op's plan launched without the cooperative attribute, which
keeps its clusters).

Each case is warmed up outside the range (JIT, extension load, torch.compile), then called once inside it; the order
of the profiled kernels is printed. scripts/gpu.sh stage ncu runs it (NCU_SET picks the set).
"""

from __future__ import annotations

import argparse
import sys

import torch

from tiered_ops.measure.measure import timed_call
from tiered_ops.registry import DTYPES
from tiered_ops.sweep.live import grid_problem
from tiered_ops.tiers.catalog import get_op

SETS: dict[str, list[tuple[str, str, str, str, str, dict]]] = {  # (op, impl, shape, dtype, mode, params)
    "bf16": [
        ("softmax", "cuda", "4096x32768", "bf16", "fwd_nograd", {}),
        ("softmax", "triton", "4096x32768", "bf16", "fwd_nograd", {}),
        ("softmax", "cuda", "4096x32768", "fp32", "fwd_nograd", {}),
        ("rms_norm", "cuda", "4096x32768", "bf16", "fwd_nograd", {}),
        ("rms_norm", "triton", "4096x32768", "bf16", "fwd_nograd", {}),
        ("layer_norm", "cuda", "16384x4096", "bf16", "fwd_nograd", {}),
        ("layer_norm", "triton", "16384x4096", "bf16", "fwd_nograd", {}),
    ],
    "bwd": [
        ("layer_norm", "cuda", "8192x4096", "bf16", "fwd+bwd", {}),
        ("layer_norm", "triton", "8192x4096", "bf16", "fwd+bwd", {}),
        ("rms_norm", "cuda", "8192x4096", "bf16", "fwd+bwd", {}),
        ("rms_norm", "triton", "8192x4096", "bf16", "fwd+bwd", {}),
        ("fused_add_rms_norm", "cuda", "8192x4096", "bf16", "fwd+bwd", {}),
        ("fused_add_rms_norm", "triton", "8192x4096", "bf16", "fwd+bwd", {}),
    ],
    "sol": [
        ("softmax", "compile", "512x393216", "fp32", "fwd_nograd", {}),
        ("layer_norm", "cuda", "16x64x256x256", "fp32", "fwd_nograd", {"normalized_shape": [64, 256, 256]}),
        ("layer_norm", "compile", "16x64x256x256", "fp32", "fwd_nograd", {"normalized_shape": [64, 256, 256]}),
        ("rms_norm", "cuda", "8192x4096", "bf16", "fwd+bwd", {}),
        ("rms_norm", "triton", "8192x4096", "bf16", "fwd+bwd", {}),
        ("rms_norm", "eager", "8192x4096", "bf16", "fwd+bwd", {}),
    ],
    "limits": [  # a speed-of-light bar no kernel change met: what holds it below its bar
        ("layer_norm", "cuda", "16x64x256x256", "fp32", "fwd_nograd", {"normalized_shape": [64, 256, 256]}),
    ],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=sorted(SETS), default="bf16")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    # the backward on this thread: NVTX ranges are per thread, and the autograd engine's own thread is outside "prof"
    torch.autograd.set_multithreading_enabled(False)
    for k, (op, impl, shape, dt, mode, params) in enumerate(SETS[args.set]):
        spec = get_op(op)
        why = spec.impls[impl].why_not(dev, DTYPES[dt])
        if why:
            print(f"case {k}: {op} {impl} unavailable: {why}", file=sys.stderr)
            return 1
        dims = tuple(int(d) for d in shape.split("x"))
        inp = spec.make_inputs(grid_problem(op, dims, params), DTYPES[dt], dev, 0)
        call = timed_call(spec, spec.impls[impl], inp, mode)
        call()
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("prof")
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"profiled case {k}: {op} {impl} {shape} {dt} {mode}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
