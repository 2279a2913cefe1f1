"""The norms' training step four ways in one process: eager, the CUDA tier through the Python autograd.Function
(fastpath.tier_fast), the CUDA tier through its C++ autograd node (native.native_fast), the Triton tier; kernel, host
and caller time as the harness takes them (timing.time_call). Run on a GPU with the extension built:
PYTHONPATH=. python scripts/diag/train_paths.py
(`case` and `training_paths` are also what scripts/diag/node_host.py measures.)
"""
from collections.abc import Callable
from typing import Any

import torch

from tiered_ops.measure.gate import grad_output, with_grad
from tiered_ops.measure.timing import time_call
from tiered_ops.registry import Inputs
from tiered_ops.tiers import native
from tiered_ops.tiers.catalog import get_op
from tiered_ops.tiers.fastpath import tier_fast

CASES = [("rms_norm", (8192, 4096)), ("rms_norm", (4096, 5120)), ("rms_norm", (16384, 4096)),
         ("fused_add_rms_norm", (8192, 4096)), ("fused_add_rms_norm", (4096, 5120)),
         ("layer_norm", (8192, 4096)), ("layer_norm", (4096, 5120)), ("layer_norm", (8192, 768))]


def case(op: str, shape: tuple[int, ...], dev: torch.device) -> tuple[Any, Inputs, Inputs, list[torch.Tensor]]:
    """The op's spec, its bf16 inputs at ``shape``, the same with fresh leaves that require grad, and those leaves."""
    spec = get_op(op)
    inp = spec.make_inputs(spec.problem(shape), torch.bfloat16, dev, 0)
    ginp, pos = with_grad(spec, inp)
    return spec, inp, ginp, [ginp.args[i] for i in pos]


def training_paths(spec: Any) -> dict[str, Callable[..., Any]]:
    """The four ways a training call can reach the op's kernels."""
    return {"eager": spec.impls["eager"].unchecked,
            "cuda-py": tier_fast(spec, "cuda", spec.first_output),
            "cuda-node": native.native_fast(spec, fallback=None),
            "triton": spec.impls["triton"].unchecked}


def step_of(fn: Callable[..., Any], ginp: Inputs, leaves: list[torch.Tensor]) -> Callable[[], Any]:
    """One training step through ``fn``: the forward recording a graph, then torch.autograd.grad of a random dy."""
    dy = grad_output(fn(*ginp.args, **ginp.kwargs), 0)
    return lambda: torch.autograd.grad(fn(*ginp.args, **ginp.kwargs), leaves, dy)


def main() -> None:
    from tiered_ops.tiers import cuda_ext

    dev = torch.device("cuda")
    assert cuda_ext.load() is None
    for op, shape in CASES:
        spec, _, ginp, leaves = case(op, shape, dev)
        for name, fn in training_paths(spec).items():
            step = step_of(fn, ginp, leaves)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            t = time_call(step, dev)
            print(f"{op:20s} {'x'.join(map(str, shape)):10s} {name:10s} kernel {t.p50_us:8.1f} host {t.host_us:8.1f} "
                  f"caller {t.caller_us:8.1f}", flush=True)


if __name__ == "__main__":
    main()
