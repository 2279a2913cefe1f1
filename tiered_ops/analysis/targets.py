"""Speed targets as data, measured: selection regret on a grid of points, the dispatch cost, and a table per target.

Nothing here names a target or a point: the grid is a file of (op, shape, dtype, mode, params) points
(``load_grid``, e.g. ``benchmarks/grid.csv``) and the targets with their thresholds are a JSON file (``load_spec``,
e.g. ``benchmarks/targets.json``). ``sweep.live`` measures them on the local GPU (``tiered-ops targets --live``).
``render`` turns results files and those measurements into the Markdown table of every target in the spec, each
with its figure and verdict (``tiered-ops targets --spec FILE --results ...``, ``tiered-ops report
--targets-spec FILE``): nothing in it is typed by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from ..store.rows import EDGE_ONLY
from .analysis import latest

LABELS = {"eager": "eager", "compile": "torch.compile", "triton": "Triton", "cuda": "CUDA", "peer": "the peers"}
KINDS: dict[str, tuple[str, ...]] = {  # each kind of target and the keys its entry must carry
    "copy_fraction": ("mode", "min_bytes", "ours", "compare", "at_least"),
    "vs_best": ("tier", "against", "ops", "shapes", "dtype", "mode", "at_least", "below_copy", "at_least_below_copy"),
    "training": ("mode", "shape", "dtype", "ours", "vs_eager", "vs_compile"),
    "dispatch": ("shapes", "dtypes", "at_most"),
    "regret": ("mode", "geomean_at_most", "max_at_most"),
}


def load_spec(path: str | Path) -> dict[str, Any]:
    """The speed targets of a JSON file: {"title": ..., "targets": [{"kind": ..., thresholds...}, ...]}."""
    spec = json.loads(Path(path).read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("targets"), list):
        raise ValueError(f"{path}: expected an object with a list 'targets'")
    for i, t in enumerate(spec["targets"], start=1):
        if t.get("kind") not in KINDS:
            raise ValueError(f"{path}: target {i}: kind {t.get('kind')!r}: expected one of {', '.join(KINDS)}")
        if missing := [k for k in KINDS[t["kind"]] if k not in t]:
            raise ValueError(f"{path}: target {i} ({t['kind']}): missing {', '.join(missing)}")
    return spec


def target(spec: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The spec's first target of ``kind``, or None."""
    return next((t for t in (spec or {}).get("targets", []) if t["kind"] == kind), None)


def not_copy_bound(spec: dict[str, Any] | None) -> dict[str, str]:
    """The ops the copy-fraction target leaves out, with why (op -> why): their limit is not the copy bandwidth."""
    t = target(spec, "copy_fraction") or {}
    return {op: t.get("except_why", "not bound by copy") for op in t.get("except_ops", ())}


# ------------------------------------------------------------------------------------------------- render
def _short(problem: str) -> str:
    return problem.split(",")[0]


def _f(v: float, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _best(g: pd.DataFrame, tiers: tuple[str, ...] | list[str], by: str = "caller_us",
          highest: bool = False, rivals: bool = False) -> pd.Series | None:
    """The correct timed row of ``tiers`` with the lowest ``by`` (the highest with ``highest``: kernel bandwidth
    for the copy-fraction target, where a launch-bound caller time would pick the other kernel). ``rivals``: a
    peer's row timed where it is correct though it fails an edge case it does not claim (``EDGE_ONLY``) counts too,
    as the peer a kernel of ours is held against."""
    correct = g.ok == 1
    if rivals and "reason" in g:
        correct |= (g.tier == "peer") & g.reason.astype(object).fillna("").astype(str).str.startswith(EDGE_ONLY)
    g = g[g.tier.isin(list(tiers)) & correct & g.caller_us.notna()]
    if g.empty:
        return None
    return g.loc[g[by].idxmax() if highest else g[by].idxmin()]


def _x(v: float) -> str:
    """A ratio threshold as written: 1.2, 1.0, 1.05."""
    s = f"{v:.2f}".rstrip("0")
    return s + "0" if s.endswith(".") else s


def _names(tiers: list[str], sep: str = "/") -> str:
    return sep.join(LABELS.get(t, t) for t in tiers)


def _copy_fraction(t: dict, df: pd.DataFrame) -> list[str]:
    cols = " | ".join(f"{'best ' if c == 'peer' else ''}{c} %" for c in t["compare"])
    lines = [f"Large shapes (>= {t['min_bytes'] / (1 << 20):g} MiB moved, {t['mode']}): best of our "
             f"{_names(t['ours'])} kernels >= {100 * t['at_least']:g} % of copy (kernel time)", "",
             f"| op | shape | dtype | ours (impl) | % copy | {cols} | met |", "|---|---|---|---|---|" +
             "---|" * len(t["compare"]) + "---|"]
    if t.get("except_ops"):
        why = t.get("except_why", "not bound by copy")
        lines[1:1] = ["", f"Not judged here: {', '.join(t['except_ops'])} ({why})."]
    for (op, shape, dtype), g in df[df["mode"] == t["mode"]].groupby(["op", "shape", "dtype"], sort=False):
        ours = _best(g, t["ours"], "frac_copy", highest=True)
        if g.bytes.max() < t["min_bytes"] or ours is None or op in t.get("except_ops", ()):
            continue
        others = [_best(g, (c,), "frac_copy", highest=True, rivals=True) for c in t["compare"]]
        pct = 100 * ours.frac_copy
        lines.append(f"| {op} | {shape} | {dtype} | {ours.impl} | {pct:.1f} | " + " | ".join(
            _f(100 * o.frac_copy if o is not None else math.nan, ".1f") for o in others)
            + f" | {'yes' if pct >= 100 * t['at_least'] else 'NOT met'} |")
    return lines


def _vs_best(t: dict, df: pd.DataFrame) -> list[str]:
    lines = [f"{LABELS.get(t['tier'], t['tier'])} tier vs {_names(t['against'], ' and ')} ({t['dtype']}, "
             f"{t['mode']}): >= {t['at_least']:.2f}x the best of them, >= {t['at_least_below_copy']:.2f}x where it "
             f"is below {100 * t['below_copy']:g} % of copy", "",
             f"| op | shape | {t['tier']} us | best of them (impl) us | its % copy | ratio | needs | met |",
             "|---|---|---|---|---|---|---|---|"]
    sub = df[(df["mode"] == t["mode"]) & (df.dtype == t["dtype"])]
    for op in t["ops"]:
        for shape in t["shapes"]:
            g = sub[(sub.op == op) & (sub["shape"] == shape)]
            mine, other = _best(g, (t["tier"],)), _best(g, t["against"], rivals=True)
            if mine is None or other is None:
                lines.append(f"| {op} | {shape} | - | - | - | - | - | no data |")
                continue
            need = t["at_least_below_copy"] if other.frac_copy < t["below_copy"] else t["at_least"]
            ratio = other.caller_us / mine.caller_us
            lines.append(f"| {op} | {shape} | {mine.caller_us:.1f} | {other.impl} {other.caller_us:.1f} | "
                         f"{100 * other.frac_copy:.1f} | {ratio:.3f} | {need:.2f} | "
                         f"{'yes' if ratio >= need else 'NOT met'} |")
    return lines


def _training(t: dict, df: pd.DataFrame) -> list[str]:
    lines = [f"{t['mode']} at {t['shape']} {t['dtype']}: the best of our {_names(t['ours'])} >= {_x(t['vs_eager'])}x "
             f"eager and >= {_x(t['vs_compile'])}x compile", "",
             "| op | ours (impl) us | eager us | compile us | vs eager | vs compile | met |",
             "|---|---|---|---|---|---|---|"]
    fb = df[(df["mode"] == t["mode"]) & (df["shape"] == t["shape"]) & (df.dtype == t["dtype"])]
    for op, g in fb.groupby("op", sort=False):
        ours, eager, comp = _best(g, t["ours"]), _best(g, ("eager",)), _best(g, ("compile",))
        if ours is None or eager is None or comp is None:
            continue
        ve, vc = eager.caller_us / ours.caller_us, comp.caller_us / ours.caller_us
        met = ve >= t["vs_eager"] and vc >= t["vs_compile"]
        lines.append(f"| {op} | {ours.impl} {ours.caller_us:.1f} | {eager.caller_us:.1f} | {comp.caller_us:.1f} | "
                     f"{ve:.2f} | {vc:.2f} | {'yes' if met else 'NOT met'} |")
    return lines


def _dispatch(t: dict, dispatch: pd.DataFrame) -> list[str]:
    lines = [f"Launch-bound shapes: `tiered_ops.<op>` per call <= {t['at_most']:.2f}x the fastest tier called "
             "directly", "", "Host time per call, back-to-back calls, one process (`tiered-ops targets --live`).", "",
             "| op | shape | dtype | tiered_ops us (chosen) | fastest direct (impl) us | ratio | triton direct us | "
             "met |", "|---|---|---|---|---|---|---|---|"]
    for (op, problem, dtype), g in dispatch.groupby(["op", "problem", "dtype"], sort=False):
        best = g.loc[g.direct_us.idxmin()]
        tri = g[g.impl == "triton"].direct_us
        ratio = best.public_us / best.direct_us
        lines.append(f"| {op} | {_short(problem)} | {dtype} | {best.public_us:.1f} ({best.chosen}) | "
                     f"{best.direct_us:.1f} ({best.impl}) | {ratio:.2f} | "
                     f"{_f(tri.iloc[0] if len(tri) else math.nan, '.1f')} | "
                     f"{'yes' if ratio <= t['at_most'] else 'NOT met'} |")
    return lines


def _regret(t: dict, grid: pd.DataFrame, picks: pd.DataFrame) -> list[str]:
    rs = regrets(grid, picks, t["mode"])
    on = "tuned" in picks.columns
    lines = [f"Selection regret on shapes no sweep tuned on ({t['mode']})", "",
             "Tuning off: what `select_backend` picks there from the default sweep's store (the nearest measured "
             "bucket)" + ("; tuning on: what it picks once a call has tuned the point's bucket (its own "
                          "measurement, not the grid's)" if on else "") + "; best: the fastest correct "
             "implementation measured at the point, peers included. Every time is the grid's measurement.", ""]
    if on:
        lines += ["| op | shape | dtype | tuning off us (impl) | tuning on us (impl) | best us (impl) | regret off | "
                  "regret on |", "|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| op | shape | dtype | selected us (impl) | best us (impl) | regret |", "|---|---|---|---|---|---|"]
    for r in rs:
        row = (f"| {r['op']} | {_short(r['problem'])} | {r['dtype']} | {_f(r['selected_us'], '.1f')} "
               f"({r['selected']}) | ")
        if on:
            row += f"{_f(r['tuned_us'], '.1f')} ({r['tuned']}) | "
        row += f"{_f(r['best_us'], '.1f')} ({r['best']}) | {_f(r['regret'], '.3f')} |"
        lines.append(row + (f" {_f(r['regret_tuned'], '.3f')} |" if on else ""))
    lines.append("")
    # the target judges the tuned picks where they were measured; the other figure is stated
    for label, col, judged in ((("tuning on", "regret_tuned", True), ("tuning off", "regret", False)) if on
                               else (("", "regret", True),)):
        n, geo, worst = _summary(rs, col)
        gaps = len(rs) - n
        if not n:
            lines.append(f"**Regret{' with ' + label if label else ''}: no point has a correct timing of its pick.**")
            continue
        met = "met" if geo <= t["geomean_at_most"] and worst <= t["max_at_most"] else "NOT met"
        verdict = f": {met}" if judged else " (stated, not the target's figure)"
        lines.append(f"**Regret{' with ' + label if label else ''} over {n} points"
                     f"{f' ({gaps} of {len(rs)} without a correct timing of the pick)' if gaps else ''}: geomean "
                     f"{geo:.3f} (target <= {t['geomean_at_most']:.2f}), max {worst:.3f} (target <= "
                     f"{t['max_at_most']:.2f}){verdict}.**")
        lines.append("")
    return lines[:-1]


def render(results: pd.DataFrame, spec: dict[str, Any], grid: pd.DataFrame | None = None,
           picks: pd.DataFrame | None = None, dispatch: pd.DataFrame | None = None) -> str:
    """The targets of ``spec`` as Markdown, each with its figure and met / NOT met; a target measured by
    ``targets --live`` (dispatch, regret) appears when its measurements are given."""
    df = latest(results)  # each case's newest row per implementation (a resumed sweep keeps the stale ones too)
    df["shape"] = df.problem.map(_short)
    df["bytes"] = df.gbps * df.p50_us * 1e3
    lines = [f"## {spec.get('title', 'Speed targets')}"]
    n = 0
    for t in spec["targets"]:
        if t["kind"] == "dispatch":
            if dispatch is None or not len(dispatch):
                continue
            body = _dispatch(t, dispatch)
        elif t["kind"] == "regret":
            if grid is None or picks is None or not len(grid):
                continue
            body = _regret(t, grid, picks)
        else:
            body = {"copy_fraction": _copy_fraction, "vs_best": _vs_best, "training": _training}[t["kind"]](t, df)
        n += 1
        lines += ["", f"### {n}. {body[0]}", *body[1:]]
    return "\n".join(lines) + "\n"


def regrets(grid: pd.DataFrame, picks: pd.DataFrame, mode: str = "fwd_nograd") -> list[dict[str, Any]]:
    """Per grid point in ``mode``: the picked implementation's time over the best measured (ours and peers), for
    the pick with tuning off (``selected``: ``regret``) and, where picks has it, with tuning on (``tuned``:
    ``regret_tuned``); a regret is NaN where its pick has no correct timing there. Each implementation's newest row
    of a point counts (a case's launch-bound rows timed again side by side are newer than their first timing)."""
    out, grid = [], latest(grid)
    picks = picks if "mode" in picks.columns else picks.assign(mode=mode)
    for r in picks[picks["mode"] == mode].itertuples():
        g = grid[(grid.op == r.op) & (grid.problem == r.problem) & (grid.dtype == r.dtype) & (grid["mode"] == mode)]
        best = _best(g, ("eager", "compile", "triton", "cuda", "peer"))
        best_us = math.nan if best is None else best.caller_us
        row = dict(op=r.op, problem=r.problem, dtype=r.dtype, best=None if best is None else best.impl,
                   best_us=best_us)
        for col, key in (("selected", "regret"), ("tuned", "regret_tuned")):
            impl = getattr(r, col, None)
            sel = g[(g.impl == impl) & (g.ok == 1) & g.caller_us.notna()]
            us = sel.caller_us.iloc[-1] if len(sel) else math.nan
            row.update({col: impl if isinstance(impl, str) else None, f"{col}_us": us, key: us / best_us})
        out.append(row)
    return out


def regret_summary(grid: pd.DataFrame, picks: pd.DataFrame, mode: str = "fwd_nograd",
                   tuned: bool = False) -> tuple[int, float, float]:
    """(points with a regret, geomean, max) of the selection regret in ``mode`` with tuning off (``tuned``: on)."""
    return _summary(regrets(grid, picks, mode), "regret_tuned" if tuned else "regret")


def _summary(rs: list[dict[str, Any]], col: str = "regret") -> tuple[int, float, float]:
    vals = [r[col] for r in rs if not math.isnan(r[col])]
    if not vals:
        return 0, math.nan, math.nan
    return len(vals), math.exp(sum(math.log(v) for v in vals) / len(vals)), max(vals)
