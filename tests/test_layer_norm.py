import pytest
import torch
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, device_for, gpu, rel, tier_cases, truth64

import tiered_ops
from tiered_ops.ops.layer_norm import _problem as P

PROBLEMS = [
    P((1, 4096)),  # 1 row
    P((4096, 1)),  # 1 column: y = bias
    P((1823, 781)),  # no multiple of any block: scalar CUDA path, masked Triton tail
    P((2, 20003)),  # longer than one block, few rows: Triton splits each row over programs
    P((6, 20003)),  # longer than one block, more rows than programs to fill (interpreter: 4): looped paths
    P((64, 256)),  # short rows: several rows per Triton program
    P((4, 6, 33), normalized_shape=(6, 33)),  # normalized over two trailing dims
    P((5, 64), weight=False, bias=False),  # no affine parameters
    P((5, 64), bias=False),  # weight only
    P((5, 64), weight=False),  # bias only
]


@pytest.mark.parametrize("impl,dtype,problem", tier_cases("layer_norm", PROBLEMS))  # helpers.SMALL_TWINS
def test_matches_float64(impl, dtype, problem):
    assert_matches("layer_norm", impl, problem, dtype)


@pytest.mark.parametrize("problem", [P((1823, 781)), P((4, 6, 33), normalized_shape=(6, 33))], ids=str)
def test_compile_tier(problem):
    assert_matches("layer_norm", "compile", problem, torch.float32)


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("shape", [(2, 64, 256, 256), (2, 256, 256, 256), (600, 16385), (600, 40009)], ids=str)
def test_giant_rows(impl, grad, shape):
    # the shape class: few rows of 2^22 and 2^24 elements, normalized over three dims (Triton: split
    # rows); 600 rows of 16385 (40009) take the Triton fused (looped) forward on a GPU (more rows than 4 per SM)
    ns = shape[1:] if len(shape) > 2 else shape[-1:]
    assert_matches("layer_norm", impl, P(shape, normalized_shape=ns), torch.float32, grad=grad)


@gpu
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("shape", [(3, 40000), (300, 65536), (1, 1000000), (4, 64, 256, 256)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_split_over_blocks(dtype, shape, grad):
    # aligned rows over 32768 elements: the CUDA forward splits them over a cooperative grid (pieces of a row on
    # distinct blocks, more pieces than one wave, one row of many pieces, three trailing dims); the backward reads
    # the statistics it wrote
    ns = shape[1:] if len(shape) > 2 else shape[-1:]
    assert_matches("layer_norm", "cuda", P(shape, normalized_shape=ns), dtype, grad=grad)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_trailing_dim_through_movedim(impl):
    # a normalization over dim 1 of (N, C, L) is layer_norm over the last dim of x.movedim(1, -1): a strided view
    dev = device_for(impl)
    fn = tiered_ops.get_op("layer_norm").impls[impl].fn
    x = torch.randn(6, 40, 9, device=dev).movedim(1, -1)
    w, b = torch.randn(40, device=dev), torch.randn(40, device=dev)
    assert not x.is_contiguous()
    assert rel(fn(x, (40,), w, b), truth64("layer_norm", x, (40,), w, b)) < 1e-5


@pytest.mark.parametrize("n", [100, 20003, pytest.param(65536, marks=gpu)], ids=["one-block", "looped", "split"])
@pytest.mark.parametrize("impl", IMPLS)
def test_special_values_match_the_math(impl, n):
    # (x - mean) / sqrt(var + eps) * w + b in IEEE float64: a NaN makes its row NaN, and so does a +-inf (the mean is
    # infinite, x - mean is -inf or NaN, the variance NaN); the other rows are untouched
    dev = device_for(impl)
    fn = tiered_ops.get_op("layer_norm").impls[impl].fn
    y, w, b = torch.randn(5, n, device=dev), torch.randn(n, device=dev), torch.randn(n, device=dev)
    y[0, 3] = float("nan")
    y[1, :] = float("-inf")
    y[2, n - 1] = float("inf")
    y[3, 0], y[3, 7] = float("inf"), float("-inf")
    want = truth64("layer_norm", y, (n,), w, b)
    assert want[:4].isnan().all() and want[4].isfinite().all()
    assert_like_truth(fn(y, (n,), w, b), want, 1e-5, f"layer_norm/{impl} special values, rows of {n}")


@pytest.mark.parametrize("problem", [P((2, 20003)), P((6, 20003), bias=False)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_split_and_looped_rows_backward(dtype, problem):
    # on the interpreter (4 programs to fill) 2 rows take the split-row kernels and 6 rows the looped ones
    assert_matches("layer_norm", "triton", problem, dtype, grad=True)
