import pytest
import torch
from helpers import DTYPES, IMPLS, assert_matches, device_for, gpu, ref64, rel

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
        assert rel(fn(x, b, approx), ref64("gelu", x, b, approx)) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_propagate_like_eager(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("gelu").impls[impl].fn
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0]], device=dev)
    torch.testing.assert_close(fn(x, None, "none").cpu(), torch.nn.functional.gelu(x).cpu(), equal_nan=True)


@pytest.mark.parametrize("impl", ["eager", "triton", pytest.param("cuda", marks=gpu)])
def test_bad_input_names_the_argument(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("gelu").impls[impl].fn
    x = torch.randn(4, 8, device=dev)
    with pytest.raises((ValueError, RuntimeError), match="bias"):
        fn(x, torch.randn(4, device=dev), "none")
    with pytest.raises((ValueError, RuntimeError), match="approximate"):
        fn(x, None, "sigmoid")


@gpu
@pytest.mark.parametrize("op", ["gelu", "muladd"])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_more_than_2_to_the_31_elements(op, impl):
    # 64-bit indexing: an int32 offset would wrap and write the tail over the head (or fault)
    n = (1 << 31) + 4099
    fn = tiered_ops.get_op(op).impls[impl].fn
    g = torch.Generator(device="cuda").manual_seed(0)
    args = [torch.randn(n, generator=g, device="cuda", dtype=torch.float16) for _ in range(1 if op == "gelu" else 3)]
    out = fn(*args) if op == "muladd" else fn(args[0], None, "none")
    for sl in (slice(0, 4096), slice(n - 8192, n)):
        part = [a[sl] for a in args]
        ref = ref64(op, *part) if op == "muladd" else ref64("gelu", part[0])
        assert rel(out[sl], ref) < 2e-3, sl
    del out, args
    torch.cuda.empty_cache()
