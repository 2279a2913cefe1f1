"""The gate's verdict written into a measurement's store row (``gate``: the float64 check, driven by OpSpec): ok and
its relative error where it passed (its reason then says what the gate sampled, or nothing), else not ok and why (a
failure that may be the environment's stored with that environment); a peer that fails only an edge case it does not
claim marked ``rows.EDGE_ONLY`` and timed for comparison. ``gate_if_due`` is a measurement's gate, between its first
call and its timing; ``gate_row`` gates a row timed without it, later, where a choice would name it. A row whose
implementation has passed the edge problems carries that figure as ``EDGES`` (not a column: the store's edge-gate
record, ``case.EdgeGates``, takes it). ``Settings``: what a measurement and its gate read from the environment."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..environment import environment
from ..envs import gate_bytes
from ..registry import GRAD_MODES, Impl, OpSpec, Problem, Tier
from ..store.rows import EDGE_ONLY
from .gate import edges_passed, gate, gate_at_problem, gate_problem

EDGES = "edges_rel_error"  # a row's field (not a store column): its implementation passed the edge problems


class Settings(NamedTuple):
    """What a measurement reads from the environment, as a caller that measures several candidates read it once
    (the tuner's miss): the gate's byte budget on the device (``envs.gate_bytes``) and whether a CPU timing taken on
    a busy machine is taken again and flagged (``envs.contention_check``), and the build environment a failure that
    may be the environment's is stored with (``environment.environment``; None: read at the failure). None where a
    measurement takes it: read there, when needed."""

    gate_bytes: int
    contention_check: bool
    env: str | None = None


def env_of(settings: Settings | None) -> str:
    """The build environment a failure is stored with: ``settings``'s where it read it, else read now."""
    return environment() if settings is None or settings.env is None else settings.env


def gate_row(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
             row: dict[str, Any], edges: float | None = None, settings: Settings | None = None) -> dict[str, Any]:
    """The gate of ``row``'s implementation at ``problem`` in ``mode``, written into the row: ok and its relative
    error where it passed (its reason then says what the gate sampled, or nothing), else not ok and why. ``edges``
    and the row's ``EDGES``, and ``settings``, as in ``measure``."""
    _gate_into(spec, impl, problem, dtype, device, mode, row, settings, edges)
    passed = edges_passed(spec, impl, dtype, device, mode in GRAD_MODES, edges)  # noted by the gate where it ran
    if passed is not None:
        row[EDGES] = passed
    return row


def _gate_into(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
               row: dict[str, Any], settings: Settings | None = None, edges: float | None = None
               ) -> tuple[bool, str | None]:
    """``gate_row``'s work on the row: (whether it marked the row ``rows.EDGE_ONLY``, what the gate sampled of
    ``problem`` where it passed: None, all of it). ``edges``: as ``gate``'s."""
    budget = gate_bytes(device.type) if settings is None else settings.gate_bytes  # one: the gate's and its note's
    err, why = gate(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES, budget=budget, edges=edges)
    if why and impl.tier == Tier.PEER and why.startswith("edge case: "):
        # a peer is measured for comparison, never chosen: one that fails an edge case it does not claim (Liger at 0
        # rows) is still timed where it is correct, marked, so the reports show it beside ours
        at, wrong = gate_at_problem(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES, budget=budget)
        if wrong is None:
            row.update(ok=0, rel_error=at if math.isfinite(at) else None,
                       reason=EDGE_ONLY + why[len("edge case: "):])
            return True, None
    row["rel_error"] = err if math.isfinite(err) else None
    if why:
        row.update(ok=0, reason=why)
        if "raised at" in why:  # an exception (a build, a compile), not a wrong answer: it may be the environment's
            row["env"] = env_of(settings)
        return False, None
    note = gate_problem(spec, problem, device, mode in GRAD_MODES, budget)[1]
    row.update(ok=1, reason=f"correct ({note})" if note else None)
    return False, note


def gate_if_due(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
                row: dict[str, Any], settings: Settings | None, edges: float | None, gated: bool,
                not_timeable: str | None) -> bool:
    """A measurement's gate, where it runs (``gated``, or a row that cannot be timed: nothing later would gate it),
    written into the row: whether the row goes on to be timed. A peer failing only an edge case it does not claim is
    timed; a row that cannot be timed ends here, its reason saying so where the gate passed."""
    if not (gated or not_timeable):
        return True
    edge, sample_note = _gate_into(spec, impl, problem, dtype, device, mode, row, settings, edges)
    if not row["ok"] and not edge:
        return False
    if not_timeable:
        if not edge:
            row["reason"] = f"correct; not timed: {not_timeable}" + (f" ({sample_note})" if sample_note else "")
        return False
    return True
