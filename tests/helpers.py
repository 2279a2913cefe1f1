"""One helper per kind of check, so each test case in tests/test_<op>.py is one line."""

from __future__ import annotations

import pytest
import torch

from tiered_ops.measure import check_one
from tiered_ops.registry import DTYPE_NAMES, Problem, get_op

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Tiers checked against the reference at every problem x dtype. The compile tier has its own smaller
# list per op: every new shape costs a CPU compile of several seconds.
IMPLS = ["eager", "triton", pytest.param("cuda", marks=gpu)]


def device_for(impl: str) -> torch.device:
    return torch.device("cuda") if HAS_CUDA or impl == "cuda" else torch.device("cpu")


def assert_matches(op: str, impl_name: str, problem: Problem, dtype: torch.dtype, seed: int = 0, grad: bool = False
                   ) -> float:
    """The implementation's output (and with ``grad`` every input gradient, for a random output gradient) is within
    the dtype's bound of float64 autograd of the reference (NaN never passes)."""
    spec = get_op(op)
    impl = spec.impls[impl_name]
    dev = device_for(impl_name)
    why = impl.why_not(dev, dtype)
    assert why is None, f"{op}/{impl_name} cannot run on {dev}: {why}"
    err, fail = check_one(spec, impl, problem, dtype, dev, seed, grad=grad)
    assert fail is None, f"{op}/{impl_name} {DTYPE_NAMES[dtype]}: {fail}"
    return err


def ref64(op: str, *args, **kwargs) -> torch.Tensor:
    conv = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return get_op(op).reference(*conv, **kwargs)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    from tiered_ops.registry import rel_error

    return rel_error(out, ref)
