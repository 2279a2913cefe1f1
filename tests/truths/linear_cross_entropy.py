"""linear_cross_entropy's float64 math, written out: the logits hidden @ weight.T (+ bias), then cross_entropy's
float64 math on them (``truths/cross_entropy.py``)."""

from __future__ import annotations

import torch

from truths.cross_entropy import truth as cross_entropy_truth


def truth(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
          ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return cross_entropy_truth(logits, target, ignore_index, reduction, label_smoothing)


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: hidden [N, H] drawn here (N up to 40, H up to 70) and V up to 3000, a bias or not, any reduction,
    label smoothing or not, some or all targets ignored."""
    import hypothesis.strategies as st

    return dict(shape=(draw(st.integers(1, 40)), draw(st.integers(1, 70))), vocab=draw(st.integers(1, 3000)),
                head_bias=draw(st.booleans()), reduction=draw(st.sampled_from(["mean", "sum", "none"])),
                label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 1.0])),
                ignored=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])))
