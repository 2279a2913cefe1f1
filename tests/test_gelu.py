import math

import pytest
import torch
from helpers import (
    DTYPES,
    IMPLS,
    assert_like_truth,
    assert_matches,
    device_for,
    gpu,
    op_impls,
    rel,
    torch_gelu_deviation,
    truth64,
    xfail_if,
)

import tiered_ops
from tiered_ops.ops.gelu import _problem as P

PROBLEMS = [
    P((1,)),  # one element: the scalar tail only
    P((1823, 781)),  # a tail after every block size; the bias row is no multiple of the CUDA pack
    P((3, 1, 5)),  # size-1 dim
    P((100003,), bias=False),  # several blocks plus a tail
    P((64, 256)),  # exact multiple: the 16-byte CUDA path with no tail
    P((64, 256), approximate="tanh"),  # tanh approximation
    P((7, 33), bias=False, approximate="tanh"),
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_float64(impl, dtype, problem):
    assert_matches("gelu", impl, problem, dtype)


def test_compile_tier():
    assert_matches("gelu", "compile", P((1823, 781)), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_extremes(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("gelu").impls[impl].fn
    x = torch.randn(70, 50, device=dev).t() * 30  # strided, both tails (gelu -> 0 and gelu -> x)
    b = torch.randn(70, device=dev)
    for approx in ("none", "tanh"):
        assert rel(fn(x, b, approx), truth64("gelu", x, b, approx)) < 1e-6


# gelu at a special value is its limit there, for both approximations: gelu(+inf) = +inf, gelu(-inf) = 0 (x * Phi(x)
# -> 0), gelu(NaN) = NaN; its derivative tends to 1 at +inf and 0 at -inf. The formula 0.5 * x * (1 + erf(...)) alone
# gives -inf * 0 = NaN at -inf: our kernels take the limits there.
SPECIAL = {"nan": (float("nan"), float("nan")), "+inf": (float("inf"), float("inf")), "-inf": (-float("inf"), 0.0)}
GRAD_LIMIT = {"nan": float("nan"), "+inf": 1.0, "-inf": 0.0}


@pytest.mark.parametrize("value", SPECIAL)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("impl", IMPLS)
def test_special_values_match_the_math(impl, approximate, value, request):
    dev = device_for(impl)
    v, limit = SPECIAL[value]
    if impl == "eager":
        xfail_if(request, torch_gelu_deviation(dev.type, approximate, v))
    fn = tiered_ops.get_op("gelu").impls[impl].fn
    x = torch.linspace(-8.0, 8.0, 33, device=dev)  # 33 elements: vectorized paths and a tail
    x[0] = x[17] = v
    want = truth64("gelu", x, None, approximate)
    assert all(w == limit or math.isnan(w) and math.isnan(limit) for w in want[[0, 17]].tolist())
    assert_like_truth(fn(x, None, approximate), want, 1e-5, f"gelu/{impl} approximate={approximate} at {value}")


@pytest.mark.parametrize("value", SPECIAL)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
def test_special_values_of_the_gradient_are_its_limits(impl, approximate, value):
    """Our backward kernels: gelu'(+inf) = 1, gelu'(-inf) = 0, NaN at NaN; finite entries as the float64 math."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("gelu").impls[impl].fn
    x = torch.linspace(-8.0, 8.0, 33, device=dev)
    x[0] = x[17] = SPECIAL[value][0]
    x.requires_grad_(True)
    (dx,) = torch.autograd.grad(fn(x, None, approximate), x, torch.ones(33, device=dev))
    limit = GRAD_LIMIT[value]
    assert all(g == limit or math.isnan(g) and math.isnan(limit) for g in dx[[0, 17]].tolist()), dx[[0, 17]]
    x64 = x.detach().double()[1:17].requires_grad_(True)
    (want,) = torch.autograd.grad(truth64("gelu", x64, None, approximate).sum(), x64)
    assert rel(dx[1:17], want) < 1e-5


@gpu
@pytest.mark.parametrize("op,impl", op_impls(["gelu", "muladd"], ["triton", "cuda"]))
def test_more_than_2_to_the_31_elements(op, impl):
    # 64-bit indexing: an int32 offset would wrap and write the tail over the head (or fault)
    n = (1 << 31) + 4099
    fn = tiered_ops.get_op(op).impls[impl].fn
    g = torch.Generator(device="cuda").manual_seed(0)
    args = [torch.randn(n, generator=g, device="cuda", dtype=torch.float16) for _ in range(1 if op == "gelu" else 3)]
    out = fn(*args) if op == "muladd" else fn(args[0], None, "none")
    for sl in (slice(0, 4096), slice(n - 8192, n)):
        part = [a[sl] for a in args]
        ref = truth64(op, *part) if op == "muladd" else truth64("gelu", part[0])
        assert rel(out[sl], ref) < 2e-3, sl
    del out, args
    torch.cuda.empty_cache()
