"""A first call with an empty store, blocking tuning against background tuning: per op at its first default problem
(inference, bf16 on a GPU, fp32 on a CPU), the latency of ``tiered_ops.<op>``'s first call with
``TIERED_OPS_TUNE=background`` beside the eager implementation's own first call (same process, fresh inputs), and
the seconds until the bucket's first gated choice is handed to the calls (a landing before the slower-to-gate
candidates are measured) and until every candidate is measured and the decision stored (``wait_for_tuning``), with
what was decided. Targets on the GPU:
first call <= eager's + 50 ms; decision stored in <= 3 s median, <= 8 s max.

Each op runs against a store of its own (a new file under --out-dir or a temporary directory), so nothing measured
before is reused; the ops run one after another, so one bucket is queued at a time. Where the seconds until a
decision go: each candidate's time in the background worker and its first call (compilation included), from the
background tuning's log records, printed and written beside --csv as ``<csv stem>_candidates.csv``, and the worker's
start, part by part. One worker serves the process. By default it is started before the first op
(``tiered_ops.warm_tuning``, as an application would at start-up) and its seconds are said apart; with ``--cold``
the first op's call starts it, and its start counts in that op's seconds (``worker_start_s``).

Then (unless --no-vs-blocking) the same bucket tuned blocking in a store of its own: what it picks, and the caller
time of background tuning's pick over that pick's, both from the blocking tuning's measurements (the regret of tuning
in the background against tuning on the call; target: no worse), on a device left quiet meanwhile: on a GPU in
background tuning's worker (``TIERED_OPS_BLOCKING_ASIDE``, default ``auto``), with ``TIERED_OPS_BLOCKING_ASIDE=0`` in
the calling process.

With ``--busy`` the application does not wait idle for the decision: it goes on calling the op (fresh inputs), each
call beside a 4096x4096x4096 bf16 matrix product on a GPU (a 512-cube in fp32 on a CPU) and one synchronization, as a
training step would, until the decision is stored (``busy_calls`` says how many). The worker then measures on a
loaded device, and the comparison with blocking tuning (measured on a quiet one) says what that load costs the
decision: the evidence for or against background tuning as the default.

    python benchmarks/first_call.py [--ops softmax,rms_norm] [--csv out.csv] [--timeout 120] [--cold]
        [--no-vs-blocking] [--busy]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

import tiered_ops
from tiered_ops.decide import background
from tiered_ops.decide.decide import _as_dtype, select_problem


class Candidates(logging.Handler):
    """Collects the figures background tuning logs for each candidate it measured, and for each landing."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rows: list[dict[str, Any]] = []
        self.landings: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        figures = getattr(record, background.CANDIDATE, None)
        if figures is not None:
            self.rows.append(dict(figures))
        landing = getattr(record, background.LANDING, None)
        if landing is not None:
            self.landings.append(dict(landing))


def first_call_ms(fn: Callable[[], Any], cuda: bool) -> float:
    """Wall time of one call, the device synchronized before and after."""
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def default_case(op: str, dev: torch.device) -> tuple[Any, Any, torch.dtype]:
    """(spec, problem, dtype) of an op's first default problem: bf16 on a GPU, fp32 on a CPU."""
    spec = tiered_ops.get_op(op)
    return spec, spec.default_problems(dev.type)[0], torch.bfloat16 if dev.type == "cuda" else torch.float32


def busy_until_landed(call: Callable[[], Any], dev: torch.device, timeout: float) -> tuple[bool, int]:
    """Call ``call`` beside a matrix product, synchronized each time, until background tuning has nothing queued or
    measuring, or ``timeout`` s passed: (landed, calls)."""
    cuda = dev.type == "cuda"
    n = 4096 if cuda else 512
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16 if cuda else torch.float32) for _ in range(2))
    calls, end = 0, time.perf_counter() + timeout
    while not tiered_ops.wait_for_tuning(0.0):
        if time.perf_counter() > end:
            return False, calls
        call()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        calls += 1
    return True, calls


def measure_op(op: str, dev: torch.device, store_dir: Path, timeout: float, busy: bool = False) -> dict[str, Any]:
    spec, problem, dtype = default_case(op, dev)
    cuda = dev.type == "cuda"
    tiered_ops.use_store(str(store_dir / f"{op}.sqlite"))
    tiered_ops.set_tuning("background")
    try:
        eager_in, public_in = (spec.make_inputs(problem, dtype, dev, seed) for seed in (1, 2))
        eager = spec.impls["eager"].fn
        with torch.no_grad():
            eager_ms = first_call_ms(lambda: eager(*eager_in.args, **eager_in.kwargs), cuda)
            t0 = time.perf_counter()
            public_ms = first_call_ms(lambda: getattr(tiered_ops, op)(*public_in.args, **public_in.kwargs), cuda)
            busy_calls = None
            if busy:
                more = [spec.make_inputs(problem, dtype, dev, seed) for seed in (3, 4)]
                landed, busy_calls = busy_until_landed(
                    lambda: getattr(tiered_ops, op)(*more[0].args, **more[0].kwargs), dev, timeout)
            else:
                landed = tiered_ops.wait_for_tuning(timeout)
            decision_s = time.perf_counter() - t0
        sel = select_problem(spec, problem, _as_dtype(dtype), dev, tune=False, mode="fwd_nograd")
    finally:
        tiered_ops.set_tuning(None)
    return dict(op=op, problem=str(problem), dtype=str(dtype).removeprefix("torch."), device=dev.type,
                eager_first_ms=round(eager_ms, 3), background_first_ms=round(public_ms, 3),
                over_eager_ms=round(public_ms - eager_ms, 3), decision_s=round(decision_s, 3) if landed else None,
                landed=landed, busy_calls=busy_calls, chosen=sel.name, reason=str(sel.record.get("reason", ""))[:120])


def vs_blocking(op: str, dev: torch.device, store_dir: Path, background_pick: str) -> dict[str, Any]:
    """The same bucket tuned blocking, in a store of its own: what that picks, how long it took, and the caller time
    of background tuning's pick over the blocking pick's, both from the blocking tuning's measurements (one run:
    the regret of tuning in the background against tuning on the call)."""
    spec, problem, dtype = default_case(op, dev)
    tiered_ops.use_store(str(store_dir / f"{op}-blocking.sqlite"))
    tiered_ops.set_tuning("blocking")
    try:
        t = time.perf_counter()
        sel = select_problem(spec, problem, _as_dtype(dtype), dev, mode="fwd_nograd")
        took = time.perf_counter() - t
    finally:
        tiered_ops.set_tuning(None)
    us = {c["impl"]: c["caller_us"] for c in sel.record.get("candidates", [])}
    mine, theirs = us.get(background_pick), us.get(sel.name)
    return dict(blocking_chosen=sel.name, blocking_s=round(took, 3),
                vs_blocking=round(mine / theirs, 3) if mine and theirs else None)


def said_blocking(rows: list[dict[str, Any]]) -> None:
    """The blocking tuning's seconds per bucket, median and max (target: <= 3 s median on a GPU)."""
    took = [r["blocking_s"] for r in rows if r.get("blocking_s") is not None]
    if took:
        print(f"blocking tuning, every candidate measured and the decision made on the first call: {len(took)} of "
              f"{len(rows)} buckets, median {statistics.median(took):.2f} s, max {max(took):.2f} s (target <= 3 s "
              "median)", flush=True)


def blocking_only(ops: list[str], dev: torch.device, csv: str | None, out_dir: str | None,
                  candidates: Candidates) -> int:
    """Each op's default bucket tuned blocking on its first call, in a store of its own, one op after another. On a
    GPU the call waits for background tuning's worker (``measured_in``: worker; the first op's seconds include the
    worker's start, ``worker_start_s``; each candidate's seconds there go to ``<csv stem>_candidates.csv``), else, or
    where the worker could not measure it, in this process."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(out_dir or tmp)
        store_dir.mkdir(parents=True, exist_ok=True)
        for op in ops:
            spec, problem, dtype = default_case(op, dev)
            r = dict(op=op, problem=str(problem), dtype=str(dtype).removeprefix("torch."), device=dev.type)
            seen = len(candidates.rows)
            r.update(vs_blocking(op, dev, store_dir, ""))
            r.pop("vs_blocking")
            mine = candidates.rows[seen:]
            start = [c["seconds"] for c in mine if c["impl"] == background.WORKER_START]
            r["measured_in"] = "worker" if any(c["op"] == op for c in mine) else "this process"
            r["worker_start_s"] = round(start[0], 3) if start else None
            rows.append(r)
            print(f"{op:<20} {r['problem'][:40]:<40} blocking tuning: {r['blocking_chosen']} in "
                  f"{r['blocking_s']:.2f} s, measured in {r['measured_in']}"
                  + ("" if not start else f" (the worker's start {start[0]:.2f} s of it)"), flush=True)
    said_blocking(rows)
    if csv and rows:
        pd.DataFrame(rows).to_csv(csv, index=False)
        print(f"wrote {csv}")
        if candidates.rows:  # each candidate's seconds in the worker, as the background run writes them
            path = Path(csv).with_name(f"{Path(csv).stem}_candidates.csv")
            pd.DataFrame(candidates.rows).to_csv(path, index=False)
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", help="comma-separated ops (default: every catalogued op)")
    p.add_argument("--csv", help="write the table here too")
    p.add_argument("--out-dir", help="where the per-op stores go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one bucket's decision")
    p.add_argument("--no-vs-blocking", dest="vs_blocking", action="store_false",
                   help="skip tuning each bucket blocking as well (the regret of background tuning against it)")
    p.add_argument("--cold", action="store_true",
                   help="do not start background tuning's worker before the first op (its start counts in that op's)")
    p.add_argument("--blocking-only", action="store_true",
                   help="tune each op's bucket blocking only, on its first call (no background tuning before it: with "
                        "empty compile caches, every kernel compiles in the blocking tuning's seconds; on a GPU the "
                        "call waits for background tuning's worker, whose start counts in the first op's seconds)")
    p.add_argument("--busy", action="store_true",
                   help="keep calling the op beside a matrix product until each decision is stored (a loaded device)")
    args = p.parse_args(argv)
    if args.csv:  # made now: a path that cannot be written fails before the run, not after it
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = args.ops.split(",") if args.ops else sorted(tiered_ops.OPS)
    candidates = Candidates()
    blog = logging.getLogger(background.__name__)
    blog.addHandler(candidates)
    blog.setLevel(logging.INFO)
    if args.blocking_only:
        return blocking_only(ops, dev, args.csv, args.out_dir, candidates)
    if not args.cold:
        took = tiered_ops.warm_tuning(dev, wait=True, timeout=args.timeout)
        start = next((c for c in candidates.rows if c["impl"] == background.WORKER_START), None)
        print("background tuning's worker: " + (f"not started within {args.timeout:g} s" if took is None else
              f"started before the first op in {took:.2f} s" + (f": {start['outcome']}" if start else "")), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(args.out_dir or tmp)
        store_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        for op in ops:
            seen, seen_landings = len(candidates.rows), len(candidates.landings)  # the warm start's row stays first
            rows.append(measure_op(op, dev, store_dir, args.timeout, args.busy))
            r = rows[-1]
            if args.vs_blocking:
                r.update(vs_blocking(op, dev, store_dir, r["chosen"]))
            first = next(iter(candidates.landings[seen_landings:]), None)
            r["first_landing_s"] = None if first is None else round(first["seconds"], 3)
            r["first_landing_impl"] = None if first is None else first["impl"]
            start = [c["seconds"] for c in candidates.rows[seen:] if c["impl"] == background.WORKER_START]
            r["worker_start_s"] = round(start[0], 3) if start else None  # the first op's, where the worker starts
            stored = "not within the timeout" if r["decision_s"] is None else f"{r['decision_s']:.2f} s"
            early = "" if first is None else f"first gated choice after {first['seconds']:.2f} s ({first['impl']}), "
            blocking = "" if not args.vs_blocking else (
                f"; blocking tuning: {r['blocking_chosen']} in {r['blocking_s']:.2f} s, the background pick at "
                f"{'-' if r['vs_blocking'] is None else format(r['vs_blocking'], '.3f')}x its caller time")
            print(f"{op:<20} {r['problem'][:40]:<40} eager first {r['eager_first_ms']:9.2f} ms, background first "
                  f"{r['background_first_ms']:9.2f} ms, {early}every candidate stored after {stored}: "
                  f"{r['chosen']}{blocking}" + ("" if r["busy_calls"] is None else f"; {r['busy_calls']} busy calls"),
                flush=True)
            for c in candidates.rows[seen:]:
                first = "-" if c["first_call_s"] is None else f"{c['first_call_s']:.2f} s"
                print(f"    {c['impl']:<16} {c['seconds']:6.2f} s in the worker, first call {first}: "
                      f"{str(c['outcome'])[:90]}", flush=True)
    landed = [r["decision_s"] for r in rows if r["decision_s"] is not None]
    early = [r["first_landing_s"] for r in rows if r["first_landing_s"] is not None]
    worst = max(r["over_eager_ms"] for r in rows)
    print(f"first call over eager's: max {worst:.1f} ms (target <= 50); first gated choice handed to the calls: "
          f"{len(early)} of {len(rows)}" + (f", median {statistics.median(early):.2f} s, max {max(early):.2f} s"
                                           if early else "")
          + f"; every candidate measured and the decision stored: {len(landed)} of {len(rows)}"
          + (f", median {statistics.median(landed):.2f} s, max {max(landed):.2f} s" if landed else "")
          + " (targets <= 3 s median, <= 8 s max)")
    ratios = [r["vs_blocking"] for r in rows if r.get("vs_blocking") is not None]
    if args.vs_blocking:
        said_blocking(rows)
        print(f"background tuning's pick against blocking tuning's (caller time, the blocking tuning's measurements): "
              f"{len(ratios)} of {len(rows)}" + (f", geomean {statistics.geometric_mean(ratios):.3f}, max "
                                                f"{max(ratios):.3f}" if ratios else ""))
    if args.csv and rows:
        pd.DataFrame(rows).to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
        if candidates.rows:
            path = Path(args.csv).with_name(f"{Path(args.csv).stem}_candidates.csv")
            pd.DataFrame(candidates.rows).to_csv(path, index=False)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
