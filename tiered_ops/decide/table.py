"""The decision table: the one place where what the tuner decided meets the call path.

An immutable mapping (op, bucket, dtype, device, policy, calls, budget, mode, context) -> ``Selection`` (a bound
implementation with the record of why it was chosen). The tuner (``decide``: select, measure, gate, policy, predict,
packs, background, tune) never edits a table: it builds a new one from the current one and publishes it by swapping
one reference (``publish``), under a lock that writers alone take. Readers (``current()``: the per-call path, a trace,
a capture) read whatever table is current, never lock and never see a half-made one.

What a reader derives from the table (the call path's per-signature functions) follows it through ``subscribe``:
each listener is told (old, new) after every publication and keeps of its derived entries those whose decision is
still in the new table, so nothing but the table is ever invalidated by hand.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..registry import Impl, Tier

log = logging.getLogger(__name__)

# (op, bucket, dtype, device, policy, calls, budget, mode, context)
Key = tuple


@dataclass
class Selection:
    """A callable bound to the chosen implementation, with the record of why it was chosen.

    Calling it calls ``fn`` (the implementation, checked). What ``tiered_ops.select_backend`` returns is the call
    path's callable of the op's own signature made from it (``runtime.bound``), which validates each distinct call
    signature once and then runs the implementation unchecked."""

    fn: Callable[..., torch.Tensor]
    impl: Impl
    record: dict[str, Any] = field(default_factory=dict)
    # the decision table's key this selection is (or is made from), None where it is in no table
    key: tuple | None = field(default=None, compare=False, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def tier(self) -> Tier:
        return self.impl.tier

    @property
    def name(self) -> str:
        return self.impl.name

    def __repr__(self) -> str:
        return f"Selection({self.record.get('op')}: {self.name} [{self.tier.label}], {self.record.get('reason')})"


class DecisionTable(Mapping):
    """One published table: read-only (``Mapping``); ``generation`` counts the publications before it; ``pruned``:
    whether its publication dropped decisions (or asked to), rather than only adding or replacing some."""

    __slots__ = ("_entries", "generation", "pruned")

    def __init__(self, entries: dict[Key, Any], generation: int, pruned: bool = False) -> None:
        self._entries = entries
        self.generation = generation
        self.pruned = pruned

    def __getitem__(self, key: Key) -> Any:
        return self._entries[key]

    def get(self, key: Key, default: Any = None) -> Any:
        return self._entries.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"DecisionTable(generation {self.generation}, {len(self._entries)} decisions)"


_current = DecisionTable({}, 0)
_writer = threading.RLock()  # writers only: a reader takes ``current()`` without it
_listeners: list[Callable[[DecisionTable, DecisionTable], None]] = []


def current() -> DecisionTable:
    """The table in force now (readers never lock)."""
    return _current


def publish(add: Mapping[Key, Any] | None = None, drop: Callable[[Key, Any], bool] | None = None,
            clear: bool = False) -> DecisionTable:
    """Publish a new table: the current one's decisions (none where ``clear``) less those ``drop(key, selection)``
    is true of, with ``add`` over them; then tell each listener (old, new). Returns the new table."""
    global _current
    with _writer:
        old = _current
        entries = {} if clear else {k: v for k, v in old._entries.items() if drop is None or not drop(k, v)}
        if add:
            entries.update(add)
        new = DecisionTable(entries, old.generation + 1, clear or drop is not None)
        _current = new
        for listener in _listeners:
            listener(old, new)
    return new


def subscribe(listener: Callable[[DecisionTable, DecisionTable], None]) -> None:
    """Call ``listener(old, new)`` after each publication (a reader's derived entries follow the table)."""
    if listener not in _listeners:
        _listeners.append(listener)
