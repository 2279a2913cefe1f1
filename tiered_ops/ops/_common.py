"""Helpers the op declarations share: random inputs that are never zeros, the rows x row-length split of an op
that reduces over its trailing dims, the checks the ops' contracts (``validate``) are written with, and the calls their
``bad_inputs`` are built from."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..registry import Problem, check_dims

# Floating dtypes an op takes: those of its implementations, and float64 for the reference the gate runs.
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Standard normal values (never zeros), drawn in fp32 and rounded to dtype."""
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def norm_shape(normalized_shape: int | Sequence[int], op: str = "") -> tuple[int, ...]:
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        return (normalized_shape,)
    return check_dims(f"{op}: normalized_shape" if op else "normalized_shape", normalized_shape)


def tensor(op: str, name: str, t: object, optional: bool = False) -> None:
    """``t`` is a tensor (or None where ``optional``): a TypeError naming the argument otherwise."""
    if not isinstance(t, torch.Tensor) and not (optional and t is None):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor{' or None' if optional else ''}, "
                        f"got {type(t).__name__}")


def floating(op: str, name: str, t: object, optional: bool = False) -> None:
    """``t`` is a floating tensor (float32, bfloat16, float16; float64 for the reference)."""
    tensor(op, name, t, optional)
    if t is not None and t.dtype not in FLOATS:  # type: ignore[union-attr]
        raise TypeError(f"{op}: {name} must be a floating tensor (float32, bfloat16, float16), got dtype "
                        f"{t.dtype}")  # type: ignore[union-attr]


def same_device(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.device != like.device:
        raise ValueError(f"{op}: {name} must be on {like_name}'s device {like.device}, got {t.device}")


def norm_param(op: str, name: str, t: torch.Tensor | None, x: torch.Tensor, ns: tuple[int, ...]) -> None:
    """A normalization's optional affine parameter: a floating tensor of shape normalized_shape on x's device."""
    floating(op, name, t, optional=True)
    if t is not None:
        same_device(op, name, t, x, "x")
        if tuple(t.shape) != ns:
            raise ValueError(f"{op}: {name} must have shape normalized_shape {list(ns)}, got {list(t.shape)}")


def check_norm(op: str, x: torch.Tensor, normalized_shape: object) -> tuple[int, ...]:
    """A normalization's x (a floating tensor) and normalized_shape (integer dims matching x's trailing dims)."""
    floating(op, "x", x)
    ns = norm_shape(normalized_shape, op)  # type: ignore[arg-type]
    if not 1 <= len(ns) <= x.dim() or tuple(x.shape[x.dim() - len(ns):]) != ns:
        raise ValueError(f"{op}: normalized_shape {list(ns)} must match the trailing dims of x, got x of shape "
                         f"{list(x.shape)}")
    return ns


def check_eps(op: str, eps: object, optional: bool) -> None:
    if (eps is None and optional) or (isinstance(eps, (int, float)) and not isinstance(eps, bool)):
        return
    raise TypeError(f"{op}: eps must be a float{' or None' if optional else ''}, got {type(eps).__name__}")


def norm_split(p: Problem) -> tuple[int, int]:
    """(rows, row length) of a problem normalized over its trailing ``normalized_shape`` dims."""
    n = math.prod(p.kw["normalized_shape"])
    return math.prod(p.shape[: len(p.shape) - len(p.kw["normalized_shape"])]), n


def values(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Deterministic non-constant values of ``shape`` (no random generator: importing a declaration draws nothing)."""
    n = math.prod(shape)
    return torch.linspace(-2.0, 2.0, max(n, 1))[:n].reshape(shape).to(dtype)


def call(*args: Any, **kwargs: Any) -> Callable[[torch.device], tuple[tuple, dict[str, Any]]]:
    """A ``BadInput``'s call (or its good one): these arguments, each tensor moved to the device asked for."""
    def build(device: torch.device) -> tuple[tuple, dict[str, Any]]:
        def to(a: Any) -> Any:
            return a.to(device) if isinstance(a, torch.Tensor) else a

        return tuple(to(a) for a in args), {k: to(v) for k, v in kwargs.items()}

    return build
