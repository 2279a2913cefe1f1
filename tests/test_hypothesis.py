"""Property-based checks on the CPU: random shapes, dims, dtypes and options; eager (against the float64 formulas of
helpers.truth64) and the Triton interpreter (through the gate), forward and backward, and a few draws through
torch.compile."""

import importlib
import zlib

import pytest
import torch
from helpers import assert_matches, builtin_ops
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_ops.tiers.catalog import get_op

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
SHAPES = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@st.composite
def problems(draw, op: str):
    """A random problem of the op: its test data's ``random_problem`` (tests/truths/<op>.py), else a random shape.
    ``random_problem`` may draw the shape itself (a ``shape`` entry: an op whose first input has a fixed rank)."""
    shape = draw(SHAPES)
    spec = get_op(op)
    draw_params = getattr(importlib.import_module(f"truths.{op}"), "random_problem", None)
    if not draw_params:
        return spec.problem(shape)
    params = draw_params(draw, shape)
    return spec.problem(params.pop("shape", shape), **params)


def _check(op, impl, problem, dtype, grad):
    assert_matches(op, impl, problem, dtype, seed=zlib.crc32(str(problem).encode()) % 1000, grad=grad)


@pytest.mark.parametrize("op", [s.name for s in builtin_ops()])
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
