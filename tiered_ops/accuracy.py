"""How far an output is from its reference: the relative error every correctness gate and test measures, and an
op's result as a tuple of outputs. Base module (imports nothing of the package); ``registry`` re-exports both."""

from __future__ import annotations

import math
from typing import Any

import torch


def as_outputs(out: Any) -> tuple[Any, ...]:
    """An op's result as a tuple of its outputs (a tensor is one output)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0, chunk: int = 1 << 24) -> float:
    """||out - ref|| / max(||ref||, floor) in float64; inf when out has NaN/Inf where ref is finite or shapes differ.

    ``floor`` is the scale below which the reference counts as zero (a gradient that is 0 in exact arithmetic,
    e.g. layer_norm over one element, is roundoff in float64 too). Computed on ``ref``'s device, ``chunk``
    elements at a time, so a 2^26-element check neither crosses to the host nor holds float64 copies of it."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    if out.numel() == 0:
        return 0.0
    o_all = out.detach().reshape(-1)
    r_all = ref.detach().reshape(-1)
    if o_all.device != r_all.device:
        o_all = o_all.to(r_all.device)
    num2 = torch.zeros((), dtype=torch.float64, device=r_all.device)
    den2 = torch.zeros((), dtype=torch.float64, device=r_all.device)
    bad = torch.zeros((), dtype=torch.bool, device=r_all.device)
    for start in range(0, r_all.numel(), chunk):
        o = o_all[start:start + chunk].to(torch.float64)
        r = r_all[start:start + chunk].to(torch.float64)
        finite = torch.isfinite(r)
        # Non-finite reference entries must be matched exactly (same inf sign, NaN where NaN), finite ones by finite.
        same = torch.where(finite, torch.isfinite(o), (o == r) | (torch.isnan(o) & torch.isnan(r)))
        bad |= ~same.all()
        o, r = torch.where(finite, o, 0.0), torch.where(finite, r, 0.0)
        num2 += torch.sum((o - r) ** 2)
        den2 += torch.sum(r * r)
    if bool(bad):
        return math.inf
    denom = max(math.sqrt(den2.item()), floor)
    num = math.sqrt(num2.item())
    return num / denom if denom > 0 else num
