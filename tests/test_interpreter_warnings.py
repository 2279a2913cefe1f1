"""Triton kernels on the CPU interpreter (numpy maths) raise no RuntimeWarning on inputs whose results are defined:
masked lanes and rows past the input are -inf, and an all -inf row must come out NaN (as torch's does) without an
invalid ``-inf - -inf`` being computed. (A +inf input is left out: its NaN comes from a real ``inf - inf``.)"""

import warnings

import pytest
import torch

import tiered_ops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter runs where there is no GPU")


def _no_runtime_warnings(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return fn(*args)


@pytest.mark.parametrize("n", [33, 20003], ids=["rows-kernel", "looped"])
def test_softmax_triton_on_masked_lanes_and_all_minus_inf_rows(n):
    fn = tiered_ops.get_op("softmax").impls["triton"].fn
    x = torch.randn(5, n)  # 5 rows: a block of rows reaches past the input; n not a power of two: masked lanes
    x[1, :] = float("-inf")
    x[2, ::3] = float("-inf")
    x[3, 4] = float("nan")
    x[4] -= 200.0  # exp(0 - max) of a masked lane would overflow
    x.requires_grad_(True)
    y = _no_runtime_warnings(fn, x, -1)
    want = torch.softmax(x.detach().double(), -1)
    assert y[1].isnan().all() and y[3].isnan().all()  # torch's results: NaN rows
    torch.testing.assert_close(y.detach().double(), want, rtol=1e-5, atol=1e-7, equal_nan=True)
    dy = torch.randn_like(y)
    (dx,) = _no_runtime_warnings(torch.autograd.grad, y, x, dy)
    ok = [0, 2, 4]
    want_dx = want[ok] * (dy[ok].double() - (dy[ok].double() * want[ok]).sum(-1, keepdim=True))
    torch.testing.assert_close(dx[ok].double(), want_dx, rtol=1e-4, atol=1e-6)


def test_cross_entropy_triton_on_masked_lanes_and_minus_inf_logits():
    fn = tiered_ops.get_op("cross_entropy").impls["triton"].fn
    x = torch.randn(6, 33)  # 33 classes: the block's lanes past them stay -inf
    x[2, 5:] = float("-inf")
    x[3, :32] = float("-inf")
    t = torch.tensor([0, 32, 1, 32, 7, -100])
    x.requires_grad_(True)
    loss = _no_runtime_warnings(fn, x, t, -100, "none")
    want = torch.nn.functional.cross_entropy(x.detach().double(), t, ignore_index=-100, reduction="none")
    torch.testing.assert_close(loss.detach().double(), want, rtol=1e-5, atol=1e-6)
    (dx,) = _no_runtime_warnings(torch.autograd.grad, loss.sum(), x)
    x64 = x.detach().double().requires_grad_(True)
    (want_dx,) = torch.autograd.grad(torch.nn.functional.cross_entropy(x64, t, reduction="sum"), x64)
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-6)
