"""Measuring for the speed targets on the local GPU (``tiered-ops targets --live``): ``live_grid`` measures every
implementation at each point of a grid file (``load_grid``, e.g. ``benchmarks/grid.csv``; peers included, into their
own store), with the implementation selection picks there from the main store with tuning off (the nearest measured
bucket) and with tuning on (each point's bucket tuned as a call would tune it); ``live_dispatch`` the per-call host
time of ``tiered_ops.<op>`` against each tier's callable at launch-bound shapes. ``targets.render`` reads what they
return.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pandas as pd
import torch

from ..decide import decide as sel
from ..measure.recheck import interleaved
from ..measure.timing import host_time_per_call
from ..registry import DTYPES, MODES
from ..runtime.dispatch import make_public
from ..store.store import Store
from ..tiers.catalog import all_ops, get_op
from .bench import sweep_cases

DISPATCH_ROUNDS = 7  # interleaved rounds of the dispatch cost


class GridPoint(NamedTuple):
    op: str
    shape: tuple[int, ...]
    dtype: str
    mode: str
    params: dict[str, Any]


def _shape(text: str, where: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in str(text).split("x"))
    except ValueError:
        raise ValueError(f"{where}: shape {text!r}: expected sizes like 16384x4096") from None
    return shape


def load_grid(path: str | Path) -> list[GridPoint]:
    """The points of a grid file: CSV with columns op, shape, dtype, mode, params (a JSON object, may be empty), or
    JSON: a list of objects with those keys. A bad entry is an error naming the file, the entry and the field."""
    path = Path(path)
    if path.suffix == ".json":
        entries = json.loads(path.read_text())
    else:
        with path.open(newline="") as f:
            entries = list(csv.DictReader(f))
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a list of grid points (op, shape, dtype, mode, params)")
    points = []
    for n, e in enumerate(entries, start=2 if path.suffix != ".json" else 0):
        where = f"{path}, {'line' if path.suffix != '.json' else 'entry'} {n}"
        missing = [k for k in ("op", "shape", "dtype", "mode") if not e.get(k)]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        get_op(e["op"])  # an unknown op names the known ones
        if e["dtype"] not in DTYPES or e["mode"] not in MODES:
            raise ValueError(f"{where}: dtype {e['dtype']!r} / mode {e['mode']!r}: expected one of "
                             f"{', '.join(DTYPES)} / {', '.join(MODES)}")
        params = e.get("params") or {}
        if isinstance(params, str):
            try:
                params = json.loads(params)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: params {params!r} is not a JSON object ({err})") from None
        if not isinstance(params, dict):
            raise ValueError(f"{where}: params: expected a JSON object, got {params!r}")
        points.append(GridPoint(e["op"], _shape(e["shape"], where), e["dtype"], e["mode"], params))
    return points


def grid_problem(op: str, shape: tuple[int, ...], params: dict[str, Any] | None = None) -> Any:
    """The op's problem at ``shape`` with ``params`` (the op's defaults for the rest)."""
    return get_op(op).problem(shape, **(params or {}))


def live_grid(device: torch.device, main_db: str, grid_db: str, points: list[GridPoint],
              log: Callable[[str], None] = print, isolate: bool = True, timeout_s: float = 300.0,
              picks_csv: str | None = None, tuned_db: str | None = None) -> pd.DataFrame:
    """Measure every implementation at each point into ``grid_db`` (every candidate gated: a regret needs the
    picked one's correct timing wherever a choice took it); return one row per point with what selection picks
    there from ``main_db`` with tuning off (the nearest measured bucket: ``selected``) and, given ``tuned_db``, with
    tuning on (``tuned``: the point tuned as a call would tune it, into a store holding the main store's rows, so
    its measurement is not the grid's). ``picks_csv`` is written before the grid is measured and after each tuned
    point, so an interrupted run keeps what it decided."""
    picks = []
    sel.use_store(main_db)
    try:
        for pt in points:
            p = grid_problem(pt.op, pt.shape, pt.params)
            s = sel.select_problem(get_op(pt.op), p, DTYPES[pt.dtype], device, tune=False, policy="fastest",
                                   mode=pt.mode)
            picks.append(dict(op=pt.op, problem=str(p), dtype=pt.dtype, mode=pt.mode, selected=s.name,
                              reason=s.record["reason"]))
    finally:
        sel.use_store(None)
    if picks_csv:
        pd.DataFrame(picks).to_csv(picks_csv, index=False)
    if tuned_db is not None:
        _tune_points(device, main_db, tuned_db, points, picks, log, picks_csv)
    store = Store(grid_db)
    try:  # one sweep per mode, so one worker gates and compiles each implementation once for all its points
        for mode in dict.fromkeys(pt.mode for pt in points):
            sweep_cases([(get_op(pt.op), grid_problem(pt.op, pt.shape, pt.params), DTYPES[pt.dtype])
                         for pt in points if pt.mode == mode], device, store, progress=False, log=log, modes=[mode],
                        isolate=isolate, timeout_s=timeout_s, cost_metadata=False, gate_all=True)
    finally:
        store.close()
    return pd.DataFrame(picks)


def export_grid(out: Path, points: list[GridPoint]) -> list[str]:
    """Write ``out``/grid.csv from the grid's store and, where the points were tuned, ``out``/tuned.csv: the tuning's
    own measurements of the points (not the main store's rows it started from), to read beside the grid's. Returns the
    file names written."""
    grid = Store(out / "grid.sqlite")
    try:
        pd.DataFrame(grid.rows()).to_csv(out / "grid.csv", index=False)
    finally:
        grid.close()
    if not (out / "tuned.sqlite").exists():
        return ["grid.csv"]
    tuned_store = Store(out / "tuned.sqlite")
    try:
        tuned = pd.DataFrame(tuned_store.rows())
    finally:
        tuned_store.close()
    asked = {(p.op, str(grid_problem(p.op, p.shape, p.params))) for p in points}
    tuned[[k in asked for k in zip(tuned.op, tuned.problem)]].to_csv(out / "tuned.csv", index=False)
    return ["grid.csv", "tuned.csv"]


def _tune_points(device: torch.device, main_db: str, tuned_db: str, points: list[GridPoint], picks: list[dict],
                 log: Callable[[str], None], picks_csv: str | None) -> None:
    """Each point's pick with tuning on: its bucket tuned (blocking) in a store that starts as the main store's
    rows, as a user's process with the default sweep's store would tune it. A point whose tuning fails keeps its
    error as the pick's reason (no pick: its regret is missing, and the summary counts it)."""
    tuned = Store(tuned_db)
    if not tuned.rows():
        main = Store(main_db)
        tuned.add(main.rows())
        main.close()
    sel.use_store(tuned)
    try:
        for k, (pt, pick) in enumerate(zip(points, picks), start=1):
            p = grid_problem(pt.op, pt.shape, pt.params)
            t0 = time.perf_counter()
            try:
                s = sel.select_problem(get_op(pt.op), p, DTYPES[pt.dtype], device, tune=True, policy="fastest",
                                       mode=pt.mode)
                pick.update(tuned=s.name, tuned_reason=s.record["reason"])
            except Exception as e:  # noqa: BLE001 - one point's failure is recorded with the point, the rest go on
                pick.update(tuned=None, tuned_reason=f"tuning failed: {type(e).__name__}: {e}")
            log(f"tuned {k}/{len(points)}: {pt.op} {p} {pt.dtype} {pt.mode} in {time.perf_counter() - t0:.1f} s: "
                f"{pick['tuned']} (tuning off: {pick['selected']})")
            if picks_csv:
                pd.DataFrame(picks).to_csv(picks_csv, index=False)
    finally:
        sel.use_store(None)


def live_dispatch(device: torch.device, main_db: str, shapes: list[str], dtypes: list[str],
                  ops: list[str] | None = None, rounds: int = DISPATCH_ROUNDS) -> pd.DataFrame:
    """Per-call host time of ``tiered_ops.<op>`` (the main store's decision) and of every implementation of ours
    called directly, at ``shapes`` (like "32x4096") and ``dtypes``, in one process: the median over ``rounds``
    interleaved rounds (the order rotated each round), as a launch-bound call's host time moves by more than the
    difference measured from one moment to the next."""
    rows = []
    sel.use_store(main_db)
    try:
        for spec in [get_op(o) for o in ops] if ops else all_ops():
            for shape in shapes:
                for dt in dtypes:
                    p = grid_problem(spec.name, _shape(shape, "dispatch shapes"))
                    inp = spec.make_inputs(p, DTYPES[dt], device, 0)
                    public = make_public(spec)
                    calls = {"": lambda: public(*inp.args, **inp.kwargs)}
                    calls.update({impl.name: (lambda f=impl.fn: f(*inp.args, **inp.kwargs))
                                  for impl in spec.impls.values()
                                  if impl.tier.label != "peer" and not impl.why_not(device, DTYPES[dt])})
                    with torch.no_grad():
                        # first calls outside the rounds (a Triton kernel's compilation), the public one first: it
                        # decides as a user's first call would (tuning its bucket where the process tunes)
                        for fn in calls.values():
                            fn()
                        chosen = sel.select_problem(spec, p, DTYPES[dt], device, tune=False).name
                        times = interleaved(calls, rounds, lambda f: host_time_per_call(f, device))
                    t_pub = statistics.median(times.pop(""))
                    rows += [dict(op=spec.name, problem=str(p), dtype=dt, impl=n, direct_us=statistics.median(ts),
                                  public_us=t_pub, chosen=chosen, rounds=rounds) for n, ts in times.items()]
    finally:
        sel.use_store(None)
    return pd.DataFrame(rows)
