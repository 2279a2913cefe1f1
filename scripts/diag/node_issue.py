"""A host-bound norm training step's issue time taken apart, eager against the CUDA tier's C++ autograd node
(native.native_fast): the forward without a graph, the forward recording one, and the step (forward and
torch.autograd.grad), each the fastest of 5 batches of back-to-back calls, the GPU not waited for
(timing.batch_times_us), in interleaved rounds. The step less the recording forward is the backward's issue time.
Run on a GPU with the extension built: PYTHONPATH=. python scripts/diag/node_issue.py [--rounds 3]
"""
import argparse

import torch

from tiered_ops.measure.gate import grad_output, with_grad
from tiered_ops.measure.timing import batch_times_us
from tiered_ops.tiers import cuda_ext, native
from tiered_ops.tiers.catalog import get_op

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=3)
opts = ap.parse_args()
dev = torch.device("cuda")
assert cuda_ext.load() is None
for op, shape in [("rms_norm", (4096, 5120)), ("layer_norm", (4096, 5120))]:
    spec = get_op(op)
    inp = spec.make_inputs(spec.problem(shape), torch.bfloat16, dev, 0)
    ginp, pos = with_grad(spec, inp)
    fns = {"eager": spec.impls["eager"].unchecked, "cuda-node": native.native_fast(spec, fallback=None)}
    calls = {}
    for name, fn in fns.items():
        dy = grad_output(fn(*ginp.args, **ginp.kwargs), 0)
        leaves = [ginp.args[i] for i in pos]

        def nograd(fn=fn):
            return fn(*inp.args, **inp.kwargs)

        def record(fn=fn):
            return fn(*ginp.args, **ginp.kwargs)

        def step(fn=fn, dy=dy, leaves=leaves):
            return torch.autograd.grad(fn(*ginp.args, **ginp.kwargs), leaves, dy)
        for part, f in {"forward, no graph": nograd, "forward, recording": record, "step": step}.items():
            for _ in range(5):
                f()
            calls[(name, part)] = f
    best = {k: float("inf") for k in calls}
    for _ in range(opts.rounds):
        for k, f in calls.items():
            best[k] = min(best[k], min(batch_times_us(f, dev, 0.025)))
    print(f"== {op} {'x'.join(map(str, shape))} bf16: host us a call (fastest batch of {opts.rounds} rounds)")
    for name in fns:
        b = {p: best[(name, p)] for p in ("forward, no graph", "forward, recording", "step")}
        print(f"  {name:10s} forward {b['forward, no graph']:7.1f}  recording {b['forward, recording']:7.1f}  "
              f"step {b['step']:7.1f}  backward {b['step'] - b['forward, recording']:7.1f}")
