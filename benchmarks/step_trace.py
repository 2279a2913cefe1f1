"""Where a GPU waits inside one step, read from a torch.profiler Chrome trace of it (``prof.export_chrome_trace``):
the GPU's busy time and its idle gaps between the step's start (a ``record_function`` range named ``step``) and its
last kernel's end, the largest gaps with the operator whose kernel ended each gap (what the host was late to issue),
and the host time of the top-level operators by name (autograd's backward nodes included).

    python benchmarks/step_trace.py TRACE.json[.gz] [--gaps 10] [--ops 12]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class Gap(NamedTuple):
    at_us: float  # from the step's start on the host
    us: float
    before: str  # the kernel whose end opened the gap ('' before the first)
    after: str  # the kernel that closed it
    op: str  # the host operator that launched ``after``


class StepTrace(NamedTuple):
    span_us: float  # the step's start on the host to its last kernel's end
    busy_us: float  # union of the GPU's work in that span
    gaps: list[Gap]  # every idle stretch over ``min_gap_us``, largest first
    host_ops: list[tuple[str, int, float]]  # (top-level operator, calls, host us), most host time first


def load(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    with (gzip.open(p, "rt") if p.suffix == ".gz" else p.open()) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def analyze(events: list[dict[str, Any]], min_gap_us: float = 2.0) -> StepTrace:
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    steps = [e for e in xs if e.get("name") == "step" and e.get("cat") in ("user_annotation", "cpu_op")]
    if not steps:
        raise ValueError("no record_function range named 'step' in the trace")
    t0 = min(e["ts"] for e in steps)
    t1 = max(e["ts"] + e.get("dur", 0) for e in steps)
    gpu = sorted((e for e in xs if e.get("cat") in GPU_CATS and e["ts"] >= t0), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("no GPU work after the step's start in the trace")
    by_ext = {e["args"]["External id"]: e["name"] for e in xs
              if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    gaps, busy, end, prev = [], 0.0, t0, ""
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if start - end > min_gap_us:
            op = by_ext.get(e.get("args", {}).get("External id"), "?")
            gaps.append(Gap(end - t0, start - end, prev, e["name"], op))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, e["name"]
    return StepTrace(end - t0, busy, sorted(gaps, key=lambda g: -g.us), _top_level_ops(xs, t0, t1))


def _top_level_ops(xs: list[dict[str, Any]], t0: float, t1: float) -> list[tuple[str, int, float]]:
    """Host operators inside [t0, t1] not nested in another operator of their thread, by name."""
    ops = sorted((e for e in xs if e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1 and e.get("name") != "step"),
                 key=lambda e: (e.get("tid"), e["ts"], -e.get("dur", 0)))
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    open_until: dict[Any, float] = {}
    for e in ops:
        if e["ts"] < open_until.get(e.get("tid"), -1.0):
            continue
        open_until[e.get("tid")] = e["ts"] + e.get("dur", 0)
        total[e["name"]][0] += 1
        total[e["name"]][1] += e.get("dur", 0)
    return sorted(((k, int(n), us) for k, (n, us) in total.items()), key=lambda r: -r[2])


def render(t: StepTrace, gaps: int = 10, ops: int = 12, indent: str = "    ") -> str:
    idle = t.span_us - t.busy_us
    lines = [f"{indent}GPU busy {t.busy_us / 1e3:.3f} of {t.span_us / 1e3:.3f} ms from the step's start; idle "
             f"{idle / 1e3:.3f} ms in {len(t.gaps)} gaps over 2 us"]
    for g in t.gaps[:gaps]:
        lines.append(f"{indent}  idle {g.us:8.1f} us at {g.at_us / 1e3:7.3f} ms, until {g.op[:60]} "
                     f"({g.after[:50]}); after {g.before[:50] or 'the start'}")
    lines.append(f"{indent}host, top-level operators (calls, us):")
    for name, n, us in t.host_ops[:ops]:
        lines.append(f"{indent}  {us:9.1f} {n:5d}  {name[:90]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--gaps", type=int, default=10)
    ap.add_argument("--ops", type=int, default=12)
    args = ap.parse_args()
    print(render(analyze(load(args.trace)), args.gaps, args.ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
