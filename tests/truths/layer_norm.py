"""layer_norm's float64 math: (x - mean) / sqrt(var + eps) * w + b."""

from __future__ import annotations

from typing import Any

import torch


def _dims(x: torch.Tensor, normalized_shape: Any) -> tuple[int, ...]:
    n = 1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))
    return tuple(range(x.dim() - n, x.dim()))


def truth(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    dims = _dims(x, normalized_shape)
    xc = x - x.mean(dims, keepdim=True)
    y = xc / torch.sqrt((xc * xc).mean(dims, keepdim=True) + eps)
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: normalized over 1..all trailing dims, with or without weight and bias."""
    import hypothesis.strategies as st

    k = draw(st.integers(1, len(shape)))
    return dict(normalized_shape=shape[len(shape) - k:], weight=draw(st.booleans()), bias=draw(st.booleans()))
