"""cross_entropy's float64 math, written out: lse_i = m_i + log sum_j exp(x_ij - m_i) (m_i the row's max),
loss_i = lse_i - (1 - s) x[i, t_i] (- s / V sum_j x_ij when s > 0) for a row whose target is not ignore_index,
0 for an ignored row; "mean" divides the sum by the number of non-ignored targets (0 / 0 = NaN when all are
ignored)."""

from __future__ import annotations

import torch


def truth(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
          label_smoothing: float = 0.0) -> torch.Tensor:
    n, v = logits.shape
    keep = target != ignore_index
    if n == 0:
        per_row = logits.sum(1)  # [0], still in the graph
    else:
        m = logits.detach().amax(1, keepdim=True)  # a constant shift: lse's gradient is softmax either way
        lse = (m + torch.log(torch.exp(logits - m).sum(1, keepdim=True))).squeeze(1)
        picked = logits.gather(1, torch.where(keep, target, 0).unsqueeze(1)).squeeze(1)
        per_row = lse - (1 - label_smoothing) * picked
        if label_smoothing:  # absent without smoothing (0 * sum(x) would be NaN for a row holding -inf)
            per_row = per_row - label_smoothing / v * logits.sum(1)
        per_row = torch.where(keep, per_row, torch.zeros_like(per_row))
    if reduction == "none":
        return per_row
    total = per_row.sum()
    return total if reduction == "sum" else total / keep.sum()


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: [N, V] drawn here (N up to 40, V up to 3000: tails after any block and pack, and rows longer
    than one Triton block), any reduction, label smoothing or not, some or all targets ignored."""
    import hypothesis.strategies as st

    return dict(shape=(draw(st.integers(1, 40)), draw(st.integers(1, 3000))),
                reduction=draw(st.sampled_from(["mean", "sum", "none"])),
                label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 1.0])),
                ignored=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])))
