import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, device_for, gpu, rel, tier_cases, truth64

import tiered_ops
from tiered_ops.ops.swiglu import ACTIVATIONS
from tiered_ops.ops.swiglu import _problem as P

PROBLEMS = [
    P((1,)),  # one element: the scalar tail only
    P((1823, 781)),  # a tail after every block size; no multiple of the CUDA pack
    P((3, 1, 5), "gelu_tanh"),  # size-1 dim
    P((100003,), "gelu"),  # several blocks plus a tail
    P((64, 256)),  # exact multiple: the 16-byte CUDA path with no tail
    P((64, 256), "gelu_tanh"),  # Gemma's GeGLU
    P((7, 33), "gelu"),  # the erf GeGLU, a tail
]


@pytest.mark.parametrize("impl,dtype,problem", tier_cases("swiglu", PROBLEMS))  # helpers.SMALL_TWINS
def test_matches_float64(impl, dtype, problem):
    assert_matches("swiglu", impl, problem, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
def test_gradients_match_float64(impl, dtype, activation):
    assert_matches("swiglu", impl, P((37, 129), activation), dtype, grad=True)  # a tail after every pack


def test_compile_tier():
    assert_matches("swiglu", "compile", P((1823, 781)), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_misaligned(impl):
    """A transposed gate, an up at a storage offset (not 16-byte aligned): the values and both gradients."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("swiglu").impls[impl].fn
    for act in ACTIVATIONS:
        gate = (3 * torch.randn(50, 70, device=dev)).t().requires_grad_(True)
        up = torch.randn(70 * 50 + 1, device=dev)[1:].view(70, 50).requires_grad_(True)
        out = fn(gate, up, act)
        g64, u64 = (t.detach().double().requires_grad_(True) for t in (gate, up))
        want = truth64("swiglu", g64, u64, act)
        assert rel(out, want) < 1e-6, act
        dy = torch.randn_like(out)
        got = torch.autograd.grad(out, (gate, up), dy)
        ref = torch.autograd.grad(want, (g64, u64), dy.double())
        for name, a, b in zip(("gate", "up"), got, ref):
            assert rel(a, b) < 1e-5, (act, name)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_mlp_expression(impl):
    """What the decoders compute: F.silu(gate) * up and F.gelu(gate, approximate="tanh") * up, in bf16."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("swiglu").impls[impl].fn
    gate, up = (torch.randn(8, 96, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for act, want in (("silu", F.silu(gate.float()) * up.float()),
                      ("gelu_tanh", F.gelu(gate.float(), approximate="tanh") * up.float()),
                      ("gelu", F.gelu(gate.float()) * up.float())):
        out = fn(gate, up, act)
        assert out.dtype == torch.bfloat16 and rel(out, want) < 1.6e-2, act


# act(+inf) = +inf, act(-inf) = 0 (silu and both gelus), NaN stays NaN; act' tends to 1 at +inf and 0 at -inf.
SPECIAL = {"nan": (float("nan"), float("nan")), "+inf": (float("inf"), float("inf")), "-inf": (-float("inf"), 0.0)}
GRAD_LIMIT = {"nan": float("nan"), "+inf": 1.0, "-inf": 0.0}


@pytest.mark.parametrize("value", SPECIAL)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
def test_special_values_are_the_limits(impl, activation, value):
    """Our kernels at a non-finite gate (up = 1): the activation's limit, and dgate the derivative's limit."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("swiglu").impls[impl].fn
    gate = torch.linspace(-8.0, 8.0, 33, device=dev)  # 33 elements: vectorized paths and a tail
    gate[0] = gate[17] = SPECIAL[value][0]
    gate.requires_grad_(True)
    up = torch.ones(33, device=dev, requires_grad=True)
    out = fn(gate, up, activation)
    limit = SPECIAL[value][1]
    assert all(v == limit or math.isnan(v) and math.isnan(limit) for v in out[[0, 17]].tolist()), out[[0, 17]]
    assert_like_truth(out, truth64("swiglu", gate.detach(), up.detach(), activation), 1e-5,
                      f"swiglu/{impl} activation={activation} at {value}")
    dgate, _ = torch.autograd.grad(out, (gate, up), torch.ones(33, device=dev))
    limit = GRAD_LIMIT[value]
    assert all(g == limit or math.isnan(g) and math.isnan(limit) for g in dgate[[0, 17]].tolist()), dgate[[0, 17]]


def test_public_op_is_the_expression(private_store):
    gate, up = torch.randn(6, 40), torch.randn(6, 40)
    torch.testing.assert_close(tiered_ops.swiglu(gate, up), F.silu(gate) * up)
    torch.testing.assert_close(tiered_ops.swiglu(gate, up, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up)


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_more_than_2_to_the_31_elements(impl):
    # 64-bit indexing: an int32 offset would wrap and write the tail over the head (or fault)
    n = (1 << 31) + 4099
    fn = tiered_ops.get_op("swiglu").impls[impl].fn
    g = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(n, generator=g, device="cuda", dtype=torch.float16) for _ in range(2))
    out = fn(gate, up, "silu")
    for sl in (slice(0, 4096), slice(n - 8192, n)):
        assert rel(out[sl], truth64("swiglu", gate[sl], up[sl])) < 2e-3, sl
    del out, gate, up
    torch.cuda.empty_cache()
