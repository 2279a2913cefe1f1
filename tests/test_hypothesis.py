"""Property-based checks on the CPU: random shapes, dims, dtypes and options; eager (against the float64 formulas of
helpers.truth64) and the Triton interpreter (through the gate), forward and backward, and a few draws through
torch.compile."""

import zlib

import pytest
import torch
from helpers import assert_matches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_ops.catalog import get_op

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
SHAPES = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@st.composite
def problems(draw, op: str):
    shape = draw(SHAPES)
    spec = get_op(op)
    if op == "softmax":
        return spec.problem(shape, dim=draw(st.integers(-len(shape), len(shape) - 1)))
    if op in ("rms_norm", "layer_norm"):
        k = draw(st.integers(1, len(shape)))
        extra = {"bias": draw(st.booleans())} if op == "layer_norm" else {}
        return spec.problem(shape, normalized_shape=shape[len(shape) - k:], weight=draw(st.booleans()), **extra)
    if op == "gelu":
        return spec.problem(shape, bias=draw(st.booleans()), approximate=draw(st.sampled_from(["none", "tanh"])))
    return spec.problem(shape)


def _check(op, impl, problem, dtype, grad):
    assert_matches(op, impl, problem, dtype, seed=zlib.crc32(str(problem).encode()) % 1000, grad=grad)


@pytest.mark.parametrize("op", ["softmax", "rms_norm", "muladd", "layer_norm", "gelu"])
@pytest.mark.parametrize("impl", ["eager", "triton"])
def test_random_problems_forward_and_backward(op, impl):
    @settings(max_examples=12, **SETTINGS)
    @given(problems(op), DTYPES, st.booleans())
    def run(problem, dtype, grad):
        _check(op, impl, problem, dtype, grad)

    run()


@pytest.mark.parametrize("op", ["softmax", "layer_norm", "gelu"])
def test_random_problems_through_compile(op):
    # every draw is a new shape, and a CPU compile takes seconds: a handful of draws
    @settings(max_examples=3, **SETTINGS)
    @given(problems(op), st.booleans())
    def run(problem, grad):
        _check(op, "compile", problem, torch.float32, grad)

    run()
