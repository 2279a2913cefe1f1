"""One case's candidates (an op at one problem, dtype, device and mode: a tuner's bucket, a sweep's case) measured
beside a store: the store's record of the edge gates they passed (``EdgeGates``, read once for all of them), each
candidate measured with it (``measure_kept``), and a tuner's whole bucket measured as its ``Plan`` says
(``measure_planned``): each candidate timed in the plan's order, the ones timed without their gate gated in the turns
the plan's chooser names, launch-bound GPU rows timed again side by side (``recheck``), every row stored as it is
made. What to measure, in what order, how to prune and which choice names a gate is the tuner's; this only runs it."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Protocol

import torch

from ..registry import DTYPE_NAMES, GRAD_MODES, Impl, OpSpec, Problem
from ..store.store import Store
from . import recheck
from .fingerprint import Fingerprint, fingerprint
from .measure import measure
from .verdict import EDGES, Settings, gate_row


def edge_store_key(spec: OpSpec, impl: Impl, dtype: torch.dtype, fp: Fingerprint, mode: str) -> tuple:
    """The store's key (``EDGE_KEY``) of ``impl``'s edge gate at ``dtype`` on the device ``fp`` names in ``mode``."""
    return (spec.name, impl.name, impl.source_hash, DTYPE_NAMES[dtype], fp.key, int(mode in GRAD_MODES),
            fp.torch or "", fp.triton or "")


class EdgeGates:
    """The edge gate's record in the store for a batch of ``spec``'s implementations at ``dtype`` on ``device`` in
    ``mode`` (a bucket, a sweep's case): ``known`` for ``measure``'s and ``gate_row``'s ``edges``, ``keep`` for the
    row they return, ``record`` for a pass found apart from a row. The store is read once for all of them, at the
    first question; a pass is recorded once. ``fp``: the device's fingerprint where a worker process gave it, else
    this process's."""

    def __init__(self, store: Store, spec: OpSpec, dtype: torch.dtype, device: torch.device, mode: str,
                 fp: Fingerprint | None = None):
        self.store, self.spec, self.dtype, self.mode = store, spec, dtype, mode
        self.fp = fp if fp is not None else fingerprint(device)
        self._stored: dict[tuple[str, str], float] = {}
        self._keys: dict[str, tuple] = {}  # each implementation's store key (``edge_store_key``), made once

    def known(self, impl: Impl) -> float | None:
        """The worst error of ``impl``'s edge problems where the store records that they passed, else None."""
        if impl.name not in self._keys:
            key = self._keys[impl.name] = edge_store_key(self.spec, impl, self.dtype, self.fp, self.mode)
            if len(self._keys) == 1:  # the first question: every implementation's stored passes, in one query
                self._stored = self.store.edge_gates(key[:1] + (None, None) + key[3:])
        return self._stored.get((impl.name, impl.source_hash))

    def record(self, impl: Impl, passed: float) -> None:
        """Record that ``impl`` passed its edge problems (``passed``: their worst error), where no pass was."""
        if self.known(impl) is None:
            self.store.put_edge_gate(self._keys[impl.name], passed)
            self._stored[(impl.name, impl.source_hash)] = passed  # a later question about it is answered here

    def keep(self, impl: Impl, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` without ``EDGES``, the pass it carries recorded (``record``)."""
        passed = row.pop(EDGES, None)
        if passed is not None:
            self.record(impl, passed)
        return row


def measure_kept(store: Store, spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
                 mode: str = "fwd_nograd", *, gates: EdgeGates | None = None, **kw: Any) -> dict[str, Any]:
    """``measure`` in this process beside ``store``: an edge gate it records as passed is not checked again, and a new
    pass is recorded in it; the row back, ready to be added. ``gates``: the batch's record (``EdgeGates`` of the same
    store, op, dtype, device and mode) where the caller measures several implementations, so the store is read once
    for all of them; else one made for this implementation."""
    edges = gates if gates is not None else EdgeGates(store, spec, dtype, device, mode)
    row = measure(spec, impl, problem, dtype, device, mode, edges=edges.known(impl), **kw)
    return edges.keep(impl, row)


class Turns(Protocol):
    """A tuner's chooser of gate turns (``choice.GateTurns``): ``next(rows)`` names the candidate timed without its
    gate to gate next among the case's newest rows (its implementation and row first), or None when done; the rows
    it passed over are then in ``passed_over``, to store."""

    passed_over: list[dict]

    def next(self, rows: list[dict]) -> tuple[Any, ...] | None: ...


class Plan(NamedTuple):
    """How a tuner asks for its bucket to be measured: ``todo``, the candidates in the order to measure them;
    ``how(impl, rows)``, a candidate's keywords for ``measure`` (its pruning) after ``rows`` (the bucket's stored rows
    and those measured so far); ``turns``, which candidate timed without its gate is gated next; ``before(impl)``,
    run before each candidate (a claim's lease renewed, progress said); ``stamped(rows)``, the pass as it is stored."""

    todo: list[Impl]
    how: Callable[[Impl, list[dict]], dict[str, Any]]
    turns: Turns
    before: Callable[[Impl], None]
    stamped: Callable[[list[dict]], list[dict]]


def measure_planned(store: Store, spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
                    key5: tuple[str, str, str, str, str], rows: list[dict], plan: Plan,
                    measure_one: Callable[..., dict[str, Any]] = measure_kept, settings: Settings | None = None
                    ) -> list[dict]:
    """Measure the bucket ``key5`` (``problem``'s, holding ``rows``) as ``plan`` says and store what it makes: each
    candidate by ``measure_one`` (as ``measure_kept``, given the bucket's one ``EdgeGates`` as ``gates``: the store's
    edge-gate passes read once for the bucket), the pass stored at its end; then the gate of each candidate the plan's
    turns name (``gate_row``), stored as it ends, and the rows passed over; then, on a GPU, the launch-bound rows
    timed again side by side (``recheck.retime``). The bucket's newest rows back. ``settings``: given to each
    measurement and gate, else read by those."""
    given = {} if settings is None else {"settings": settings}
    gates = EdgeGates(store, spec, dtype, device, mode)  # the store's passes read once for the whole bucket
    new: list[dict] = []
    for impl in plan.todo:
        plan.before(impl)
        new.append(measure_one(store, spec, impl, problem, dtype, device, mode, bucket=key5[1], gates=gates,
                               **plan.how(impl, [*rows, *new]), **given))
    store.add(plan.stamped(new))
    rows = store.latest(*key5)
    while (turn := plan.turns.next(rows)) is not None:
        impl, row = turn[:2]
        done = gate_row(spec, impl, problem, dtype, device, mode, dict(row), gates.known(impl), **given)
        store.add([gates.keep(impl, dict(done, timestamp=time.time()))])
        rows = store.latest(*key5)
    for r in plan.turns.passed_over:
        store.add([r])
    rows = store.latest(*key5)
    if device.type == "cuda":  # launch-bound GPU rows timed again side by side (a CPU row has no launch path)
        rechecked, _ = recheck.retime(spec, rows, problem, dtype, device, mode)
        store.add(rechecked)
        rows = store.latest(*key5) if rechecked else rows
    return rows
