"""Where the kernels stand against the speed of light: each case of ``benchmarks/speed_of_light.json`` (the training
steps of the norms, softmax and layer_norm over giant rows, segment_sum with power-law lengths, cross_entropy's
training step) measured with every implementation (ours, eager, compile, the peers that install), each gated against
float64, then per case the best of ours (the case's ``ours`` tiers): its fraction of the copy bandwidth measured in
the same run (bytes: the op's declared bytes of that mode), the same fraction by its kernel time alone, its speed-up
over eager and over the best of compile and Triton where the case sets a bar, and whether each bar holds. For a
training step, the host floor measured in the same run (a step that launches nothing, timed as the harness times a
step: the forward, then ``torch.autograd.grad``) beside the caller time the copy bar asks for: where the floor is
above it, no kernel meets that bar by caller time, and the page says so.

    python benchmarks/speed_of_light.py [--cases benchmarks/speed_of_light.json] [--out-dir DIR] [--db store.sqlite]
        [--only rms_norm,softmax]

Writes ``speed_of_light.csv`` (every measurement) and ``speed_of_light.md`` (the verdicts) under --out-dir, and
prints the table. A case whose best of ours is not correct, or not measured, fails its bars and says why.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiered_ops.measure.gate import with_grad  # noqa: E402
from tiered_ops.measure.timing import time_call  # noqa: E402
from tiered_ops.registry import DTYPES  # noqa: E402
from tiered_ops.store.rows import PRUNED  # noqa: E402
from tiered_ops.store.store import Store  # noqa: E402
from tiered_ops.sweep.bench import sweep_cases  # noqa: E402
from tiered_ops.sweep.live import grid_problem, load_grid  # noqa: E402
from tiered_ops.tiers.catalog import get_op  # noqa: E402

COMPILERS = ("compile", "triton")


def best(rows: pd.DataFrame, tiers: tuple[str, ...] | list[str]) -> pd.Series | None:
    """The fastest correct, fully timed row of these tiers (caller time), or None."""
    r = rows[rows.tier.isin(list(tiers)) & (rows.ok == True) & rows.caller_us.notna()]  # noqa: E712 (pandas)
    r = r[~r.reason.fillna("").str.startswith(PRUNED)]
    return None if r.empty else r.loc[r.caller_us.idxmin()]


def verdict(case: dict[str, Any], rows: pd.DataFrame) -> dict[str, Any]:
    """One case's figures and bars (True/False per bar; why where a figure is missing)."""
    out: dict[str, Any] = dict(case=case["case"], op=case["op"], shape=case["shape"], dtype=case["dtype"],
                               mode=case["mode"])
    ours = best(rows, case["ours"])
    if ours is None:
        return dict(out, why=f"no correct timing of {'/'.join(case['ours'])}", holds=False)
    out.update(best=ours.impl, best_us=round(float(ours.caller_us), 1))
    # A row's frac_copy is its kernel time's (the p50); the copy bar is the caller's: the copy time of these bytes
    # (frac_copy x p50) over the caller time.
    kernel_us = ours.get("p50_us")
    if pd.notna(ours.frac_copy) and pd.notna(kernel_us) and kernel_us > 0:
        copy_us = float(ours.frac_copy * kernel_us)
        out.update(copy=round(copy_us / float(ours.caller_us), 3), kernel_copy=round(float(ours.frac_copy), 3))
    else:
        out["copy"] = None
    bars = []
    if "copy_at_least" in case:
        bars.append(out["copy"] is not None and out["copy"] >= case["copy_at_least"])
        if out["copy"] is not None and case["copy_at_least"] > 0:  # the caller time the bar asks for
            out["bar_us"] = round(copy_us / case["copy_at_least"], 1)
    for key, tiers in (("vs_eager_at_least", ("eager",)), ("vs_compilers_at_least", COMPILERS)):
        if key not in case:
            continue
        other = best(rows[rows.impl != ours.impl], tiers)
        name = key.removesuffix("_at_least")
        if other is None:
            out[name], out["why"] = None, f"no correct timing of {'/'.join(tiers)}"
            bars.append(False)
            continue
        out[name] = round(float(other.caller_us / ours.caller_us), 3)
        out[f"{name}_impl"] = other.impl
        bars.append(out[name] >= case[key])
    out["holds"] = all(bars)
    return out


def null_step(x: torch.Tensor) -> Callable[[], Any]:
    """A training step that launches nothing, timed as the harness times a step (the forward, then
    ``torch.autograd.grad``): a C++ autograd node, a view of ``x`` (a leaf requiring grad), its gradient a view of
    dy."""
    return lambda: torch.autograd.grad(x.view(x.shape), [x], x.detach())


def step_floor_us(op: str, problem: Any, dtype: str, device: torch.device) -> float:
    """Host us of ``null_step`` over this problem's first differentiable input."""
    spec = get_op(op)
    inp, pos = with_grad(spec, spec.make_inputs(problem, DTYPES[dtype], device, 0))
    step = null_step(inp.args[pos[0]])
    step()
    return float(time_call(step, device).host_us)


def with_floor(v: dict[str, Any], floor_us: float) -> dict[str, Any]:
    """A training step's verdict with its host floor; where the floor is above the caller time its copy bar asks for,
    the page says that no kernel meets the bar by caller time."""
    v = dict(v, floor_us=round(floor_us, 1))
    if not v["holds"] and v.get("bar_us") is not None and floor_us > v["bar_us"]:
        reach = f"the step's host floor {floor_us:.1f} us is above the {v['bar_us']} us the copy bar asks for"
        v["why"] = f"{v['why']}; {reach}" if v.get("why") else reach
    return v


def table(verdicts: list[dict[str, Any]], cases: list[dict[str, Any]]) -> str:
    lines = ["| case | shape | dtype | mode | best of ours | us | copy (bar) | kernel copy | step floor us (bar us) "
             "| x eager (bar) | x compile/Triton (bar) | holds |", "|---|---|---|---|---|---:|---|---|---|---|---|---|"]
    def floor(v: dict[str, Any]) -> str:
        if v.get("floor_us") is None:
            return ""
        return f"{v['floor_us']}" + (f" ({v['bar_us']})" if v.get("bar_us") is not None else "")

    for v, c in zip(verdicts, cases):
        def fig(name: str, bar: str) -> str:
            if bar not in c:
                return ""
            val = v.get(name)
            who = f" ({v[name + '_impl']})" if v.get(name + "_impl") else ""
            return f"{'-' if val is None else val}{who} ({c[bar]})"
        lines.append(f"| {v['case']} | {v['shape']} | {v['dtype']} | {v['mode']} | {v.get('best', '-')} | "
                     f"{v.get('best_us', '-')} | {fig('copy', 'copy_at_least')} | {v.get('kernel_copy', '')} "
                     f"| {floor(v)} "
                     f"| {fig('vs_eager', 'vs_eager_at_least')} | {fig('vs_compilers', 'vs_compilers_at_least')} "
                     f"| {'yes' if v['holds'] else 'no'}"
                     f"{' (' + v['why'] + ')' if v.get('why') else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--only", help="comma-separated ops: only their cases")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--db", help="the store to measure into (default: a new one in a temporary folder)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--in-process", action="store_true", help="measure in this process (no isolated worker)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one candidate may take (isolated)")
    args = ap.parse_args(argv)
    every = json.loads(Path(args.cases).read_text())
    points = load_grid(args.cases)  # validates op, shape, dtype, mode and params, naming the entry
    named = [c.get("case") for c in every]
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:  # a case's rows and verdict are found by its name: two cases of one name would read one's rows twice
        ap.error(f"{args.cases}: each case needs a name of its own; named more than once: {', '.join(map(str, twice))}")
    keep = [i for i, c in enumerate(every) if not args.only or c["op"] in args.only.split(",")]
    cases, points = [every[i] for i in keep], [points[i] for i in keep]
    if not cases:
        ap.error(f"--only {args.only}: no case of those ops in {args.cases} (its ops: "
                 f"{', '.join(dict.fromkeys(c['op'] for c in every))})")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(args.db or str(Path(tmp) / "speed_of_light.sqlite"))
        frames = []
        problems = [grid_problem(pt.op, pt.shape, pt.params) for pt in points]
        of_case = {(pt.op, str(p), pt.dtype, pt.mode): c["case"] for c, pt, p in zip(cases, points, problems)}
        try:  # one sweep per mode, so one worker gates and compiles each implementation once for all its cases
            for mode in dict.fromkeys(pt.mode for pt in points):
                print(f"== {mode}: " + "; ".join(c["case"] for c, pt in zip(cases, points) if pt.mode == mode),
                      flush=True)
                frames.append(sweep_cases([(get_op(pt.op), p, DTYPES[pt.dtype]) for pt, p in zip(points, problems)
                                           if pt.mode == mode], device, store, progress=False, modes=[mode],
                                          isolate=not args.in_process, timeout_s=args.timeout, cost_metadata=False,
                                          gate_all=True, prune=None))
        finally:
            store.close()
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(rows):
        rows["case"] = [of_case.get(k) for k in zip(rows.op, rows.problem, rows.dtype, rows["mode"])]
    rows.to_csv(out / "speed_of_light.csv", index=False)
    verdicts = [verdict(c, rows[rows.case == c["case"]]) for c in cases]
    for i, (pt, p) in enumerate(zip(points, problems)):
        if pt.mode == "fwd+bwd":
            verdicts[i] = with_floor(verdicts[i], step_floor_us(pt.op, p, pt.dtype, device))
    md = table(verdicts, cases)
    (out / "speed_of_light.md").write_text(
        f"# Speed of light ({rows.gpu_name.iloc[0] if len(rows) and 'gpu_name' in rows else args.device})\n\n"
        f"`python benchmarks/speed_of_light.py {' '.join(argv if argv is not None else sys.argv[1:])}`. Caller "
        "time of the best correct implementation of ours (the case's tiers), its fraction of the copy bandwidth "
        "measured in the same run, the same by its kernel time alone, a training step's host floor (a step that "
        "launches nothing, same run) beside the caller time the copy bar asks for, and its speed-up over the best "
        "correct eager and compile/Triton rows.\n\n"
        + md + "\n")
    print(md)
    return 0 if all(v["holds"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
