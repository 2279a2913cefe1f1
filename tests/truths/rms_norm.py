"""rms_norm's float64 math: x / sqrt(mean(x^2) + eps) * w; eps=None is the candidate dtype's eps."""

from __future__ import annotations

from typing import Any

import torch


def _dims(x: torch.Tensor, normalized_shape: Any) -> tuple[int, ...]:
    n = 1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))
    return tuple(range(x.dim() - n, x.dim()))


def truth(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None, eps: float | None = None,
          *, dtype: torch.dtype, weight_offset: float = 0.0, cast_before_weight: bool = False) -> torch.Tensor:
    """Hugging Face forms: weight_offset multiplies by (offset + w); cast_before_weight rounds before the weight in
    the candidate's dtype, which float64 math does not: the same value."""
    eps = torch.finfo(dtype).eps if eps is None else eps  # F.rms_norm: eps=None is the input dtype's eps
    y = x / torch.sqrt((x * x).mean(_dims(x, normalized_shape), keepdim=True) + eps)
    return y if weight is None else y * (weight_offset + weight)


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: normalized over 1..all trailing dims, with or without a weight."""
    import hypothesis.strategies as st

    k = draw(st.integers(1, len(shape)))
    return dict(normalized_shape=shape[len(shape) - k:], weight=draw(st.booleans()))
