"""What a stored row says beyond its columns: the p20-p80 range a caller sees, when two such ranges tie, and the
reasons that keep a row out of every decision (timed on a busy machine, pruned after a short timing, timed but not
gated). Read by the
decisions and the analysis alike; nothing here measures."""

from __future__ import annotations

import functools
from typing import Any, Iterable

HOST_SWING = 1.5  # how far a launch-bound call's host time moved between processes on an H100 machine (1.5-1.7x)
PRUNED = "pruned: "  # the reason of a row a sweep stopped after a short timing (successive halving): correct, slower
UNAVAILABLE = "unavailable: "  # the reason of a row of an implementation that cannot run here (package, device)
CONTENDED = "contended: "  # the reason of a row timed while the machine was busy: kept for the record, never used
# the reason of a row timed before its gate ran (background tuning gates a compiled tier only where it would be chosen):
# not ok until a later row of it says the gate passed; never chosen while it says this
UNGATED = "not gated: "
WAITING = UNGATED + "timed; its gate runs only where it would be chosen"  # an ungated row no choice has looked at yet
# the reason of a peer's row that fails an edge case it does not claim (Liger at 0 rows) but is correct at the row's
# problem: timed there, so the reports show it beside ours; not ok, so nothing ever chooses it
EDGE_ONLY = "timed; fails an edge case it does not claim: "
PACK = "pack:"  # the origin of a row imported from a decision pack (``decide.packs``), followed by the pack's name
APART_S = 3600.0  # rows timed further apart than this come from different runs


def as_float(v: object) -> float | None:
    """A stored figure as a float; None for None and NaN (a CSV's empty cell) alike."""
    return None if v is None or v != v else float(v)


def figure(r: object, key: str) -> float | None:
    """Row ``r``'s figure ``key`` (a dict's item or a tuple row's attribute) as ``as_float`` reads it."""
    return as_float(r.get(key) if isinstance(r, dict) else getattr(r, key, None))


def caller_range(r: object) -> tuple[float, float]:
    """The p20-p80 range of what a caller sees per call, for a stored row (a dict or attributes, the store's columns):
    the kernel's p20-p80 and, where the launch path sets the time, the host batches' spread up to their p80.
    A row without host spread (the CPU's, whose host figure is its median; results from before schema 3) gets
    the caller time scaled by the kernel spread."""
    get = functools.partial(figure, r)
    caller = float(get("caller_us"))
    p20, p50, p80 = get("p20_us"), get("p50_us"), get("p80_us")
    if p20 is None or p80 is None or not p50:
        return caller, caller
    host, host_p80 = get("host_us"), get("host_p80_us")
    if host is None or host_p80 is None:
        return caller * p20 / p50, caller * p80 / p50
    return max(p20, host), max(p80, host_p80)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two (lo, hi) ranges overlap: the two timings are a tie."""
    return a[1] >= b[0] and b[1] >= a[0]


def _says(row: Any, prefix: str) -> bool:
    """Whether a stored row's reason (a dict or attributes) begins with ``prefix``."""
    reason = row.get("reason") if isinstance(row, dict) else getattr(row, "reason", None)
    return isinstance(reason, str) and reason.startswith(prefix)


def contended(row: Any) -> bool:
    """Whether a stored row (a dict or attributes) was flagged as timed on a busy machine."""
    return _says(row, CONTENDED)


def pruned(row: Any) -> bool:
    """Whether a stored row was stopped after a short timing, clearly slower than another candidate of its case."""
    return _says(row, PRUNED)


def ungated(row: Any) -> bool:
    """Whether a stored row was timed without its gate (it waits for it, or another candidate was chosen over it)."""
    return _says(row, UNGATED)


def waits_for_gate(row: Any) -> bool:
    """Whether a stored row was timed without its gate and no choice has looked at it since (``WAITING``); an
    ungated row a choice passed over says so instead (never chosen)."""
    return _says(row, WAITING)


def edge_only(row: Any) -> bool:
    """Whether a stored row is a peer's timed at a problem where it is correct, though it fails an edge case it does
    not claim (``EDGE_ONLY``): shown beside ours, never chosen."""
    return _says(row, EDGE_ONLY)


def from_pack(row: dict[str, Any]) -> bool:
    """Whether a stored row came from a decision pack (it was gated where it was measured, not on this machine): a
    choice made from it is gated here on its first use."""
    return str(row.get("origin") or "").startswith(PACK)


def usable(row: Any) -> bool:
    """Whether a decision may use a stored row: correct, timed, not flagged as contended."""
    get = row.get if isinstance(row, dict) else lambda k: getattr(row, k, None)
    caller = get("caller_us")
    return bool(get("ok")) and caller is not None and caller == caller and not contended(row)


def prune_bar(rows: Iterable[dict | None], factor: float | None) -> tuple[float, str] | None:
    """The pruning bar of a case (successive halving): ``factor`` x the p80 (as a caller sees it) of the fastest
    fully timed implementation of ours among ``rows`` (not a peer: a peer is never selected), and its name; None
    without one. A row without a p20-p80 spread is no bar."""
    if factor is None:
        return None
    full = [r for r in rows if r is not None and usable(r) and not pruned(r) and r.get("tier") != "peer"
            and r.get("p80_us") is not None and r.get("p20_us") is not None]
    if not full:
        return None
    best = min(full, key=lambda r: caller_range(r)[1])
    return factor * caller_range(best)[1], best["impl"]


def launch_sensitive(r: dict[str, Any]) -> bool:
    """Whether a row's caller time would follow its host time were the host ``HOST_SWING`` slower."""
    host, p50 = r.get("host_us"), r.get("p50_us")
    return host is not None and p50 is not None and host * HOST_SWING >= p50


def seconds_apart(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Seconds between two rows' timings where they are ``APART_S`` or more apart (different runs, maybe different
    hosts), else None (one run, or a timestamp missing)."""
    ta, tb = as_float(a.get("timestamp")), as_float(b.get("timestamp"))
    return None if ta is None or tb is None or abs(ta - tb) < APART_S else abs(ta - tb)
