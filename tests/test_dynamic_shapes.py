"""torch.compile with dynamic shapes: a caller compiled once for a dimension that varies (a sequence length, a batch)
keeps one graph for the shapes of one bucket, as it does with the torch ops tiered_ops stands in for."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import tiered_ops

ROWS = (17, 20, 25, 31)  # one bucket: rows round up to 32


def _graphs(fn, dynamic: bool | None) -> int:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="eager", dynamic=dynamic)
    for n in ROWS:
        x = torch.randn(n, 64)
        fn(x)  # in eager first: the decision exists before the trace
        compiled(x)
    torch._dynamo.reset()
    return counters["stats"]["unique_graphs"]


def _stock(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (64,), torch.ones(64), torch.zeros(64)) * 2


def _tiered(x: torch.Tensor) -> torch.Tensor:
    return tiered_ops.layer_norm(x, (64,), torch.ones(64), torch.zeros(64)) * 2


def test_the_torch_op_keeps_one_graph_for_a_varying_dimension(private_decisions):
    assert _graphs(_stock, True) == 1
    assert _graphs(_stock, None) == 2  # static first, then dynamic on the first recompile (automatic_dynamic_shapes)


@pytest.mark.xfail(strict=True, reason="a trace keys its decision by the call's exact shapes, so dynamo guards each "
                                       "size: every new shape compiles a graph of its own")
def test_a_tiered_op_keeps_one_graph_for_a_varying_dimension(private_decisions):
    assert _graphs(_tiered, True) == 1
