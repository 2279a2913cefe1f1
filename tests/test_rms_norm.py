import pytest
import torch
from helpers import (
    DTYPES,
    IMPLS,
    assert_like_truth,
    assert_matches,
    device_for,
    gpu,
    rel,
    tier_cases,
    torch_rms_norm_deviation,
    truth64,
    xfail_if,
)

import tiered_ops
from tiered_ops.ops.rms_norm import _problem as P

PROBLEMS = [
    P((1, 4096)),  # 1 row
    P((4096, 1)),  # 1 column
    P((1823, 781)),  # no multiple of any block: scalar CUDA path, masked Triton tail
    P((2, 20003)),  # longer than one block: looped paths
    P((64, 256)),  # short rows: several rows per Triton program
    P((4, 6, 33), normalized_shape=(6, 33)),  # normalized over two trailing dims
    P((5, 64), weight=False),  # no weight
    P((64, 256), weight_offset=1.0),  # Hugging Face's Gemma form: (1 + w) in fp32, one rounding
    P((64, 256), cast_before_weight=True),  # Hugging Face's Llama form: rounded to x's dtype, then the weight
]


@pytest.mark.parametrize("impl,dtype,problem", tier_cases("rms_norm", PROBLEMS))  # helpers.SMALL_TWINS
def test_matches_float64(impl, dtype, problem):
    assert_matches("rms_norm", impl, problem, dtype)


@pytest.mark.parametrize("problem", [P((1823, 781)), P((4, 6, 33), normalized_shape=(6, 33))], ids=str)
def test_compile_tier(problem):
    assert_matches("rms_norm", "compile", problem, torch.float32)


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_giant_row(impl):
    assert_matches("rms_norm", impl, P((2, 1 << 22)), torch.bfloat16)


@gpu
@pytest.mark.parametrize("n", [4, 8, 12, 24, 40, 64, 96, 136, 256, 264, 512, 520, 1024, 1032])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_short_rows_of_every_width(dtype, n):
    # the CUDA kernel's short-row layouts: 1-4 packs a thread, 1-32 threads a row, 37 rows (a block's rows past the
    # end), widths of a pack up to 129 packs (the first past them), and widths between the powers of two
    assert_matches("rms_norm", "cuda", P((37, n)), dtype)


@gpu
@pytest.mark.parametrize("problem", [
    P((5000, 4096)),  # the decoders' width
    P((5000, 1032)),  # the narrowest row it takes: 129 packs, most threads holding one
    P((4999, 5120), weight=False),
    P((5000, 2048), weight_offset=1.0),
    P((5000, 2048), cast_before_weight=True),
], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_many_16_bit_rows(dtype, problem):
    # many rows of 1025-5120 16-bit elements (the widths a layout holding rows in flight across a persistent grid would
    # take: more rows than two for each of 8 blocks an SM up to 312 SMs), rows not a multiple of any grid
    assert_matches("rms_norm", "cuda", problem, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_default_eps(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("rms_norm").impls[impl].fn
    x = torch.randn(96, 40, device=dev).t()  # (40, 96), strided
    w = torch.randn(96, device=dev)
    assert rel(fn(x, (96,), w), truth64("rms_norm", x, (96,), w, torch.finfo(torch.float32).eps)) < 1e-5
    # eps=None is finfo(x.dtype).eps, as in F.rms_norm: visible on a row of tiny values (1e-4 / sqrt(1e-8 + 1.2e-7)).
    tiny = torch.full((2, 8), 1e-4, device=dev)
    want = truth64("rms_norm", tiny, (8,))
    assert want[0, 0].item() == pytest.approx(1e-4 / (1e-8 + torch.finfo(torch.float32).eps) ** 0.5, rel=1e-6)
    assert rel(fn(tiny, 8), want) < 1e-5


@pytest.mark.parametrize("n", [100, 20003], ids=["one-block", "looped"])
@pytest.mark.parametrize("impl", IMPLS)
def test_special_values_match_the_math(impl, n, request):
    # x / sqrt(mean(x^2) + eps) * w in IEEE float64: a NaN makes its row NaN; in a row holding +-inf the mean square
    # is inf, so each infinite entry is NaN (inf / inf) and each finite one 0
    dev = device_for(impl)
    if impl == "eager":
        xfail_if(request, torch_rms_norm_deviation(dev.type, n))
    fn = tiered_ops.get_op("rms_norm").impls[impl].fn
    y, w = torch.randn(5, n, device=dev), torch.randn(n, device=dev)
    y[0, 3] = float("nan")
    y[1, :] = float("-inf")
    y[2, n - 1] = float("inf")
    y[3, 0], y[3, 7] = float("inf"), float("-inf")
    want = truth64("rms_norm", y, (n,), w)
    assert want[[0, 1]].isnan().all() and want[2, -1].isnan() and want[3, [0, 7]].isnan().all()
    assert (want[2, :-1] == 0).all() and want[4].isfinite().all()
    assert_like_truth(fn(y, (n,), w), want, 1e-5, f"rms_norm/{impl} special values, rows of {n}")
