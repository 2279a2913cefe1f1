"""The norms' training step four ways in one process: eager, the CUDA tier through the Python autograd.Function
(fastpath.tier_fast), the CUDA tier through its C++ autograd node (native.native_fast), the Triton tier; kernel, host
and caller time as the harness takes them (timing.time_call). Run on a GPU with the extension built:
PYTHONPATH=. python scripts/diag/train_paths.py
"""
import sys

import torch

from tiered_ops.measure.gate import grad_output, with_grad
from tiered_ops.measure.timing import time_call
from tiered_ops.tiers import cuda_ext, native
from tiered_ops.tiers.catalog import get_op
from tiered_ops.tiers.fastpath import tier_fast

dev = torch.device("cuda")
assert cuda_ext.load() is None
cases = [("rms_norm", (8192, 4096)), ("rms_norm", (4096, 5120)), ("rms_norm", (16384, 4096)),
         ("fused_add_rms_norm", (8192, 4096)), ("fused_add_rms_norm", (4096, 5120)),
         ("layer_norm", (8192, 4096)), ("layer_norm", (4096, 5120)), ("layer_norm", (8192, 768))]
for op, shape in cases:
    spec = get_op(op)
    p = spec.problem(shape)
    inp = spec.make_inputs(p, torch.bfloat16, dev, 0)
    ginp, pos = with_grad(spec, inp)
    args, kw = ginp.args, ginp.kwargs
    leaves = [args[i] for i in pos]
    fns = {"eager": spec.impls["eager"].unchecked,
           "cuda-py": tier_fast(spec, "cuda", spec.first_output),
           "cuda-node": native.native_fast(spec, fallback=None),
           "triton": spec.impls["triton"].unchecked}
    for name, fn in fns.items():
        out = fn(*args, **kw)
        dy = grad_output(out, 0)

        def step(fn=fn, dy=dy):
            return torch.autograd.grad(fn(*args, **kw), leaves, dy)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time_call(step, dev)
        print(f"{op:20s} {'x'.join(map(str, shape)):10s} {name:10s} kernel {t.p50_us:8.1f} host {t.host_us:8.1f} "
              f"caller {t.caller_us:8.1f}", flush=True)
    sys.stdout.flush()
