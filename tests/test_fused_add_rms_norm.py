import pytest
import torch
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, device_for, gpu, rel, tier_cases, truth64

import tiered_ops
from tiered_ops.ops.fused_add_rms_norm import _problem as P

OP = "fused_add_rms_norm"
PROBLEMS = [
    P((1, 4096)),  # 1 row (decode)
    P((8, 4096)),  # a few rows: one Triton program each, a short persistent backward grid
    P((4096, 1)),  # 1 column
    P((1823, 781)),  # no multiple of any block: scalar CUDA path, masked Triton tail
    P((2, 20003)),  # longer than the backward's register-resident rows: looped backward
    P((64, 256)),  # short rows: several rows per Triton program and per CUDA block
    P((4, 6, 33), normalized_shape=(6, 33)),  # normalized over two trailing dims
    P((5, 64), weight=False),  # no weight
    P((0, 16)),  # empty
    P((64, 256), weight_offset=1.0),  # Hugging Face's Gemma form on the sum
    P((64, 256), cast_before_weight=True),  # Hugging Face's Llama form on the sum
]


@pytest.mark.parametrize("impl,dtype,problem", tier_cases(OP, PROBLEMS))  # helpers.SMALL_TWINS
def test_matches_float64(impl, dtype, problem):
    assert_matches(OP, impl, problem, dtype)


# The gradients of both outputs (dy and d_new_residual both random: dx = dresidual = d_new_residual + rms_norm's
# backward of dy) at every edge problem (1823x781, 2x40009, no weight, ...) and dtype, at every tier:
# tests/test_backward.py::test_gradients_match_float64 (the gate draws a random gradient for each output).


@pytest.mark.parametrize("problem", [P((1823, 781)), P((4, 6, 33), normalized_shape=(6, 33))], ids=str)
def test_compile_tier(problem):
    assert_matches(OP, "compile", problem, torch.float32, grad=True)


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_giant_row(impl):
    assert_matches(OP, impl, P((2, 1 << 22)), torch.bfloat16, grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_new_residual_is_the_rounded_sum_and_y_is_normalized_from_it(impl, dtype):
    # new_residual is torch's x + residual bit for bit (one rounding; the Triton interpreter truncates bf16, so there
    # within an ulp); y is rms_norm of that rounded sum, not of the exact one
    dev = device_for(impl)
    fn = tiered_ops.get_op(OP).impls[impl].fn
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(16, 512, generator=g, device=dev).to(dtype)
    r = (100 * torch.randn(16, 512, generator=g, device=dev)).to(dtype)  # the sum loses x's low bits
    w = torch.randn(512, generator=g, device=dev).to(dtype)
    y, s = fn(x, r, (512,), w)
    want_s = x + r
    if dev.type == "cpu" and impl == "triton" and dtype == torch.bfloat16:
        assert ((s.float() - want_s.float()).abs() <= want_s.float().abs() * 2.0 ** -7).all()
    else:
        assert torch.equal(s, want_s)
    want_y = truth64(OP, want_s, torch.zeros_like(want_s), (512,), w)[0]
    assert_like_truth(y, want_y, {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype],
                      f"{OP}/{impl} y from the rounded sum")


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_default_eps(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op(OP).impls[impl].fn
    x = torch.randn(96, 40, device=dev).t()  # (40, 96), strided
    r = torch.randn(40, 96, device=dev)
    w = torch.randn(96, device=dev)
    y, s = fn(x, r, (96,), w)
    want_y, want_s = truth64(OP, x, r, (96,), w, torch.finfo(torch.float32).eps)
    assert rel(y, want_y) < 1e-5 and rel(s, want_s) < 1e-6
    # eps=None is finfo(x.dtype).eps, as in F.rms_norm: visible on a row of tiny values
    tiny = torch.full((2, 8), 5e-5, device=dev)
    want = truth64(OP, tiny, tiny, (8,))[0]
    assert want[0, 0].item() == pytest.approx(1e-4 / (1e-8 + torch.finfo(torch.float32).eps) ** 0.5, rel=1e-6)
    assert rel(fn(tiny, tiny, 8)[0], want) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_only_one_output_used_in_backward(impl):
    # a graph that uses y alone (or new_residual alone): the other output's gradient is zero, not garbage
    dev = device_for(impl)
    fn = tiered_ops.get_op(OP).impls[impl].fn
    x, r = torch.randn(6, 48, device=dev, requires_grad=True), torch.randn(6, 48, device=dev, requires_grad=True)
    w = torch.randn(48, device=dev, requires_grad=True)
    dy = torch.randn(6, 48, device=dev)
    x64, r64, w64 = (t.detach().double().requires_grad_(True) for t in (x, r, w))
    for pick in (0, 1):
        got = torch.autograd.grad(fn(x, r, (48,), w)[pick], (x, r, w), dy, allow_unused=True)
        want = torch.autograd.grad(truth64(OP, x64, r64, (48,), w64)[pick], (x64, r64, w64), dy.double(),
                                   allow_unused=True)
        assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5
        if pick == 1:
            assert got[2] is None or torch.count_nonzero(got[2]) == 0
        else:
            assert rel(got[2], want[2]) < 1e-5


@pytest.mark.parametrize("n", [100, 40009], ids=["one-block", "looped"])
@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
def test_special_values_match_the_math(impl, n):
    # as rms_norm's, of the sum: a NaN makes its row of y NaN; in a row holding +-inf each infinite entry of y is NaN
    # (inf / inf) and each finite one 0; new_residual is the IEEE sum
    dev = device_for(impl)
    fn = tiered_ops.get_op(OP).impls[impl].fn
    x, r, w = torch.randn(4, n, device=dev), torch.randn(4, n, device=dev), torch.randn(n, device=dev)
    x[0, 3] = float("nan")
    r[1, 0], r[1, 7] = float("inf"), float("-inf")
    x[2, 5], r[2, 5] = float("inf"), float("-inf")  # inf - inf: NaN in the sum
    y, s = fn(x, r, (n,), w)
    want_y, want_s = truth64(OP, x, r, (n,), w)
    assert want_y[0].isnan().all() and want_y[1, [0, 7]].isnan().all() and (want_y[1, 1:7] == 0).all()
    assert want_y[3].isfinite().all()
    assert_like_truth(s, want_s, 1e-7, f"{OP}/{impl} special values: new_residual")
    assert_like_truth(y, want_y, 1e-5, f"{OP}/{impl} special values: y")


def test_public_op_returns_both_outputs_and_trains(private_decisions):
    """The public op's two outputs and their gradients. Tuning off: the call runs its prediction instead of measuring
    every tier (compiles included: 47 s of this test on a 2-core CPU), which is not what this test is about."""
    x = torch.randn(6, 32, requires_grad=True)
    r = torch.randn(6, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    y, s = tiered_ops.fused_add_rms_norm(x, r, 32, w)
    assert y.shape == s.shape == (6, 32) and y.requires_grad and s.requires_grad
    (y.sum() + 2 * s.sum()).backward()
    assert x.grad is not None and torch.equal(x.grad, r.grad) and w.grad is not None
