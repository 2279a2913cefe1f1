"""Where a host-bound norm training step's host time goes, eager against the CUDA tier's C++ autograd node
(native.native_fast), at 4096x5120 bf16:
- ``--what events`` (the default): torch.profiler's CPU events over back-to-back steps, each event's host microseconds a
  step (self time), the largest first;
- ``--what issue``: the issue time taken apart: the forward without a graph, the forward recording one, and the step
  (forward and torch.autograd.grad), each the fastest of 5 batches of back-to-back calls, the GPU not waited for
  (timing.batch_times_us), in interleaved rounds; the step less the recording forward is the backward's issue time.
  The node's forward is also timed without its Python wrapper (native.native_fast's ``call``): the pybind11 functions
  called with the kernel arguments made once (``pybind``), and the registered op through the dispatcher (``op``), so
  that the wrapper's, pybind11's and the autograd node's shares of the forward read as differences; and each path's
  backward function called alone on the forward's saved tensors (eager: the aten backward op; the node: the pybind11
  backward it calls), so that the step less the recording forward less that reads as the engine's and the node's own
  share of the backward.
Run on a GPU with the extension built: PYTHONPATH=. python scripts/diag/node_host.py [--what issue] [--steps 50]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from train_paths import case, step_of, training_paths  # this folder's: the same cases and paths

from tiered_ops.measure.timing import batch_times_us
from tiered_ops.tiers import cuda_ext

PARTS = ("forward, no graph", "forward, recording", "step")


def events(step, label: str, steps: int, top: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in evs) / steps
    print(f"== {label}: {total:.1f} us of CPU events a step (self)")
    for e in evs[:top]:
        print(f"  {e.self_cpu_time_total / steps:8.1f} us  {e.count / steps:5.1f}x  {e.key[:90]}")


def backward_alone(op: str, kargs: tuple, dy: torch.Tensor) -> dict:
    """Each path's backward function on the saved tensors of one forward, as the engine's node calls it."""
    if op == "rms_norm":
        x, ns, w, eps = kargs[:4]
        _, rstd = torch.ops.aten._fused_rms_norm(x, ns, w, eps)
        bwd = cuda_ext.pybind_function("rms_norm_bwd_cuda")
        return {"eager": lambda: torch.ops.aten._fused_rms_norm_backward(dy, x, ns, rstd, w, [True, True]),
                "cuda-node": lambda: bwd(dy, *kargs)}
    x, ns, w, b, eps = kargs
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, ns, w, b, eps)
    _, cmean, crstd = cuda_ext.pybind_function("layer_norm_cuda")(*kargs)
    bwd = cuda_ext.pybind_function("layer_norm_bwd_cuda")
    return {"eager": lambda: torch.ops.aten.native_layer_norm_backward(dy, x, ns, mean, rstd, w, b, [True] * 3),
            "cuda-node": lambda: bwd(dy, x, ns, w, cmean, crstd, b is not None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", choices=("events", "issue"), default="events")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    dev = torch.device("cuda")
    assert cuda_ext.load() is None
    for op, shape in [("rms_norm", (4096, 5120)), ("layer_norm", (4096, 5120))]:
        spec, inp, ginp, leaves = case(op, shape, dev)
        fns = {k: v for k, v in training_paths(spec).items() if k in ("eager", "cuda-node")}
        calls = {}
        kargs, gkargs = spec.kernel_args(*inp.args, **inp.kwargs), spec.kernel_args(*ginp.args, **ginp.kwargs)
        alone = backward_alone(op, kargs, torch.randn_like(inp.args[0]))
        for name, fn in fns.items():
            calls[(name, "backward alone")] = alone[name]
            calls[(name, PARTS[0])] = lambda fn=fn: fn(*inp.args, **inp.kwargs)
            calls[(name, PARTS[1])] = lambda fn=fn: fn(*ginp.args, **ginp.kwargs)
            calls[(name, PARTS[2])] = step_of(fn, ginp, leaves)
            if name == "cuda-node":
                fwd, train = (cuda_ext.pybind_function(f"{op}_{s}") for s in ("cuda", "train_cuda"))
                registered = getattr(torch.ops.tiered_ops, f"{op}_cuda").default
                calls[(name, "pybind forward")] = lambda: fwd(*kargs)
                calls[(name, "pybind recording")] = lambda: train(*gkargs)
                calls[(name, "op forward")] = lambda: registered(*kargs)
                calls[(name, "kernel args")] = lambda: spec.kernel_args(*inp.args, **inp.kwargs)
            for f in (v for (n, _), v in calls.items() if n == name):
                for _ in range(10):
                    f()
            torch.cuda.synchronize()
            if opts.what == "events":
                events(calls[(name, PARTS[2])], f"{op} {'x'.join(map(str, shape))} bf16 {name}", opts.steps, opts.top)
        if opts.what == "issue":
            best = {k: float("inf") for k in calls}
            for _ in range(opts.rounds):
                for k, f in calls.items():
                    best[k] = min(best[k], min(batch_times_us(f, dev, 0.025)))
            print(f"== {op} {'x'.join(map(str, shape))} bf16: host us a call (fastest batch of {opts.rounds} rounds)")
            for name in fns:
                b = [best[(name, p)] for p in PARTS]
                ba = best[(name, "backward alone")]
                print(f"  {name:10s} forward {b[0]:7.1f}  recording {b[1]:7.1f}  step {b[2]:7.1f}  "
                      f"backward {b[2] - b[1]:7.1f} (its function alone {ba:7.1f}, the rest {b[2] - b[1] - ba:7.1f})")
            print("  cuda-node without its Python wrapper: " + "  ".join(
                f"{p} {best[('cuda-node', p)]:.1f}" for p in ("kernel args", "pybind forward", "pybind recording",
                                                               "op forward")))


if __name__ == "__main__":
    main()
