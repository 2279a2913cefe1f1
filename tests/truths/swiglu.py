"""swiglu's float64 math: act(gate) * up, act silu (g / (1 + exp(-g))) or gelu (erf or tanh form, tests/truths/gelu);
act at +-inf is its limit (+inf there, 0 at -inf), then IEEE (0 * inf is NaN)."""

from __future__ import annotations

import torch

from . import gelu


def truth(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    if activation == "silu":
        a = gate / (1 + torch.exp(-gate))
        # -inf / inf = NaN at -inf: the limit 0 there; where() keeps the gradient of the finite entries
        a = torch.where(gate == -float("inf"), torch.zeros_like(gate), a)
    else:
        a = gelu.truth(gate, None, "tanh" if activation == "gelu_tanh" else "none")
    return a * up


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: any of the activations."""
    import hypothesis.strategies as st

    return dict(activation=draw(st.sampled_from(["silu", "gelu_tanh", "gelu"])))
