"""Every Triton and CUDA entry point, every op: bad input is a clear error naming the argument, never garbage or a
CUDA fault; NaN and Inf propagate exactly as in eager. Generic over the registry (the per-op files test the
op-specific arguments: normalized_shape, dim, approximate, bias shape)."""

import pytest
import torch
from helpers import HAS_CUDA, builtin_ops, gpu

from tiered_ops.catalog import get_op
from tiered_ops.measure import arg_names
from tiered_ops.registry import as_outputs

OPS = [s.name for s in builtin_ops()]
KERNEL_TIERS = ["triton", pytest.param("cuda", marks=gpu)]
PROBLEMS = {  # a few rows of an odd length, the op's defaults otherwise (gelu: both approximations)
    "softmax": [dict()], "rms_norm": [dict()], "layer_norm": [dict()], "muladd": [dict()],
    "gelu": [dict(approximate="none"), dict(approximate="tanh")],
    "cross_entropy": [dict(), dict(reduction="none"), dict(reduction="none", label_smoothing=0.1)],
    "fused_add_rms_norm": [dict()],
    "segment_sum": [dict()],
}


MASKS = (torch.isnan, torch.isposinf, torch.isneginf)


def _dev(impl: str) -> torch.device:
    return torch.device("cuda") if HAS_CUDA or impl == "cuda" else torch.device("cpu")


def _inputs(op: str, dev: torch.device, **params):
    spec = get_op(op)
    problem = spec.problem((5, 37), **params)
    return spec, spec.make_inputs(problem, torch.float32, dev, 0)


def _each_tensor_replaced(spec, inp, how):
    """(argument name, args) for each tensor argument of ``inp`` in turn replaced by ``how(tensor)``."""
    names = arg_names(spec)
    for i, a in enumerate(inp.args):
        if isinstance(a, torch.Tensor):
            args = list(inp.args)
            args[i] = how(a)
            yield names[i], args


def test_every_op_is_covered():
    assert set(OPS) == set(PROBLEMS)


@pytest.mark.parametrize("impl", KERNEL_TIERS)  # eager against the math: tests/test_<op>.py
@pytest.mark.parametrize("op", OPS)
def test_nan_and_inf_propagate_like_eager(op, impl):
    dev = _dev(impl)
    for params in PROBLEMS[op]:
        spec, inp = _inputs(op, dev, **params)
        x = inp.args[0].clone()
        x[0, 3], x[1, 5], x[2, 7], x[3, 0] = float("nan"), float("inf"), -float("inf"), 1e30
        args = (x, *inp.args[1:])
        gots = as_outputs(spec.impls[impl].fn(*args, **inp.kwargs))
        # torch's own CPU and CUDA kernels disagree at some non-finite inputs (CUDA's rms_norm makes a whole row NaN
        # when it holds an Inf, the CPU's only that element; CUDA's gelu(-inf) is NaN): either eager is accepted.
        wants = [as_outputs(spec.reference(*args, **inp.kwargs)),
                 as_outputs(spec.reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args),
                                           **inp.kwargs))]
        assert len(gots) == len(wants[0])
        for k, got in enumerate(gots):  # each output of the op
            got = got.cpu()
            want = next((w[k].cpu() for w in wants if all(torch.equal(m(got), m(w[k].cpu())) for m in MASKS)),
                        wants[0][k].cpu())
            fin = torch.isfinite(want)
            torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


def _other_kind(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.int32) if a.is_floating_point() else a.to(torch.float32)


@pytest.mark.parametrize("impl", KERNEL_TIERS)
@pytest.mark.parametrize("op", OPS)
def test_integer_input_names_the_argument(op, impl):
    """A floating argument given as int32, or an integer one (class indices) given as float32: a dtype error."""
    dev = _dev(impl)
    spec, inp = _inputs(op, dev)
    wrong_kind = lambda a: a.to(torch.int32) if a.is_floating_point() else a.to(torch.float32)  # noqa: E731
    for name, args in _each_tensor_replaced(spec, inp, wrong_kind):
        with pytest.raises((TypeError, ValueError, RuntimeError), match=rf"\b{name}\b.*(dtype|float)"):
            spec.impls[impl].fn(*args, **inp.kwargs)


@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("op", OPS)
def test_a_tensor_on_the_wrong_device_names_the_argument(op, impl):
    spec, inp = _inputs(op, torch.device("cuda"))
    for name, args in _each_tensor_replaced(spec, inp, lambda a: a.cpu()):
        with pytest.raises((TypeError, ValueError, RuntimeError), match=rf"\b{name}\b.*(CUDA|cuda|device)"):
            spec.impls[impl].fn(*args, **inp.kwargs)
    torch.cuda.synchronize()  # and the context is still healthy: no kernel ran on a host pointer


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grad", [False, True])
def test_public_op_names_an_argument_that_is_not_a_tensor(op, grad):
    """``tiered_ops.<op>``'s hot path reads ``.requires_grad`` of each tensor argument: a list in their place is a
    TypeError naming it, with grad mode on or off (not an AttributeError from inside the package)."""
    import tiered_ops

    spec, inp = _inputs(op, torch.device("cpu"))
    for name, args in _each_tensor_replaced(spec, inp, lambda a: a.tolist()):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match=rf"'{name}' must be a torch.Tensor"):
            getattr(tiered_ops, op)(*args, **inp.kwargs)
