"""The host floor of a training step as the harness times it (``timed_call(..., "fwd+bwd")``: the forward, then
``torch.autograd.grad`` of its output), beside the norms' own steps. A training step whose kernels would move its
bytes at the copy bandwidth still pays the host's launch path; where that path alone costs more than the copy time,
no kernel reaches the copy fraction a target asks for, and the gap is the host's, not the kernels'.

Per case, in one process over ``--rounds`` interleaved rounds (the harness's ``time_call``: kernel p50, host time,
caller time), and the number of kernels one step launches (the profiler's CUDA kernel events):
- the op's eager, Triton and CUDA tiers;
- ``null-python``: a ``torch.autograd.Function`` with the op's differentiable inputs that launches nothing (its forward
  and backward return tensors allocated once): the floor of any Python-level autograd wrapper;
- ``null-aten``: a C++ autograd node that launches nothing (``x.view(shape)``, its gradient a view of dy): the floor
  of the harness's step itself.
Usage (GPU machine, from the repository root): PYTHONPATH=$PWD python3 scripts/diag/step_floor.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from benchmarks.speed_of_light import null_step  # the floor step the speed-of-light page times
from tiered_ops.measure.gate import grad_output, with_grad
from tiered_ops.measure.measure import timed_call
from tiered_ops.measure.recheck import interleaved
from tiered_ops.measure.timing import copy_bandwidth_gbps, time_call
from tiered_ops.registry import DTYPES
from tiered_ops.tiers.catalog import get_op

CASES = [("layer_norm", (8192, 768)), ("rms_norm", (8192, 4096)), ("fused_add_rms_norm", (8192, 4096))]
IMPLS = ["eager", "triton", "cuda"]


class _Null(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> torch.Tensor:
        ctx.like = [torch.empty_like(x) for x in xs]  # allocations only, as a real wrapper makes: no kernel
        return torch.empty_like(xs[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(ctx.like)


def _kernels(fn: Any) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def case_calls(op: str, shape: tuple[int, ...], dev: torch.device, impls: list[str]
               ) -> tuple[int, dict[str, Any], Any, list[torch.Tensor]]:
    """A bf16 case's training steps as the harness times them: its bytes, a step per implementation of ``impls``
    and ``null-aten``, the inputs with their differentiable leaves marked, and those leaves."""
    spec = get_op(op)
    p = spec.problem(shape)
    dt = DTYPES["bf16"]
    inp = spec.make_inputs(p, dt, dev, 0)
    calls = {name: timed_call(spec, spec.impls[name], inp, "fwd+bwd") for name in impls}
    ginp, pos = with_grad(spec, inp)
    leaves = [ginp.args[i] for i in pos]
    calls["null-aten"] = null_step(leaves[0])
    return spec.mode_bytes(p, dt, "fwd+bwd"), calls, ginp, leaves


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbps(dev)
    print(f"{torch.cuda.get_device_name()}; copy {copy:.0f} GB/s; caller us, median of {args.rounds} rounds "
          "(host us, kernel p50 us), kernels per step")
    for op, shape in CASES:
        nbytes, calls, _, leaves = case_calls(op, shape, dev, IMPLS)
        dy = grad_output(torch.empty_like(leaves[0]), 0)
        calls["null-python"] = lambda: torch.autograd.grad(_Null.apply(*leaves), leaves, dy)
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        kernels = {name: _kernels(fn) for name, fn in calls.items()}
        rows = interleaved(calls, args.rounds, lambda f: time_call(f, dev))
        names = list(calls)
        copy_us = nbytes / (copy * 1e3)
        print(f"\n{op} {'x'.join(map(str, shape))} bf16 fwd+bwd: {nbytes / 1e6:.1f} MB, copy time {copy_us:.1f} us "
              f"(75 % of copy: caller <= {copy_us / 0.75:.1f} us)")
        for name in names:
            ts = rows[name]
            c, h = statistics.median(t.caller_us for t in ts), statistics.median(t.host_us for t in ts)
            k = statistics.median(t.p50_us for t in ts)
            print(f"  {name:>12}: caller {c:7.1f}  (host {h:7.1f}, kernel p50 {k:7.1f})  kernels {kernels[name]}")


if __name__ == "__main__":
    main()
