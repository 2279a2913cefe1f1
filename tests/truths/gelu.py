"""gelu's float64 math: 0.5 v (1 + erf(v / sqrt 2)) or the tanh form, v = x + bias; the limits at +-inf."""

from __future__ import annotations

import math

import torch


def truth(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    v = x if bias is None else x + bias
    if approximate == "tanh":
        y = 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v * v * v)))
    else:
        y = 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))
    # the limits at +-inf (the formula is inf * 0 = NaN at -inf); where() keeps the gradient of the finite entries
    return torch.where(torch.isinf(v), torch.where(v > 0, v, torch.zeros_like(v)), y)


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: with or without a bias, either approximation."""
    import hypothesis.strategies as st

    return dict(bias=draw(st.booleans()), approximate=draw(st.sampled_from(["none", "tanh"])))
