"""A step's memory on a GPU, as the step itself asks for it: one call with the CUDA allocator's history recorded
(``torch.cuda.memory._record_memory_history``), replayed. The allocator's own peak statistic counts the blocks that
served the requests, and a request served by a cached block too small to split counts that whole block, so the same
step reads up to a few MiB apart with the blocks earlier calls (tuning, other variants) left in the cache; the history
holds the sizes requested, which depend on the step alone.
"""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch


class Peak(NamedTuple):
    requested: int  # bytes the step had asked for and not freed at its peak, above what was held before it
    stats: int  # the allocator's peak statistic over the same call, above what was held before it
    live: dict[int, int]  # the step's blocks alive at that peak: address -> bytes requested
    trace: list[dict]  # the recorded events
    held_freed: dict[int, int]  # blocks held before the step and freed in it before its peak: address -> bytes
    at: str  # the line whose allocation reached the peak

    @property
    def requested_mib(self) -> float:
        """The peak in bytes requested, in MiB to one decimal (as the reports give it)."""
        return round(self.requested / 2**20, 1)

    def alive(self) -> collections.Counter:
        """The step's blocks alive at its peak: bytes requested -> count."""
        return collections.Counter(self.live.values())

    def allocated(self) -> collections.Counter:
        """Every block the step allocated: bytes requested -> count."""
        return collections.Counter(e["size"] for e in self.trace if e["action"] == "alloc")

    def freed_before(self) -> collections.Counter:
        """The blocks held before the step that it freed before its peak (they lower the peak): bytes -> count."""
        return collections.Counter(self.held_freed.values())

    def where(self, action: str = "alloc") -> dict[int, str]:
        """A line that allocated each size (the first); with action="free_requested", a line that freed it."""
        out: dict[int, str] = {}
        for e in self.trace:
            if e["action"] == action:
                out.setdefault(e["size"], origin(e.get("frames", [])))
        return out

    def save(self, path: str | Path) -> None:
        """The recorded events, each with the line it came from instead of its stack, as gzipped JSON."""
        events = [dict(action=e["action"], addr=e["addr"], size=e["size"], stream=e.get("stream"),
                       line=origin(e.get("frames", []))) for e in self.trace]
        with gzip.open(path, "wt") as f:
            json.dump(dict(requested=self.requested, stats=self.stats, at=self.at, events=events), f)


def origin(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python (generated Inductor code counts as outside)."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name or "torchinductor" in name:
            return f"{Path(name).name}:{f.get('line')} {f.get('name')}"
    return "?"


def differences(base: Peak, other: Peak, names: tuple[str, str] = ("stock", "other")) -> list[str]:
    """The sizes whose count differs between two steps' blocks alive at the peak, among the blocks held before the
    step and freed before its peak, then among every block allocated, each with a line that allocated one; then,
    where they differ, the lines whose allocations reached each peak."""
    allocs = base.where() | other.where()
    frees = base.where("free_requested") | other.where("free_requested")
    out = []
    for what, a, b, where in (("alive at the peak", base.alive(), other.alive(), allocs),
                              ("held before, freed before the peak", base.freed_before(), other.freed_before(), frees),
                              ("allocated in the step", base.allocated(), other.allocated(), allocs)):
        for size in sorted(set(a) | set(b), reverse=True):
            if a[size] != b[size]:
                out.append(f"{what}: {size:>12,d} B: {names[0]} {a[size]}, {names[1]} {b[size]}  ({where.get(size)})")
    if base.at != other.at:
        out.append(f"the peak reached at: {names[0]} {base.at}, {names[1]} {other.at}")
    return out


def recorded_peak(fn: Callable[[], Any]) -> Peak:
    """One call of ``fn``, the allocator's cache emptied first, with its history recorded. A block counts as freed
    when its free is requested, as the allocator's statistics count it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        stats = torch.cuda.max_memory_allocated() - base
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return Peak(stats=stats, trace=trace, **replay(trace))


def replay(trace: list[dict]) -> dict[str, Any]:
    """The highest bytes requested above the start over the recorded events (``requested``), the blocks alive there
    (``live``: address -> bytes), the blocks held before the step and freed before that peak (``held_freed``) and
    the line whose allocation reached it (``at``). A block counts as freed when its free is requested; a block
    allocated before the recording and freed in it lowers the count (what was held before the step is the zero)."""
    live: dict[int, int] = {}
    held_freed: dict[int, int] = {}
    now = 0
    best: dict[str, Any] = dict(requested=0, live={}, held_freed={}, at="")
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            now += e["size"]
        elif e["action"] == "free_requested":
            if live.pop(e["addr"], None) is None:
                held_freed[e["addr"]] = e["size"]
            now -= e["size"]
        else:
            continue
        if now > best["requested"]:
            best = dict(requested=now, live=dict(live), held_freed=dict(held_freed), at=origin(e.get("frames", [])))
    return best
