"""Which of our modules a call runs through, followed with ``sys.setprofile`` on the calling thread: (a) a hit, a call
of ``tiered_ops.rms_norm(x, (H,), w)`` on the CPU after its signature was decided, from the call path's entry to the
launch of the implementation (the first frame of ``tiered_ops/ops``, ``triton_src`` or ``cuda_src``; ``--full``: to
the call's return); (b) a miss, the tuner deciding a new bucket (blocking tuning, an empty store): ``seam.ask`` from
its call to its return, measuring and publishing included; the store is opened and the device's fingerprint made
before (a process does each once, at its first miss, the fingerprint cached per device: ``--first-miss`` follows
that one, the opening, the schema's migrations and the fingerprint included).

Our modules: those named ``tiered_ops.*``, ``triton_src.*``, ``cuda_src.*`` (a generated function, whose globals name
no module, counts as the module that generated it: ``tiered_ops.runtime.dispatch`` for ``tiered_ops.<op>``,
``tiered_ops.runtime.bound`` for a ``select_backend`` callable). Code the standard library generates from a file-less
string with our module's globals (a dataclass's ``__init__``, ``__eq__``, ``__hash__``) is not ours: constructing or
hashing a value is not control going into the module that declared its class. Frames of other code (torch, the
standard library) are transparent: control is "in" the module of the innermost frame of ours. Printed:

- the module sequence: the module control is in, each time it changes (``>`` a call into it, ``<`` a return into it);
- modules: the distinct modules whose frames run;
- re-entries: how many times control comes into a module it had already left (by a call or a return);
- returns: module-boundary returns, a frame of one of our modules returning into a frame of another of ours (also
  counted once per (from, into) pair: "distinct", and listed with how often each happened).

A miss follows the tuner's own frames: the implementations it measures (``--opaque``) count as modules it runs, but
what they call is not followed. ``--level package`` counts packages (``tiered_ops.decide``, ``tiered_ops.store``...)
instead of modules.

    PYTHONPATH=$PWD python scripts/diag/call_path.py              # both, with the sequences
    PYTHONPATH=$PWD python scripts/diag/call_path.py --miss --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

OURS = ("tiered_ops", "triton_src", "cuda_src")
LAUNCH = ("tiered_ops.ops", "triton_src", "cuda_src")
GENERATED = {"<tiered_ops.select_backend.": "tiered_ops.runtime.bound", "<tiered_ops.": "tiered_ops.runtime.dispatch"}


def module_of(code, globals_: dict) -> str | None:  # noqa: ANN001 (a code object)
    for prefix, mod in GENERATED.items():
        if code.co_filename.startswith(prefix):
            return mod
    if code.co_filename.startswith("<"):
        return None  # made by the standard library with our module's globals (a dataclass's __init__, __hash__)
    name = globals_.get("__name__")
    if isinstance(name, str) and name.split(".")[0] in OURS:
        return name
    return None


class Follow:
    """The profile function: a stack of our frames, the sequence of modules control is in, and the counts."""

    def __init__(self, start: str | None = None, stop_at_launch: bool = False, opaque: tuple[str, ...] = (),
                 level: str = "module") -> None:
        self.start = start  # the qualified name of the function whose frame starts (and ends) the recording
        self.stop_at_launch = stop_at_launch
        self.opaque = opaque  # modules whose frames count, but not what they call (the implementations measured)
        self.level = level
        self.recording = start is None
        self.done = False
        self.inside: object | None = None  # the frame of an opaque module being run
        self.stack: list[tuple[object, str]] = []  # (frame, module) of our frames, innermost last
        self.seq: list[tuple[str, str]] = []  # (">" or "<", module)
        self.returns = 0
        self.return_edges: dict[tuple[str, str], int] = {}
        self._mods: dict[object, str | None] = {}

    def _module(self, frame) -> str | None:  # noqa: ANN001
        code = frame.f_code
        if code not in self._mods:
            mod = module_of(code, frame.f_globals)
            if mod is not None and self.level == "package":
                mod = ".".join(mod.split(".")[:2])
            self._mods[code] = mod
        return self._mods[code]

    def _enter(self, how: str, mod: str) -> None:
        if not self.seq or self.seq[-1][1] != mod:
            self.seq.append((how, mod))

    def __call__(self, frame, event: str, arg) -> None:  # noqa: ANN001
        if self.done or event not in ("call", "return"):
            return
        if self.inside is not None:
            if event == "return" and frame is self.inside:
                self.inside = None
            else:
                return
        mod = self._module(frame)
        if mod is None:
            return
        if event == "call":
            if not self.recording:
                full = module_of(frame.f_code, frame.f_globals)
                if f"{full}.{frame.f_code.co_qualname}" != self.start:
                    return
                self.recording = True
            self.stack.append((frame, mod))
            self._enter(">", mod)
            if self.stop_at_launch and mod.startswith(LAUNCH):
                self.done = True
            elif mod.startswith(self.opaque) if self.opaque else False:
                self.inside = frame
            return
        if not self.stack or self.stack[-1][0] is not frame:
            return  # a frame entered before the recording began
        self.stack.pop()
        if not self.stack:
            self.done = self.start is not None
            return
        back = self.stack[-1][1]
        if back != mod:
            self.returns += 1
            self.return_edges[mod, back] = self.return_edges.get((mod, back), 0) + 1
            self._enter("<", back)

    def summary(self) -> dict:
        mods = [m for _, m in self.seq]
        seen: set[str] = set()
        reentries = 0
        reentry_edges: set[tuple[str, str]] = set()
        for prev, m in zip([None, *mods], mods):
            if m in seen:
                reentries += 1
                reentry_edges.add((prev, m))
            seen.add(m)
        return dict(modules=len(seen), reentries=reentries, returns=self.returns, steps=len(mods),
                    distinct_reentries=len(reentry_edges), distinct_returns=len(self.return_edges),
                    sequence=[f"{how} {m}" for how, m in self.seq],
                    return_edges=[f"{n:6d}  {a} -> {b}" for (a, b), n in sorted(self.return_edges.items())])


def follow(fn, start: str | None = None, stop_at_launch: bool = False, opaque: tuple[str, ...] = (),  # noqa: ANN001
           level: str = "module") -> dict:
    f = Follow(start, stop_at_launch, opaque, level)
    sys.setprofile(f)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return f.summary()


def hit(full: bool, level: str) -> dict:
    import torch

    import tiered_ops

    x, w = torch.randn(8, 64), torch.randn(64)
    tiered_ops.set_tuning(False)  # the hit's decision from what is stored (none: eager); the hit itself never asks
    try:
        tiered_ops.rms_norm(x, (64,), w)
        tiered_ops.rms_norm(x, (64,), w)
        return follow(lambda: tiered_ops.rms_norm(x, (64,), w), stop_at_launch=not full, level=level)
    finally:
        tiered_ops.set_tuning(None)


def miss(opaque: tuple[str, ...], level: str, first: bool = False) -> dict:
    import torch

    import tiered_ops
    from tiered_ops.decide.decide import get_store
    from tiered_ops.measure.fingerprint import fingerprint

    x, w = torch.randn(16, 128), torch.randn(128)  # a bucket no call decided yet
    tiered_ops.set_tuning(True)
    if not first:
        get_store()  # opened as at any miss but a process's first (and as after --hit)
        fingerprint(x.device).key  # made once per process and device (cached), as at any miss but the first
    return follow(lambda: tiered_ops.rms_norm(x, (128,), w), start="tiered_ops.decide.seam.ask", opaque=opaque,
                  level=level)


def show(name: str, r: dict, limit: int) -> None:
    print(f"{name}: {r['modules']} modules, {r['reentries']} re-entries ({r['distinct_reentries']} distinct: from, "
          f"into), {r['returns']} module-boundary returns ({r['distinct_returns']} distinct: from, into), "
          f"{r['steps']} steps")
    seq = r["sequence"]
    for s in seq[:limit]:
        print("   ", s)
    if len(seq) > limit:
        print(f"    ... {len(seq) - limit} more (--limit)")
    print("  modules:", ", ".join(sorted({s[2:] for s in seq})))
    print("  module-boundary returns (how many, from -> into):")
    for e in r["return_edges"]:
        print("   ", e)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hit", action="store_true", help="the hit only")
    p.add_argument("--miss", action="store_true", help="the miss only")
    p.add_argument("--full", action="store_true", help="the hit to the call's return, not to the launch")
    p.add_argument("--first-miss", action="store_true",
                   help="the miss as a process's first: the store opened and the device's fingerprint made inside it "
                        "(never after --hit, which opens the store)")
    p.add_argument("--limit", type=int, default=400, help="sequence steps printed at most")
    p.add_argument("--json", action="store_true", help="the results as JSON")
    p.add_argument("--level", choices=("module", "package"), default="module",
                   help="count modules, or packages (tiered_ops.decide, tiered_ops.store, ...)")
    p.add_argument("--opaque", default=",".join(LAUNCH + ("tiered_ops.tiers",)),
                   help="miss: comma-separated module prefixes whose frames count but not what they call (default: "
                        "the implementations measured and their tiers' plumbing; '' follows everything)")
    a = p.parse_args()
    both = not (a.hit or a.miss)
    os.environ.setdefault("TIERED_OPS_DB", str(Path(tempfile.mkdtemp()) / "call_path.sqlite"))
    threading.setprofile(None)
    out = {}
    if a.hit or both:
        out["hit"] = hit(a.full, a.level)
    if a.miss or both:
        out["miss"] = miss(tuple(p for p in a.opaque.split(",") if p), a.level, a.first_miss and not (a.hit or both))
    if a.json:
        print(json.dumps(out, indent=1))
        return
    for name, r in out.items():
        show(name, r, a.limit)


if __name__ == "__main__":
    main()
