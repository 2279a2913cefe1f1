"""swiglu(gate, up, activation="silu"): act(gate) * up, the gated MLP's product (SwiGLU, GeGLU) in one pass.

activation: "silu" (SwiGLU: Llama, Mistral, Qwen2, Qwen3), "gelu_tanh" (GeGLU with the tanh approximation: Gemma)
or "gelu" (GeGLU, erf form). gate and up have one shape, dtype and device (no broadcasting, no promotion); the
kernel tiers compute in fp32 and round once to the input dtype (eager rounds act(gate) first, then the product).
Bucket: (numel rounded up to a power of two, activation).
Bytes: read gate and up, write the output. Backward: read dy, gate, up; write dgate and dup.
Autograd of the kernel ops: save gate and up (the inputs; no activation is kept); the backward kernel recomputes
act(gate) and act'(gate): dgate = dy * up * act'(gate), dup = dy * act(gate).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import call, floating, gen, randn, same_device, values

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def _check_activation(activation: object) -> None:
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"swiglu: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def validate(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> None:
    """The contract of a call (every tier): gate and up floating tensors of one shape (no broadcasting), one dtype
    (no promotion) and one device; activation one of ACTIVATIONS."""
    floating("swiglu", "gate", gate)
    floating("swiglu", "up", up)
    same_device("swiglu", "up", up, gate, "gate")
    if up.dtype != gate.dtype:
        raise TypeError(f"swiglu: up must have gate's dtype {gate.dtype} (no type promotion), got {up.dtype}")
    if up.shape != gate.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape (no broadcasting), got {list(gate.shape)} "
                         f"and {list(up.shape)}")
    _check_activation(activation)


def reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Eager tier and reference: the MLP's own expression, act_fn(gate) * up."""
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def _problem(shape: tuple[int, ...], activation: str = "silu") -> Problem:
    _check_activation(activation)
    return make_problem(shape, activation=activation)


def _problem_of(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> Problem:
    return _problem(tuple(gate.shape), activation)


def _numel(p: Problem) -> int:
    return math.prod(p.shape)


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    gate = (3 * randn(p.shape, torch.float32, device, g)).to(dtype)  # both tails of the activation, and its middle
    return Inputs((gate, randn(p.shape, dtype, device, g), p.kw["activation"]))


def _kernel_args(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> tuple:
    return gate, up, activation


def _fake(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _bwd_fake(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    gate, up, ctx.activation = inputs
    ctx.save_for_backward(gate, up)


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        gate, up = ctx.saved_tensors
        dgate, dup = bwd(grad, gate, up, ctx.activation)
        return dgate, dup, None

    return backward


BAD_INPUTS = (
    BadInput("up of another shape", call(values(4, 8), values(4, 1), "silu"), ValueError,
             r"swiglu: gate and up must have the same shape \(no broadcasting\)"),
    BadInput("up of bfloat16", call(values(4, 8), values(4, 8, dtype=torch.bfloat16), "silu"), TypeError,
             r"swiglu: up must have gate's dtype"),
    BadInput("unknown activation", call(values(4, 8), values(4, 8), "relu"), ValueError,
             r"swiglu: activation must be one of 'silu', 'gelu_tanh', 'gelu', got 'relu'"),
)

SPEC = register_op(OpSpec(
    name="swiglu", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=lambda p: (pow2_ceil(_numel(p)), p.kw["activation"]),
    bytes_moved=lambda p, dt: 3 * _numel(p) * dt.itemsize,
    bwd_bytes=lambda p, dt: 5 * _numel(p) * dt.itemsize, grad_args=(0, 1),
    autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1,)),  # one element
        _problem((1823, 781)),  # a tail after every block size
        _problem((3, 1, 5), "gelu_tanh"),  # size-1 dim, Gemma's activation
        _problem((100003,), "gelu"),  # several blocks plus a tail, the erf GeGLU
        _problem((0, 4)),  # empty
    ],
    # cuda: the MLPs of 8B-class models (intermediate 14336: Llama 3 8B, Mistral 7B; 12288: Qwen3 8B), a prefill and
    # a decode batch; Gemma's GeGLU at its 7B width (24576)
    default_problems=lambda dev: [_problem(s, a) for s, a in (
        [((8192, 14336), "silu"), ((32, 14336), "silu"), ((4096, 12288), "silu"), ((4096, 24576), "gelu_tanh")]
        if dev == "cuda" else [((256, 1024), "silu"), ((256, 1024), "gelu_tanh")])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
    bad_inputs=BAD_INPUTS, variants=({"activation": "silu"}, {"activation": "gelu_tanh"}, {"activation": "gelu"}),
))
