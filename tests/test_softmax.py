import pytest
import torch
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, device_for, gpu, rel, tier_cases, truth64

import tiered_ops
from tiered_ops.ops.softmax import _problem as P

PROBLEMS = [
    P((1, 4096)),  # 1 row
    P((4096, 1)),  # 1 column: every output is 1
    P((1823, 781)),  # no multiple of any block: masked tails, non-16-byte rows (CUDA scalar path)
    P((3, 20003)),  # longer than one block: Triton/CUDA looped paths
    P((64, 256)),  # short rows: several rows per Triton program, one warp per CUDA row
    P((4, 5, 6), dim=1),  # middle dim: moved last and made contiguous
    P((7,)),  # 1-D
]


@pytest.mark.parametrize("impl,dtype,problem", tier_cases("softmax", PROBLEMS))  # helpers.SMALL_TWINS
def test_matches_float64(impl, dtype, problem):
    assert_matches("softmax", impl, problem, dtype)


@pytest.mark.parametrize("problem", [P((1823, 781)), P((3, 20003))], ids=str)
def test_compile_tier(problem):
    assert_matches("softmax", "compile", problem, torch.float32)


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_giant_row(impl, dtype):
    # 2^22 elements in one row: far beyond any block; torch.compile and Liger are weakest here.
    assert_matches("softmax", impl, P((2, 1 << 22)), dtype)


@gpu
@pytest.mark.parametrize("shape", [(3, 65536), (7, 65540), (12, 250000), (2, 393216), (300, 40000), (1, 450000),
                                   (40, 393216), (1, 900000)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_over_a_cluster(dtype, shape):
    # Aligned rows too long for registers: the CUDA tier's persistent row groups (a row over 2 to 64 blocks in
    # clusters of 2, one cluster a row or several merged through the workspace, shares that do not divide evenly,
    # more rows than groups so each group takes several rows, fewer rows than groups), else its block per row.
    assert_matches("softmax", "cuda", P(shape), dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("softmax").impls[impl]
    assert fn.why_not(dev) is None
    x = torch.randn(300, 130, device=dev).t()  # transposed: rows are strided
    assert rel(fn.fn(x, -1), truth64("softmax", x, -1)) < 1e-5


@pytest.mark.parametrize("n", [100, 20003, pytest.param(65536, marks=gpu)], ids=["one-block", "looped", "cluster"])
@pytest.mark.parametrize("impl", IMPLS)
def test_special_values_match_the_math(impl, n):
    # exp(x - max) / sum in IEEE float64: a NaN, a +inf (inf / inf) or an all -inf row (0 / 0) is NaN everywhere,
    # a single -inf is exactly 0 there and the rest of its row is the softmax of the rest
    dev = device_for(impl)
    fn = tiered_ops.get_op("softmax").impls[impl].fn
    y = torch.randn(6, n, device=dev)
    y[0, 3] = float("nan")
    y[1, :] = float("-inf")
    y[2, 5] = float("-inf")
    y[3, n - 1] = float("inf")
    y[4, 0], y[4, 7] = float("inf"), float("-inf")
    want = truth64("softmax", y, -1)
    assert want[[0, 1, 3, 4]].isnan().all() and want[2, 5].item() == 0.0 and want[[2, 5]].isfinite().all()
    assert_like_truth(fn(y, -1), want, 1e-5, f"softmax/{impl} special values, rows of {n}")


@pytest.mark.parametrize("impl", IMPLS)
def test_empty(impl):
    dev = device_for(impl)
    out = tiered_ops.get_op("softmax").impls[impl].fn(torch.empty(0, 7, device=dev), -1)
    assert out.shape == (0, 7)
