"""What a training step's leaves cost the host: the norms' step (the forward, then torch.autograd.grad of its output,
as the harness times it) with the gradient asked for x alone and for every leaf (x, the weight, the bias), beside a
step that launches nothing with as many leaves (each a view of its leaf, its gradient a view of its dy: the engine's
floor for that many gradients). Eager and the CUDA tier's C++ node (native.native_fast), 4096x5120 bf16, in one process
over --rounds interleaved rounds; kernel p50, host (fastest batch) and caller time (timing.time_call), the fastest
round's host figure. Run on a GPU with the extension built: PYTHONPATH=. python scripts/diag/leaf_floor.py
"""
import argparse

import torch
from train_paths import case, step_of, training_paths  # this folder's: the same cases, paths and steps

from tiered_ops.measure.timing import time_call
from tiered_ops.tiers import cuda_ext


def null_step(leaves: list[torch.Tensor]):
    dys = [t.detach() for t in leaves]
    return lambda: torch.autograd.grad([t.view(t.shape) for t in leaves], leaves, dys)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    dev = torch.device("cuda")
    assert cuda_ext.load() is None
    for op in ("rms_norm", "layer_norm"):
        spec, _, ginp, leaves = case(op, (4096, 5120), dev)
        paths = {k: v for k, v in training_paths(spec).items() if k in ("eager", "cuda-node")}
        steps = {}
        for k in (1, len(leaves)):
            steps[("null", k)] = null_step(leaves[:k])
            for name, fn in paths.items():
                steps[(name, k)] = step_of(fn, ginp, leaves[:k])
        for s in steps.values():
            for _ in range(5):
                s()
        torch.cuda.synchronize()
        best = {}
        for _ in range(opts.rounds):
            for key, s in steps.items():
                t = time_call(s, dev)
                if key not in best or t.host_us < best[key].host_us:
                    best[key] = t
        print(f"== {op} 4096x5120 bf16: leaves {len(leaves)} (x first); fastest host of {opts.rounds} rounds")
        for (name, k), t in best.items():
            print(f"  {name:10s} leaves {k}  kernel {t.p50_us:8.1f}  host {t.host_us:8.1f}  caller {t.caller_us:8.1f}")


if __name__ == "__main__":
    main()
