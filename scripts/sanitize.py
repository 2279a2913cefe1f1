"""Run every CUDA-tier kernel of every op, forward and backward, on the op's edge and default problems in all
three dtypes: the workload that scripts/gpu.sh runs under compute-sanitizer (memcheck, racecheck, initcheck).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize.py

Without the caching allocator every tensor is its own cudaMalloc, so a read or write past its end is outside
any allocation and memcheck sees it. Prints one line per case (the log shows what ran even when cut short);
problems above --max-elements are listed as skipped, never dropped silently.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from tiered_ops.accuracy import as_outputs
from tiered_ops.measure.gate import grad_output, with_grad
from tiered_ops.registry import DTYPES, Tier
from tiered_ops.tiers.catalog import all_ops


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", help="comma-separated (default: all)")
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument("--max-elements", type=int, default=1 << 26)
    p.add_argument("--plant-oob", action="store_true",
                   help="positive control: run only the planted out-of-bounds kernel (tests/plants), which the "
                        "sanitizer must report")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.plant_oob:
        from tests import plants

        assert plants._cuda_available(dev) is None
        x = torch.randn(1000, device=dev)
        y = plants.SPEC.impls["cuda_oob"].fn(x)
        torch.cuda.synchronize()
        print("the planted kernel ran", y.shape)
        return 0
    specs = [s for s in all_ops() if not args.ops or s.name in args.ops.split(",")]
    cases = skipped = 0
    t0 = time.time()
    for spec in specs:
        for impl in (i for i in spec.impls.values() if i.tier == Tier.CUDA):
            why = impl.why_not(dev)
            if why:
                raise SystemExit(f"{spec.name} {impl.name}: {why}")
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                for problem in spec.edge_problems() + spec.default_problems("cuda"):
                    if math.prod(problem.shape) > args.max_elements:
                        print(f"skipped {spec.name} {impl.name} {dname} {problem}: above --max-elements", flush=True)
                        skipped += 1
                        continue
                    inp, pos = with_grad(spec, spec.make_inputs(problem, dtype, dev, 0))
                    with torch.no_grad():
                        impl.fn(*inp.args, **inp.kwargs)
                    out = as_outputs(impl.fn(*inp.args, **inp.kwargs))  # fused_add_rms_norm returns two tensors
                    if all(o.requires_grad for o in out) and sum(o.numel() for o in out):
                        torch.autograd.grad(out, [inp.args[i] for i in pos], grad_output(out, 0), allow_unused=True)
                    torch.cuda.synchronize()
                    cases += 1
                    print(f"ran {spec.name} {impl.name} {dname} {problem} fwd+bwd ({time.time() - t0:.0f} s)",
                          flush=True)
    print(f"{cases} cases ran, {skipped} skipped as too large for the sanitizer's time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
