import pytest
import torch
from helpers import DTYPES, IMPLS, assert_matches, device_for, gpu, ref64, rel

import tiered_ops
from tiered_ops.ops.muladd import _problem as P

PROBLEMS = [
    P((1,)),  # one element: the scalar tail only
    P((1823, 781)),  # a tail after every block size
    P((3, 1, 5)),  # size-1 dim
    P((100003,)),  # several blocks plus a tail
    P((64, 256)),  # exact multiple: the 16-byte CUDA path with no tail
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS + ["eager_addcmul"])
def test_matches_float64(impl, dtype, problem):
    assert_matches("muladd", impl, problem, dtype)


def test_compile_tier():
    assert_matches("muladd", "compile", P((1823, 781)), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_misaligned(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("muladd").impls[impl].fn
    a, b = torch.randn(50, 70, device=dev).t(), torch.randn(70, 50, device=dev)
    c = torch.randn(70 * 50 + 1, device=dev)[1:].view(70, 50)  # storage offset: not 16-byte aligned
    assert rel(fn(a, b, c), ref64("muladd", a, b, c)) < 1e-6


@pytest.mark.parametrize("impl", ["eager", "triton", pytest.param("cuda", marks=gpu)])
def test_shape_mismatch_is_a_clear_error(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("muladd").impls[impl].fn
    with pytest.raises((ValueError, RuntimeError), match="same shape"):
        fn(torch.randn(4, 5, device=dev), torch.randn(4, 5, device=dev), torch.randn(5, 4, device=dev))


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_cpu_tensor_to_gpu_tier_is_rejected(impl):
    fn = tiered_ops.get_op("muladd").impls[impl].fn
    x = torch.randn(8)
    with pytest.raises((ValueError, RuntimeError), match="a must be a CUDA tensor"):
        fn(x, x, x)
