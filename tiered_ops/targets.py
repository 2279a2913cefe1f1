"""The speed targets, measured: speed of light, the peers, the dispatch cost and the selection regret.

Two parts. ``live_grid`` and ``live_dispatch`` measure on the local GPU (``tiered-ops targets --live``): a grid of
30 (op, shape, dtype) points that no default sweep tunes on, every implementation of each (peers included,
into their own store), with the implementation that selection picks there from the main store with tuning
off (the nearest measured bucket); and the per-call host time of ``tiered_ops.<op>`` against each tier's
callable at launch-bound shapes. ``render`` turns results files into the Markdown table of every target with
its figure (``tiered-ops targets --results ...``): nothing in it is typed by hand.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pandas as pd
import torch

from .catalog import get_op
from .registry import DTYPES
from .timing import host_time_per_call

LARGE_BYTES = 64 << 20  # target 1: shapes moving at least 64 MiB
T2_OPS, T2_SHAPES = ("softmax", "rms_norm", "layer_norm"), ("16384x4096", "4096x32768")
SMALL_SHAPES = ((1, 4096), (32, 4096))

# Target 5: (op, shape, dtype) points off the default problems: rows 1..65536, columns 7..400000, 3 dtypes.
GRID: list[tuple[str, tuple[int, ...], str]] = [
    ("softmax", (1, 7), "fp16"), ("softmax", (3, 400000), "fp32"), ("softmax", (65536, 7), "bf16"),
    ("softmax", (100, 1000), "bf16"), ("softmax", (2048, 3000), "fp16"), ("softmax", (4000, 12288), "bf16"),
    ("softmax", (37, 50000), "fp32"), ("softmax", (9000, 512), "fp32"),
    ("rms_norm", (1, 2048), "bf16"), ("rms_norm", (65536, 96), "fp32"), ("rms_norm", (333, 7168), "bf16"),
    ("rms_norm", (5000, 5120), "fp16"), ("rms_norm", (12, 250000), "fp32"), ("rms_norm", (1024, 20000), "bf16"),
    ("rms_norm", (8192, 1536), "fp32"),
    ("layer_norm", (7, 7), "fp32"), ("layer_norm", (2000, 768), "bf16"), ("layer_norm", (30000, 1024), "fp16"),
    ("layer_norm", (64, 100000), "bf16"), ("layer_norm", (3, 400000), "fp32"), ("layer_norm", (8192, 3072), "fp32"),
    ("layer_norm", (500, 16000), "bf16"),
    ("gelu", (1, 7), "bf16"), ("gelu", (4096, 11008), "bf16"), ("gelu", (65536, 300), "fp32"),
    ("gelu", (100, 3000), "fp16"),
    ("muladd", (65536, 1000), "bf16"), ("muladd", (1, 400000), "fp32"), ("muladd", (300, 4001), "fp16"),
    ("muladd", (8, 8), "fp32"),
]


def grid_problem(op: str, shape: tuple[int, ...]) -> Any:
    """The op's problem at ``shape`` with its default parameters (the norms normalize the last dim)."""
    return get_op(op).problem(shape)


def live_grid(device: torch.device, main_db: str, grid_db: str, log: Callable[[str], None] = print,
              isolate: bool = True, timeout_s: float = 300.0, picks_csv: str | None = None) -> pd.DataFrame:
    """Measure every implementation at each GRID point into ``grid_db``; return one row per point with the
    implementation selection picks there from ``main_db`` with tuning off (written to ``picks_csv`` before the
    grid is measured, so an interrupted grid still has them)."""
    from . import decide as sel
    from .bench import sweep_cases
    from .store import Store

    picks = []
    sel.use_store(main_db)
    try:
        for op, shape, dt in GRID:
            p = grid_problem(op, shape)
            s = sel.select_problem(get_op(op), p, DTYPES[dt], device, tune=False, policy="fastest")
            picks.append(dict(op=op, problem=str(p), dtype=dt, selected=s.name, reason=s.record["reason"]))
    finally:
        sel.use_store(None)
    if picks_csv:
        pd.DataFrame(picks).to_csv(picks_csv, index=False)
    store = Store(grid_db)
    try:  # one sweep, so one worker gates and compiles each implementation once for every point
        sweep_cases([(get_op(op), grid_problem(op, shape), DTYPES[dt]) for op, shape, dt in GRID], device, store,
                    progress=False, log=log, modes=["fwd_nograd"], isolate=isolate, timeout_s=timeout_s,
                    cost_metadata=False)
    finally:
        store.close()
    return pd.DataFrame(picks)


def live_dispatch(device: torch.device, main_db: str) -> pd.DataFrame:
    """Per-call host time of ``tiered_ops.<op>`` (the main store's decision) and of every implementation of ours
    called directly, at the launch-bound SMALL_SHAPES, bf16 and fp32, in one process."""
    import tiered_ops

    from . import decide as sel

    rows = []
    sel.use_store(main_db)
    try:
        for op in ("softmax", "rms_norm", "layer_norm", "gelu", "muladd"):
            spec = get_op(op)
            for shape in SMALL_SHAPES:
                for dt in ("bf16", "fp32"):
                    p = grid_problem(op, shape)
                    inp = spec.make_inputs(p, DTYPES[dt], device, 0)
                    public = getattr(tiered_ops, op)
                    with torch.no_grad():
                        t_pub = host_time_per_call(lambda: public(*inp.args, **inp.kwargs), device)
                        chosen = sel.select_problem(spec, p, DTYPES[dt], device, tune=False).name
                        for impl in spec.impls.values():
                            if impl.tier.label == "peer" or impl.why_not(device, DTYPES[dt]):
                                continue
                            t = host_time_per_call(lambda: impl.fn(*inp.args, **inp.kwargs), device)
                            rows.append(dict(op=op, problem=str(p), dtype=dt, impl=impl.name, direct_us=t,
                                             public_us=t_pub, chosen=chosen))
    finally:
        sel.use_store(None)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------- render
def _shape(problem: str) -> str:
    return problem.split(",")[0]


def _f(v: float, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _best(g: pd.DataFrame, tiers: tuple[str, ...], by: str = "caller_us", highest: bool = False) -> pd.Series | None:
    """The correct timed row of ``tiers`` with the lowest ``by`` (the highest with ``highest``: kernel bandwidth
    for the speed-of-light target, where a launch-bound caller time would pick the other kernel)."""
    g = g[g.tier.isin(tiers) & (g.ok == 1) & g.caller_us.notna()]
    if g.empty:
        return None
    return g.loc[g[by].idxmax() if highest else g[by].idxmin()]


def render(results: pd.DataFrame, grid: pd.DataFrame | None = None, picks: pd.DataFrame | None = None,
           dispatch: pd.DataFrame | None = None) -> str:
    """The targets as Markdown, each with its figure and met / NOT met."""
    df = results.copy()
    df["shape"] = df.problem.map(_shape)
    df["bytes"] = df.gbps * df.p50_us * 1e3
    lines = ["## Speed targets", ""]

    lines += ["### 1. Large shapes (>= 64 MiB moved, fwd_nograd): best of our Triton/CUDA kernels >= 90 % of copy "
              "(kernel time)", "",
              "| op | shape | dtype | ours (impl) | % copy | compile % | best peer % | met |",
              "|---|---|---|---|---|---|---|---|"]
    fwd = df[(df["mode"] == "fwd_nograd")]
    for (op, shape, dtype), g in fwd.groupby(["op", "shape", "dtype"], sort=False):
        if g.bytes.max() < LARGE_BYTES:
            continue
        ours, comp, peer = (_best(g, t, "frac_copy", highest=True)
                            for t in (("triton", "cuda"), ("compile",), ("peer",)))
        if ours is None:
            continue
        pct = 100 * ours.frac_copy
        lines.append(f"| {op} | {shape} | {dtype} | {ours.impl} | {pct:.1f} | "
                     f"{_f(100 * comp.frac_copy if comp is not None else math.nan, '.1f')} | "
                     f"{_f(100 * peer.frac_copy if peer is not None else math.nan, '.1f')} | "
                     f"{'yes' if pct >= 90 else 'NOT met'} |")

    lines += ["", "### 2. CUDA tier vs torch.compile and Liger (bf16, fwd_nograd): >= 1.00x the best of them, "
              ">= 1.05x where it is below 85 % of copy", "",
              "| op | shape | cuda us | best peer (impl) us | its % copy | ratio | needs | met |",
              "|---|---|---|---|---|---|---|---|"]
    for op in T2_OPS:
        for shape in T2_SHAPES:
            g = fwd[(fwd.op == op) & (fwd["shape"] == shape) & (fwd.dtype == "bf16")]
            cuda, other = _best(g, ("cuda",)), _best(g, ("compile", "peer"))
            if cuda is None or other is None:
                lines.append(f"| {op} | {shape} | - | - | - | - | - | no data |")
                continue
            need = 1.05 if other.frac_copy < 0.85 else 1.00
            ratio = other.caller_us / cuda.caller_us
            lines.append(f"| {op} | {shape} | {cuda.caller_us:.1f} | {other.impl} {other.caller_us:.1f} | "
                         f"{100 * other.frac_copy:.1f} | {ratio:.3f} | {need:.2f} | "
                         f"{'yes' if ratio >= need else 'NOT met'} |")

    lines += ["", "### 3. fwd+bwd at 16384x4096 bf16: the best of our Triton/CUDA >= 1.2x eager and >= 1.0x compile",
              "", "| op | ours (impl) us | eager us | compile us | vs eager | vs compile | met |",
              "|---|---|---|---|---|---|---|"]
    fb = df[(df["mode"] == "fwd+bwd") & (df["shape"] == "16384x4096") & (df.dtype == "bf16")]
    for op, g in fb.groupby("op", sort=False):
        ours, eager, comp = _best(g, ("triton", "cuda")), _best(g, ("eager",)), _best(g, ("compile",))
        if ours is None or eager is None or comp is None:
            continue
        ve, vc = eager.caller_us / ours.caller_us, comp.caller_us / ours.caller_us
        lines.append(f"| {op} | {ours.impl} {ours.caller_us:.1f} | {eager.caller_us:.1f} | {comp.caller_us:.1f} | "
                     f"{ve:.2f} | {vc:.2f} | {'yes' if ve >= 1.2 and vc >= 1.0 else 'NOT met'} |")

    if dispatch is not None and len(dispatch):
        lines += ["", "### 4. Launch-bound shapes: `tiered_ops.<op>` per call <= 1.10x the fastest tier called "
                  "directly", "", "Host time per call, back-to-back calls, one process (`tiered-ops targets --live`).",
                  "", "| op | shape | dtype | tiered_ops us (chosen) | fastest direct (impl) us | ratio | "
                  "triton direct us | met |",
                  "|---|---|---|---|---|---|---|---|"]
        for (op, problem, dtype), g in dispatch.groupby(["op", "problem", "dtype"], sort=False):
            best = g.loc[g.direct_us.idxmin()]
            tri = g[g.impl == "triton"].direct_us
            ratio = best.public_us / best.direct_us
            lines.append(f"| {op} | {_shape(problem)} | {dtype} | {best.public_us:.1f} ({best.chosen}) | "
                         f"{best.direct_us:.1f} ({best.impl}) | {ratio:.2f} | "
                         f"{_f(tri.iloc[0] if len(tri) else math.nan, '.1f')} | "
                         f"{'yes' if ratio <= 1.10 else 'NOT met'} |")

    if grid is not None and picks is not None and len(grid):
        lines += ["", "### 5. Selection regret on shapes no sweep tuned on (fwd_nograd)", "",
                  "Selected: what `select_backend` picks there with tuning off (the nearest measured bucket of the "
                  "default sweep); best: the fastest correct implementation measured at the point, peers included.", "",
                  "| op | shape | dtype | selected us (impl) | best us (impl) | regret |", "|---|---|---|---|---|---|"]
        rs = regrets(grid, picks)
        for r in rs:
            lines.append(f"| {r['op']} | {_shape(r['problem'])} | {r['dtype']} | {_f(r['selected_us'], '.1f')} "
                         f"({r['selected']}) | {_f(r['best_us'], '.1f')} ({r['best']}) | {_f(r['regret'], '.3f')} |")
        n, geo, worst = _summary(rs)
        if n:
            met = "met" if geo <= 1.03 and worst <= 1.10 else "NOT met"
            lines += ["", f"**Regret over {n} points: geomean {geo:.3f} (target <= 1.03), max {worst:.3f} "
                      f"(target <= 1.10): {met}.**"]
    return "\n".join(lines) + "\n"


def regrets(grid: pd.DataFrame, picks: pd.DataFrame) -> list[dict[str, Any]]:
    """Per grid point: the selected implementation's time over the best measured (ours and peers); regret is
    NaN where the selected one has no correct timing there."""
    out = []
    for r in picks.itertuples():
        g = grid[(grid.op == r.op) & (grid.problem == r.problem) & (grid.dtype == r.dtype)
                 & (grid["mode"] == "fwd_nograd")]
        best = _best(g, ("eager", "compile", "triton", "cuda", "peer"))
        sel = g[(g.impl == r.selected) & (g.ok == 1) & g.caller_us.notna()]
        sel_us = sel.caller_us.iloc[-1] if len(sel) else math.nan
        out.append(dict(op=r.op, problem=r.problem, dtype=r.dtype, selected=r.selected, selected_us=sel_us,
                        best=None if best is None else best.impl, best_us=math.nan if best is None else best.caller_us,
                        regret=sel_us / best.caller_us if best is not None else math.nan))
    return out


def regret_summary(grid: pd.DataFrame, picks: pd.DataFrame) -> tuple[int, float, float]:
    """(points with a regret, geomean, max) of the selection regret, for the bench output."""
    return _summary(regrets(grid, picks))


def _summary(rs: list[dict[str, Any]]) -> tuple[int, float, float]:
    vals = [r["regret"] for r in rs if not math.isnan(r["regret"])]
    if not vals:
        return 0, math.nan, math.nan
    return len(vals), math.exp(sum(math.log(v) for v in vals) / len(vals)), max(vals)
