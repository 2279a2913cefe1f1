"""Kernels that lost honestly and are kept: measured, reported, reported (not failed) by ``tiered-ops check``.

Kept out of every implementation's source files on purpose: retiring a kernel must not change its source
hash, or the evidence that justified retiring it would turn stale. Each entry names the evidence (the
results file) and the figures, as ``tiered-ops check`` printed them; a retired kernel that starts winning
again is flagged by the check.
"""

from __future__ import annotations

from .registry import get_op

# (op, implementation) -> why it is retired, with the evidence.
RETIRED: dict[tuple[str, str], str] = {}


def apply(table: dict[tuple[str, str], str] | None = None) -> None:
    """Mark the implementations in ``table`` (default RETIRED) retired; an unknown name is an error."""
    for (op, impl), why in (RETIRED if table is None else table).items():
        spec = get_op(op)
        if impl not in spec.impls:
            raise KeyError(f"tiered_ops/retired.py: {op} has no implementation {impl!r}")
        spec.impls[impl].retired = why
