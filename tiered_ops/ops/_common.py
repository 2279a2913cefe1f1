"""Helpers the op declarations share: random inputs that are never zeros, and the rows x row-length split of an op
that reduces over its trailing dims."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..registry import Problem


def gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Standard normal values (never zeros), drawn in fp32 and rounded to dtype."""
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def norm_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    return (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(int(d) for d in normalized_shape)


def norm_split(p: Problem) -> tuple[int, int]:
    """(rows, row length) of a problem normalized over its trailing ``normalized_shape`` dims."""
    n = math.prod(p.kw["normalized_shape"])
    return math.prod(p.shape[: len(p.shape) - len(p.kw["normalized_shape"])]), n
