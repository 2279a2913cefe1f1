import pytest
import torch
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, device_for, gpu, truth64

import tiered_ops
from tiered_ops.ops.cross_entropy import _problem as P

PROBLEMS = [
    P((1, 1000)),  # one row
    P((3, 1001)),  # V no multiple of any block or pack: masked Triton tail, scalar CUDA path
    P((2, 20003)),  # a row longer than one Triton block: the looped path
    P((64, 256)),  # many short rows
    P((9, 64), ignored=1.0),  # every target ignored: NaN mean, zero gradient
    P((16, 100), ignored=0.25),  # some targets ignored
    P((7, 129), label_smoothing=0.1, ignored=0.25),  # label smoothing with ignored rows
    P((5, 77), label_smoothing=1.0),  # all smoothing: the target's logit drops out
    P((6, 33), reduction="none", ignored=0.25),  # per-row losses, ignored rows 0
    P((6, 33), reduction="sum", label_smoothing=0.2),  # summed
    P((9, 64), reduction="sum", ignored=1.0),  # every target ignored: the sum is 0
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_float64(impl, dtype, problem):
    assert_matches("cross_entropy", impl, problem, dtype)


@pytest.mark.parametrize("problem", [P((7, 129), label_smoothing=0.1, ignored=0.25), P((6, 33), reduction="none"),
                                     P((6, 33), reduction="sum")], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_float64(impl, dtype, problem):
    assert_matches("cross_entropy", impl, problem, dtype, seed=5, grad=True)


@pytest.mark.parametrize("problem", [P((3, 1001)), P((6, 33), reduction="none", label_smoothing=0.1, ignored=0.25)],
                         ids=str)
def test_compile_tier(problem):
    assert_matches("cross_entropy", "compile", problem, torch.float32, grad=True)


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("problem", [P((4, 128256), ignored=0.25), P((2, 262144), label_smoothing=0.1),
                                     P((8, 128255), reduction="none")], ids=str)
def test_vocabulary_sized_rows(impl, problem):
    assert_matches("cross_entropy", impl, problem, torch.bfloat16, grad=True)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 9, 1001, 50257])
def test_rows_off_the_pack_boundary(dtype, n):
    # the CUDA forward's head of single elements, packs and tail: an odd vocabulary (rows start anywhere), a base one
    # element past a 16-byte boundary, a row stride of n + 3; label smoothing reads every element (not at n = 1: the
    # loss is then 0 exactly, and lse - 0.9 x - 0.1 x rounds away from it), a row is ignored
    fn = tiered_ops.get_op("cross_entropy").impls["cuda"].fn
    rows, rtol = 11, {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    base = (torch.randn(rows * (n + 3) + 1, device="cuda") * 4).to(dtype)
    t = torch.randint(0, n, (rows,), device="cuda")
    t[4] = -100
    for logits in (base[1:1 + rows * n].view(rows, n), base[1:].as_strided((rows, n), (n + 3, 1))):
        smoothing = 0.1 if n > 1 else 0.0
        want = truth64("cross_entropy", logits, t, -100, "none", smoothing)
        assert_like_truth(fn(logits, t, -100, "none", smoothing), want, rtol, f"{tuple(logits.stride())}")


@pytest.mark.parametrize("impl", IMPLS)
def test_output_dtype_and_shape_are_torchs(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("cross_entropy").impls[impl].fn
    x, t = torch.randn(5, 40, device=dev), torch.randint(0, 40, (5,), device=dev)
    for dtype in DTYPES:
        for reduction in ("mean", "sum", "none"):
            want = torch.nn.functional.cross_entropy(x.to(dtype), t, reduction=reduction)
            got = fn(x.to(dtype), t, -100, reduction)
            assert (got.dtype, got.shape) == (want.dtype, want.shape), (dtype, reduction)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_is_scaled_by_any_output_gradient(impl):
    # the backward multiplies by the output gradient: 0, negative, large, and per row for reduction none
    dev = device_for(impl)
    fn = tiered_ops.get_op("cross_entropy").impls[impl].fn
    x = torch.randn(6, 50, device=dev, dtype=torch.float64).float()
    t = torch.tensor([3, -100, 0, 49, 7, -100], device=dev)
    for reduction, g in [("mean", torch.tensor(0.0)), ("mean", torch.tensor(-3.5)), ("sum", torch.tensor(1e4)),
                         ("none", torch.tensor([1.0, 2.0, -1.0, 0.0, 5.0, 3.0]))]:
        xl = x.detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(fn(xl, t, -100, reduction), xl, g.to(dev))
        x64 = x.detach().double().requires_grad_(True)
        (want,) = torch.autograd.grad(truth64("cross_entropy", x64, t, -100, reduction), x64, g.double().to(dev))
        assert_like_truth(dx, want, 1e-5, f"cross_entropy/{impl} gradient, {reduction}, output gradient {g}")


@pytest.mark.parametrize("impl", IMPLS)
def test_ignore_index_may_be_a_class(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("cross_entropy").impls[impl].fn
    x, t = torch.randn(8, 30, device=dev), torch.tensor([0, 1, 2, 0, 5, 0, 29, 3], device=dev)
    for reduction in ("mean", "none"):
        assert_like_truth(fn(x, t, 0, reduction, 0.1), truth64("cross_entropy", x, t, 0, reduction, 0.1), 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_logits(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("cross_entropy").impls[impl].fn
    x = torch.randn(300, 12, device=dev).t()  # (12, 300), column-major
    wide = torch.randn(12, 400, device=dev)[:, 50:350]  # (12, 300), a row stride of 400
    t = torch.randint(0, 300, (12,), device=dev)
    for logits in (x, wide):
        assert_like_truth(fn(logits, t, -100, "none"), truth64("cross_entropy", logits, t, -100, "none"), 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_special_values_match_the_math(impl):
    # the IEEE evaluation of lse - x[t]: a NaN or +inf in a row makes its loss NaN; a -inf logit at the target
    # makes it +inf; an all -inf row is NaN; an ignored row is 0 whatever it holds
    dev = device_for(impl)
    fn = tiered_ops.get_op("cross_entropy").impls[impl].fn
    x = torch.randn(6, 5000, device=dev)
    x[0, 3] = float("nan")
    x[1, 17] = float("inf")
    x[2, 9] = float("-inf")
    x[3, :] = float("-inf")
    x[4, 0] = float("nan")
    t = torch.tensor([1, 2, 9, 4, -100, 8], device=dev)
    want = truth64("cross_entropy", x, t, -100, "none")
    assert want[[0, 1, 3]].isnan().all() and want[2].item() == float("inf") and want[4].item() == 0.0
    assert_like_truth(fn(x, t, -100, "none"), want, 1e-5, f"cross_entropy/{impl} special values")


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_a_target_out_of_range_makes_its_row_nan_on_the_gpu(impl):
    # the kernels do not sync to check targets: the contract is a NaN row (and a NaN mean), never a bad read
    fn = tiered_ops.get_op("cross_entropy").impls[impl].fn
    x = torch.randn(4, 1000, device="cuda", requires_grad=True)
    t = torch.tensor([1, 1000, -100, -3], device="cuda")
    loss = fn(x, t, -100, "none")
    assert loss[[1, 3]].isnan().all() and loss[0].isfinite() and loss[2].item() == 0.0
    (dx,) = torch.autograd.grad(loss, x, torch.ones(4, device="cuda"))
    assert dx[[1, 3]].isnan().all() and dx[0].isfinite().all() and (dx[2] == 0).all()
    assert fn(x, t).isnan()


def test_public_op_trains():
    x = torch.randn(6, 20, requires_grad=True)
    t = torch.tensor([1, 2, -100, 4, 5, 19])
    loss = tiered_ops.cross_entropy(x, t, label_smoothing=0.1)
    loss.backward()
    x64 = x.detach().double().requires_grad_(True)
    want = truth64("cross_entropy", x64, t, -100, "mean", 0.1)
    want.backward()
    assert_like_truth(loss, want, 1e-5)
    assert_like_truth(x.grad, x64.grad, 1e-5, "gradient")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float32_loss_from_half_logits_is_the_upcast_loss(impl, reduction):
    """dtype=torch.float32 gives the loss of the logits cast to float32 (the loss transformers computes), without the
    cast: a float32 loss, and the gradient in the logits' own dtype, both as the upcast path gives them."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("cross_entropy").impls[impl].fn
    for dtype in (torch.bfloat16, torch.float16):
        x = (2 * torch.randn(6, 300, device=dev)).to(dtype).requires_grad_()
        t = torch.randint(0, 300, (6,), device=dev)
        t[2] = -100
        got = fn(x, t, -100, reduction, dtype=torch.float32)
        assert got.dtype == torch.float32, (dtype, got.dtype)
        x64 = x.detach().double().requires_grad_()
        want = torch.nn.functional.cross_entropy(x64, t, reduction=reduction)
        # float32 accuracy: no bf16/fp16 rounding of the loss (which would be up to 2^-9 / 2^-12 relative)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
        g = torch.rand_like(got)
        (dx,) = torch.autograd.grad(got, x, g)
        (dx64,) = torch.autograd.grad(want, x64, g.double())
        assert dx.dtype == dtype
        torch.testing.assert_close(dx.double(), dx64.to(dtype).double(), rtol=0.02, atol=1e-3)

