"""Where a norm training step's host time goes, eager against the CUDA tier's C++ autograd node (native.native_fast):
torch.profiler's CPU events over back-to-back steps, each event's host microseconds a step (self time), the largest
first. Run on a GPU with the extension built: PYTHONPATH=. python scripts/diag/node_host.py [--steps 50] [--top 14]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tiered_ops.measure.gate import grad_output, with_grad
from tiered_ops.tiers import cuda_ext, native
from tiered_ops.tiers.catalog import get_op

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--top", type=int, default=14)
opts = ap.parse_args()
dev = torch.device("cuda")
assert cuda_ext.load() is None
for op, shape in [("rms_norm", (4096, 5120)), ("layer_norm", (4096, 5120))]:
    spec = get_op(op)
    inp = spec.make_inputs(spec.problem(shape), torch.bfloat16, dev, 0)
    ginp, pos = with_grad(spec, inp)
    args, kw = ginp.args, ginp.kwargs
    leaves = [args[i] for i in pos]
    fns = {"eager": spec.impls["eager"].unchecked, "cuda-node": native.native_fast(spec, fallback=None)}
    for name, fn in fns.items():
        dy = grad_output(fn(*args, **kw), 0)

        def step(fn=fn, dy=dy):
            return torch.autograd.grad(fn(*args, **kw), leaves, dy)
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(opts.steps):
                step()
            torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) / opts.steps
        print(f"== {op} {'x'.join(map(str, shape))} bf16 {name}: {total:.1f} us of CPU events a step (self)")
        for e in events[: opts.top]:
            print(f"  {e.self_cpu_time_total / opts.steps:8.1f} us  {e.count / opts.steps:5.1f}x  {e.key[:90]}")
