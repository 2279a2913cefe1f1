"""The decision table: the one place where what the tuner decided meets the call path.

An immutable mapping (op, bucket, dtype, device, mode, context) -> ``Selection`` (a bound implementation with the
record of why it was chosen), of the decisions made under one policy, the process's (``how``: policy, calls, budget;
a decision asked under another policy is made and returned, never published). The tuner (``decide``: select,
measure, gate, policy, predict, packs, background, tune) never edits a table: it builds a new one from the current
one and publishes it by swapping one reference (``publish``), under a lock that writers alone take. Readers
(``current()``: the per-call path, a trace, a capture) read whatever table is current, never lock and never see a
half-made one.

What a reader derives from the table (the call path's per-signature functions, ``select_backend``'s memo) is held in
memos the table makes (``derived``): a publication keeps of each the entries its rule says still derive from the new
table, and a memo past its bound starts over (``put``: the table holds the buckets, the entry is made again from
them), so no memo is invalidated by hand. The table also carries which implementations are warm
for a CUDA-graph capture (``warm``): a fact about the process, published like a decision and never dropped.
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

# (op, bucket, dtype, device, mode, context)
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

    __slots__ = ("_entries", "generation", "pruned", "warm", "how")

    def __init__(self, entries: dict[Key, Any], generation: int, pruned: bool = False,
                 warm: frozenset = frozenset(), how: tuple | None = None) -> None:
        self._entries = entries
        self.generation = generation
        self.pruned = pruned
        self.warm = warm  # (op, impl, problem, dtype, device, mode, flavour) called once outside CUDA-graph capture
        self.how = how  # (policy, calls, budget) its decisions were made under; None: none published under one yet

    def decision(self, key: Key, how: tuple) -> Any:
        """The decision for ``key`` where this table's decisions were made under the policy ``how``, else None."""
        return self._entries.get(key) if self.how is None or self.how == how else None

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
# what readers derive from the table: (memo, keep) where ``keep(old, new, memo)`` drops what no longer derives from
# ``new`` (``derived``)
_derived: list[tuple[dict, Callable[[DecisionTable, DecisionTable, dict], None]]] = []
BOUND = 4096  # a derived memo's entries at most (``put``)


def current() -> DecisionTable:
    """The table in force now (readers never lock)."""
    return _current


def publish(add: Mapping[Key, Any] | None = None, drop: Callable[[Key, Any], bool] | None = None,
            clear: bool = False, warm: tuple | None = None, how: tuple | None = None) -> DecisionTable:
    """Publish a new table: the current one's decisions (none where ``clear``, or where ``add``'s were made under
    another policy ``how`` than they were) less those ``drop(key, selection)`` is true of, with ``add`` over them,
    and ``warm`` added to what is warm; then each derived memo keeps what still derives from it (``derived``).
    Returns the new table."""
    global _current
    with _writer:
        old = _current
        clear = clear or (how is not None and old.how is not None and how != old.how)
        entries = {} if clear else {k: v for k, v in old._entries.items() if drop is None or not drop(k, v)}
        if add:
            entries.update(add)
        new = DecisionTable(entries, old.generation + 1, clear or drop is not None,
                            old.warm if warm is None else old.warm | {warm},
                            None if clear and how is None else how or old.how)
        _current = new
        for memo, keep in _derived:
            keep(old, new, memo)
    return new


def derived(same: str = "object", value: Callable[[Any], Selection] | None = None, clear: tuple[dict, ...] = (),
            trim: tuple[dict, ...] = (), blank: tuple[dict, ...] = ()) -> dict:
    """A new memo of selections derived from the table: after each publication it keeps the entries whose selection
    (``value(entry)``, the entry itself where None) is still what the new table decides (``decided``); where anything
    went, the memos ``clear`` (keyed by what names no decision) start over and every entry of the memos ``blank``
    becomes None; the memos ``trim`` set to None each key it no longer holds. A memo a trace reads is blanked, not
    emptied: a publication from another thread (background tuning) may land while dynamo traces, after the trace read
    an entry and before it builds the guard on it, which must still find the key (it then fails on the value: the
    caller is traced again). The rules run here, in the order the memos were made: a publication runs no reader's
    code."""
    memo: dict = {}

    def keep(old: DecisionTable, new: DecisionTable, memo: dict) -> None:
        dropped = new.pruned
        for k, v in list(memo.items()):
            if not decided(v if value is None else value(v), new, same):
                memo.pop(k, None)
                dropped = True
        for m in trim:
            for k in [k for k, v in m.items() if v is not None and k not in memo]:
                m[k] = None
        if dropped:
            for m in clear:
                m.clear()
            for m in blank:
                for k in list(m):
                    m[k] = None

    _derived.append((memo, keep))
    return memo


def decided(sel: Selection, decisions: DecisionTable, same: str = "object") -> bool:
    """Whether ``sel`` is still what ``decisions`` says for its key: that very selection (``same="object"``) or one of
    the same implementation (``"impl"``: a selection made from the table's, such as the call path's); where the table
    holds no decision for it, whether ``decisions`` was published without dropping any."""
    key = getattr(sel, "key", None)  # a stand-in without one (a test's) is no decision of the table
    now = decisions.get(key) if key is not None else None
    if now is None:
        return not decisions.pruned
    return now is sel if same == "object" else now.impl.name == sel.impl.name


def put(memo: dict, key: Any, value: Any, *together: dict) -> None:
    """``memo[key] = value`` in a derived memo, which starts over (with the memos ``together`` derived from its
    entries) past ``BOUND`` entries: many distinct call sizes of few buckets; the table holds the buckets, and a call
    signature's entry is made again from it."""
    if len(memo) >= BOUND and key not in memo:
        memo.clear()
        for m in together:
            m.clear()
    memo[key] = value
