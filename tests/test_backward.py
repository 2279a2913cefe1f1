"""Backward at every tier: gradients against float64 autograd of the reference, gradcheck, modes, dispatch."""

import pytest
import torch
from helpers import (
    IMPLS,
    assert_like_truth,
    assert_matches,
    aten_ops,
    builtin_ops,
    cpp_node_name,
    device_for,
    gpu,
    impls_of,
    name_and_marks,
    op_impls,
    tier_dtype_problems,
    truth64,
)

import tiered_ops
from tiered_ops.measure.measure import measure
from tiered_ops.registry import as_outputs
from tiered_ops.runtime import memo
from tiered_ops.tiers.catalog import get_op

OPS = [s.name for s in builtin_ops()]


def _grad_problems(op):
    """Every edge problem of the op (1 row, 1 column, odd sizes, rows longer than a block, empty, ...)."""
    return get_op(op).edge_problems()


# each tier of IMPLS the op has, at each of its edge problems, in each dtype (the interpreted Triton tier's big
# shapes in float32, its other dtypes at their small twins: tier_dtype_problems)
GRAD_CASES = [pytest.param(name, op, p, d, marks=marks, id=f"{name}-{op}-{p}-{d}")
              for op in OPS for name, marks in map(name_and_marks, impls_of(op, IMPLS))
              for d, p in tier_dtype_problems(op, name, _grad_problems(op))]


def _floating(a):
    """A floating tensor argument: taken to float64 (an integer one, e.g. class indices, stays as it is)."""
    return isinstance(a, torch.Tensor) and a.is_floating_point()


@pytest.mark.parametrize("impl,op,problem,dtype", GRAD_CASES)
def test_gradients_match_float64(impl, op, problem, dtype):
    assert_matches(op, impl, problem, dtype, seed=3, grad=True)


@pytest.mark.parametrize("op", OPS)
def test_reference_is_the_float64_math(op):
    """The gate's reference (the eager function run in float64) is the op's float64 formula, forward and backward,
    at every edge problem: the product's truth is the math, not torch's kernel."""
    spec = get_op(op)
    for problem in spec.edge_problems():
        inp = spec.make_inputs(problem, torch.float32, torch.device("cpu"), 1)
        args = [a.detach().double().requires_grad_(i in spec.grad_args) if _floating(a) else a
                for i, a in enumerate(inp.args)]
        ref = as_outputs(spec.reference(*args, **inp.kwargs))
        want = as_outputs(truth64(op, *args, dtype=torch.float64, **inp.kwargs))
        assert len(ref) == len(want) == len(spec.outputs), (op, len(ref), len(want), spec.outputs)
        for r, w, name in zip(ref, want, spec.outputs):
            assert_like_truth(r, w, 1e-12, f"{op} reference {name} at {problem}")
        if ref[0].numel():
            leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            dy = tuple(torch.randn_like(r) for r in ref)  # a gradient into every output
            for g, w in zip(torch.autograd.grad(ref, leaves, dy), torch.autograd.grad(want, leaves, dy)):
                assert_like_truth(g, w, 1e-10, f"{op} reference gradient at {problem}")


@pytest.mark.parametrize("op", OPS)
def test_compile_tier_gradients(op):
    spec = get_op(op)
    assert_matches(op, "compile", spec.edge_problems()[2], torch.float32, grad=True)  # the odd-sized one


@pytest.mark.parametrize("op", OPS)
def test_gradcheck_float64(op):
    """torch.autograd.gradcheck of the eager tier (the reference's own backward) in float64 on a small problem."""
    spec = get_op(op)
    p = spec.problem((3, 5))
    inp = spec.make_inputs(p, torch.float32, torch.device("cpu"), 0)
    args = [a.double().requires_grad_(i in spec.grad_args) if _floating(a) else a for i, a in enumerate(inp.args)]
    assert torch.autograd.gradcheck(lambda *t: spec.impls["eager"].fn(*t), tuple(args), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("op,impl", op_impls(OPS, ["triton", pytest.param("cuda", marks=gpu)]))
def test_kernel_tier_backward_is_its_own_kernel(op, impl):
    """The backward of a kernel tier runs that tier's backward, not eager autograd of the reference: the registered
    backward op, or in eager code the fast path's one autograd node (Python, or the op's C++ node where its CUDA wrapper
    declares one), whose backward launches the tier's kernels without the dispatcher (so no aten backward of the
    reference may appear). A backward with nothing left to launch
    (linear_cross_entropy's scalar loss, whose forward made the gradients) is still that tier's own node."""
    spec = get_op(op)
    dev = device_for(impl)
    fn = spec.impls[impl].fn
    assert spec.impls[impl].why_not(dev) is None
    inp = spec.make_inputs(spec.problem((4, 32)), torch.float32, dev, 0)
    x = inp.args[0].detach().requires_grad_(True)
    y = as_outputs(fn(x, *inp.args[1:]))
    with aten_ops() as seen:
        torch.autograd.backward(y, [torch.randn_like(t) for t in y] if isinstance(y, tuple) else torch.randn_like(y))
    grad_fn = (y[0] if isinstance(y, tuple) else y).grad_fn
    node = type(grad_fn).__name__
    own_node = (node.startswith(f"{op}_{impl}_fast") or f"tiered_ops_{op}_{impl}_default" in node
                or grad_fn.name() == cpp_node_name(op))
    assert any(f"{op}_bwd_{impl}" in s for s in seen) or own_node, (node, seen)
    assert not any(s.startswith(("aten._softmax_backward", "aten._log_softmax_backward"))
                   or "native_layer_norm_backward" in s for s in seen), seen


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_backward_over_a_non_last_dim(impl):
    dev = device_for(impl)
    fn = get_op("softmax").impls[impl].fn
    x = torch.randn(5, 33, 4, device=dev, requires_grad=True)
    dy = torch.randn(5, 33, 4, device=dev)
    (g,) = torch.autograd.grad(fn(x, 1), x, dy)
    x64 = x.detach().double().requires_grad_(True)
    (r,) = torch.autograd.grad(truth64("softmax", x64, 1), x64, dy.double())
    assert (g.double() - r).norm() / r.norm() < 1e-5


def test_measure_in_each_mode_checks_gradients_and_times():
    spec, cpu = get_op("rms_norm"), torch.device("cpu")
    p = spec.problem((32, 64))
    rows = {m: measure(spec, spec.impls["eager"], p, torch.float32, cpu, m) for m in ("fwd_nograd", "fwd", "bwd",
                                                                                       "fwd+bwd")}
    for m, r in rows.items():
        assert r["ok"] == 1 and r["mode"] == m and r["p50_us"] > 0, r
    assert rows["fwd+bwd"]["gbps"] * rows["fwd+bwd"]["p50_us"] > rows["fwd"]["gbps"] * rows["fwd"]["p50_us"]


class _SavesSoftmax(torch.autograd.Function):
    """softmax's forward, saving its output for a backward the tests write wrong on purpose."""

    @staticmethod
    def forward(ctx, x, dim):
        y = torch.softmax(x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y


def test_a_wrong_backward_is_caught_and_never_timed():
    from tiered_ops.registry import Impl, Tier

    spec, cpu = get_op("softmax"), torch.device("cpu")

    class WrongGrad(_SavesSoftmax):
        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return y * g, None  # forgets the - sum(g * y) term

    wrong = Impl("wrong_bwd", Tier.EAGER, lambda x, dim=-1: WrongGrad.apply(x, dim), (spec.source,))
    fwd = measure(spec, wrong, spec.problem((8, 32)), torch.float32, cpu, "fwd_nograd")
    assert fwd["ok"] == 1  # the forward is right
    for mode in ("fwd", "bwd", "fwd+bwd"):
        row = measure(spec, wrong, spec.problem((8, 32)), torch.float32, cpu, mode)
        assert row["ok"] == 0 and "grad of x" in row["reason"] and row.get("p50_us") is None, row


def test_no_backward_is_caught():
    from tiered_ops.registry import Impl, Tier

    spec = get_op("muladd")
    detached = Impl("detached", Tier.EAGER, lambda a, b, c: (a * b + c).detach(), (spec.source,))
    row = measure(spec, detached, spec.problem((8, 8)), torch.float32, torch.device("cpu"), "fwd+bwd")
    assert row["ok"] == 0 and "does not require grad" in row["reason"]


def test_dispatch_uses_the_training_decision_when_inputs_require_grad():
    x = torch.randn(6, 10)
    tiered_ops.softmax(x)
    tiered_ops.softmax(x.requires_grad_(True))
    with torch.no_grad():
        tiered_ops.softmax(x)
    modes = {k[-2]: s.record["mode"] for k, s in memo._calls.items() if k[0] == "softmax"}  # key: ..., train, context
    assert modes == {False: "fwd_nograd", True: "fwd+bwd"}
    y = tiered_ops.softmax(x)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().max() < 1e-5  # d/dx of sum(softmax) is 0


def test_select_backend_mode_is_validated():
    with pytest.raises(ValueError, match="mode"):
        tiered_ops.select_backend("softmax", (4, 8), mode="training")


def test_a_backward_that_writes_into_its_output_gradient_or_inputs_cannot_move_the_reference():
    """A wrong gradient hidden by writing into what the gate's reference reads: the backward returns twice the true
    gradient and then doubles its output gradient in place (the float64 reference computed from that would agree);
    a forward that writes into its input after computing its output (the reference would then see another input).
    The gate computes its reference and eager's run from copies taken before the call, so both fail."""
    from tiered_ops.measure.gate import check_one
    from tiered_ops.registry import Impl, Tier

    spec, cpu = get_op("softmax"), torch.device("cpu")

    class HidesWrongGrad(_SavesSoftmax):
        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            dx = 2 * y * (g - (g * y).sum(ctx.dim, keepdim=True))
            g.mul_(2)
            return dx, None

    def writes_input(x, dim=-1):
        y = torch.softmax(x, dim)
        with torch.no_grad():
            x.mul_(3)
        return y

    problem = spec.problem((8, 32))
    err, why = check_one(spec, Impl("hides", Tier.EAGER, lambda x, dim=-1: HidesWrongGrad.apply(x, dim),
                                    (spec.source,)), problem, torch.float32, cpu, seed=3, grad=True)
    assert why is not None and "grad of x" in why, (err, why)
    err, why = check_one(spec, Impl("writes", Tier.EAGER, writes_input, (spec.source,)), problem, torch.float32, cpu,
                         seed=4)
    assert why is None, (err, why)  # its output is right: the input it wrote is not what it was given
