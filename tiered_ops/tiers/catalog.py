"""The catalog: every op declared in ``tiered_ops/ops``, built into its tiers, with the peers beside them.
``get_op`` and ``all_ops`` are how everything above the tiers finds an op (the CUDA kernels' territories, and the ones
given up, are in ``tiered_ops/territories.py``).

Loading happens once, on the first ``get_op``/``all_ops`` (or ``load()``); an op declared later (a test's planted
op: ``tiered_ops.registry.register_op``) is built into its tiers by ``build``.
"""

from __future__ import annotations

from .. import ops
from ..registry import OPS, OpSpec
from . import peers, tiers

_built: set[str] = set()


def build(spec: OpSpec) -> OpSpec:
    """Give a declared op its standard tiers (when it declares kernel arguments) and peers, once."""
    if spec.name not in _built:
        if spec.kernel_args is not None:
            tiers.standard_impls(spec)
        peers.register([spec])
        _built.add(spec.name)
    return spec


def load() -> dict[str, OpSpec]:
    """Every declared op, built (idempotent)."""
    if len(_built) < len(OPS):
        for spec in list(OPS.values()):
            build(spec)
    return OPS


def get_op(name: str) -> OpSpec:
    try:
        return load()[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(OPS))}") from None


def all_ops() -> list[OpSpec]:
    return list(load().values())


__all__ = ["all_ops", "build", "get_op", "load", "ops"]
