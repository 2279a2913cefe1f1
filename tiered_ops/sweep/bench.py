"""The benchmark sweep: every implementation of every op at each problem and dtype, gated, timed, stored.

Each measurement is committed to the store as soon as it is taken, so an interrupted sweep keeps
what it finished (a crashing or hanging candidate costs itself only when isolated in a worker); a
measurement that is already stored with the current source hash for this device
is reused rather than taken again (``force=True`` re-measures). Sweeps sharing one store claim each candidate
before measuring it (``Store.claim``): one that another sweep holds is left for later, then taken from the store
once that sweep stored it, or measured here if its claim expires (a dead or stuck sweep). A sweep can be one shard of
a larger one (``shard``), and can spread its cases over several GPUs (``devices``: one worker process per GPU), with
the splitting of ``tiered_ops.shards``.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Iterable

import pandas as pd
import torch

from ..decide.choice import GATED_LAST, gate_in_turn
from ..measure import recheck
from ..measure.case import EdgeGates
from ..measure.fingerprint import Fingerprint, fingerprint
from ..measure.measure import PRUNE_FACTOR, base_row, measure
from ..measure.meta import breaks_str, stored_or_collect, with_progress
from ..measure.timing import copy_bandwidth_gbps
from ..measure.verdict import gate_row
from ..measure.worker import Pool
from ..registry import DTYPE_NAMES, MODES, Impl, OpSpec, Problem, Tier
from ..store.rows import UNAVAILABLE, contended, prune_bar, waits_for_gate
from ..store.store import COLUMN_NAMES, Store
from .shards import in_shard, spread

CLAIM_POLL_S = 0.5  # how often a sweep looks again at candidates another sweep holds


def _fresh(store: Store, spec: OpSpec, problem: Problem, dtype: torch.dtype, device_key: str, mode: str,
           since: float = -math.inf, busy_since: float = math.inf, waiting: bool = False, **where: str) -> dict:
    """The newest fresh row per implementation of one case (taken at ``since`` or later); ``where``: more columns.
    A row timed on a busy machine (contended) counts only when taken at ``busy_since`` or later: by a sweep that
    ran beside this one, whose busy machine was likely the two sweeps; an older one is measured again. A row timed
    without its gate that no choice has looked at yet (``rows.waits_for_gate``: a run stopped between the timing and
    the gates) is measured again unless ``waiting``; one a choice passed over (never chosen) counts."""
    rows = store.rows(op=spec.name, problem=str(problem), dtype=DTYPE_NAMES[dtype], device_key=device_key, mode=mode,
                      **where)
    out: dict[str, dict] = {}
    for r in rows:  # ordered by id: the last fresh row per implementation wins
        if spec.fresh_impl(r) is not None and r["timestamp"] >= since and (waiting or not waits_for_gate(r)) and (
                not contended(r) or r["timestamp"] >= busy_since):
            out[r["impl"]] = r
    return out


def _kept_peer_row(store: Store, spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device_key: str,
                   mode: str) -> dict | None:
    """A peer's newest row of a case measured where it was installed: a sweep on a machine without it keeps that row
    rather than storing a newer "not installed" one over it."""
    rows = store.rows(op=spec.name, problem=str(problem), dtype=DTYPE_NAMES[dtype], device_key=device_key, mode=mode,
                      impl=impl.name)
    kept = [r for r in rows if not str(r.get("reason") or "").startswith(UNAVAILABLE)]
    return kept[-1] if kept else None


# The choices a sweep's report shows: where one of them would name a candidate timed without its gate, the gate runs.
GATED_FOR = ("fastest", "cost-aware", "cold-start")


def _meta(store: Store, spec: OpSpec, impl: Impl, device: torch.device, fp: Fingerprint, pool: Pool | None) -> dict:
    def in_worker() -> dict:
        meta, why = pool.run(("meta", spec.name, impl.name), f"cost metadata of {spec.name} {impl.name}")
        return {"error": f"collecting it crashed or hung: {why}"} if why else meta

    return stored_or_collect(store, spec, impl, device, fp.key, in_worker if pool is not None else None)


def sweep(specs: Iterable[OpSpec], problems: dict[str, list[Problem]], dtypes: list[torch.dtype],
          device: torch.device, store: Store, shard: tuple[int, int] | None = None,
          devices: list[torch.device] | None = None, **kw: Any) -> pd.DataFrame:
    """Measure every (op, problem, dtype, mode, implementation); returns one row per measurement.
    ``problems[op]`` are measured in every dtype of ``dtypes``; ``shard`` (i, n): only the cases of shard i of n
    (``shards.in_shard``); ``devices``: spread the cases over these GPUs (``sweep_devices``) instead of ``device``;
    the other keywords are those of :func:`sweep_cases`."""
    if store.kept_in_memory is not None:  # a store that cannot be written: every measurement would be lost
        raise ValueError(f"store: {store.kept_in_memory}; a sweep would save none of its measurements (give a "
                         "writable --db or TIERED_OPS_DB)")
    cases = [(s, p, dt) for s in specs for p in problems[s.name] for dt in dtypes]
    if shard is not None:
        cases = in_shard(cases, shard)
    if devices and len(devices) > 1:
        return sweep_devices(cases, devices, store, **kw)
    return sweep_cases(cases, devices[0] if devices else device, store, **kw)


def sweep_devices(cases: list[tuple[OpSpec, Problem, torch.dtype]], devices: list[torch.device], store: Store,
                  log: Callable[[str], None] = print, metas: dict[tuple[str, str], dict] | None = None,
                  **kw: Any) -> pd.DataFrame:
    """The cases dealt over ``devices`` (``shards.spread``), each device's share swept by a thread of its own with
    its own isolated worker process and its own connection to the store (a file or a server: claims keep two devices
    from measuring one candidate twice). Ctrl-C stops every device after the candidate it is measuring."""
    if not kw.get("isolate", False):
        raise ValueError("devices: a sweep over several devices measures in one worker process per device: pass "
                         "isolate=True (threads measuring in this process would share its interpreter)")
    if store.url is None and store.kept_in_memory is not None:
        raise ValueError(f"devices: the store {store.path} is kept in memory; several devices need a store file "
                         "or server they can each open")
    stop, results, errors = threading.Event(), {}, []
    shares = spread(cases, len(devices))
    metas_of: dict[int, dict] = {k: {} for k in range(len(devices))}

    def run(k: int) -> None:
        mine = Store(store.url or store.path)

        def say(text: str) -> None:
            log(f"[{devices[k]}] {text}")

        try:
            results[k] = sweep_cases(shares[k], devices[k], mine, log=say, metas=metas_of[k], stop=stop,
                                     **dict(kw, progress=False))
        except BaseException as e:  # reported by the caller's thread
            errors.append(e)
            stop.set()
        finally:
            mine.close()

    threads = [threading.Thread(target=run, args=(k,), name=f"sweep-{d}") for k, d in enumerate(devices)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        stop.set()
        for t in threads:
            t.join()
        raise
    real = [e for e in errors if not isinstance(e, KeyboardInterrupt)]
    if errors:
        raise (real or errors)[0]
    if metas is not None:
        for m in metas_of.values():
            metas.update(m)
    frames = [results[k] for k in range(len(devices)) if len(results.get(k, ()))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def sweep_cases(cases: list[tuple[OpSpec, Problem, torch.dtype]], device: torch.device, store: Store,
                force: bool = False, progress: bool = True, log: Callable[[str], None] = print,
                metas: dict[tuple[str, str], dict] | None = None, modes: Iterable[str] = MODES,
                isolate: bool = False, timeout_s: float = 300.0, impls: Iterable[str] | None = None,
                cost_metadata: bool = True, stop: threading.Event | None = None,
                prune: float | None = PRUNE_FACTOR, gate_all: bool = False) -> pd.DataFrame:
    """Measure every implementation of each (op, problem, dtype) case in each mode; one row per measurement.

    With ``isolate`` each candidate runs in a worker process (``tiered_ops.worker``): one that crashes or
    runs past ``timeout_s`` seconds is stored as failed with the reason, and the sweep goes on with a new
    worker (the CLI isolates by default). One worker serves every case, so each implementation's edge-case gate
    and compilation caches are paid once. The worker imports the ops by module, so an op or implementation
    added at run time (a test's monkeypatch) is only seen in-process. Each measurement is committed as soon
    as it is taken; one already stored for this source and device is reused unless ``force``.
    After the measurements, each implementation's cost metadata (graph breaks, LOC, build seconds,
    registers) is collected once per source and device, stored, and put in ``metas`` when given.
    ``impls`` limits the sweep to implementations of those names; ``cost_metadata=False`` skips the metadata.
    ``stop``: when set (by another thread), the sweep stops before its next candidate as if interrupted.
    ``prune`` (successive halving): once a case (op, problem, dtype, mode) has a fully timed implementation of ours,
    each further candidate is gated as always, then timed briefly, and one whose short timing's p20 lies above
    ``prune`` x the fastest full timing's p80 is stored with that figure and the reason ``pruned: ...`` instead of
    being timed in full (it cannot win: its range lies above the winner's). ``None`` times every candidate in full.
    A row another sweep stored as contended while this one ran is taken as it is, not measured again at once: the
    busy machine was likely the two sweeps (an idle rerun measures it again).
    The Triton and compile tiers (``choice.GATED_LAST``) are timed before their gate, unless ``gate_all``: once a
    case's candidates are all stored, the gate runs for each of them that a choice (``GATED_FOR``) would name if it
    were correct, the next in line where one fails; the others are stored as never chosen (not gated). Their gates
    compile a kernel per edge problem, most of the sweep's compilation, for candidates no choice takes.
    On a GPU, a case whose fastest rows are launch-bound has its correct rows' host times taken again side by side
    (``measure.recheck``), stored as new rows.
    """
    from ..progress import Progress

    specs = list({s.name: s for s, _, _ in cases}.values())
    modes = list(modes)
    only = set(impls) if impls is not None else None
    if only is not None:
        unknown = only - {i for s in specs for i in s.impls}
        if unknown:
            raise ValueError(f"impls: no implementation named {', '.join(sorted(unknown))} in "
                             f"{', '.join(s.name for s in specs)}")

    def chosen(spec: OpSpec) -> list[Impl]:
        return [i for i in spec.impls.values() if only is None or i.name in only]

    todo = [(s, p, dt, m, i) for s, p, dt in cases for m in modes for i in chosen(s)]
    say = Progress.write if progress else log
    wall_start = time.time()
    pool = Pool(device, sorted({s.reference.__module__ for s in specs}), timeout_s, log=say) if isolate else None
    try:
        if pool is not None:
            info = pool.hello()
            fp, copy = info["fingerprint"], info["copy_gbps"]
        else:
            fp, copy = fingerprint(device), copy_bandwidth_gbps(device)
        log(f"device: {fp.name}; copy bandwidth {copy:.0f} GB/s (read + write, measured now); "
            + (f"each candidate in a worker process, {timeout_s:g} s at most" if pool else "measuring in-process"))
        if device.type == "cpu":
            log("no GPU: benchmarking on the CPU (eager vs compile timed; Triton runs on the interpreter for "
                "correctness only; CUDA unavailable)")
        measured, broken, started, busy = 0, {}, time.perf_counter(), 0
        # a claim outlives the longest a candidate may take; with force, a row another sweep took after this one
        # started counts as done
        ttl, since = 2 * timeout_s + 60, time.time() if force else -math.inf
        # a contended row taken since this sweep started is from a sweep running beside it
        busy_since = wall_start
        shared_busy = 0  # contended rows another sweep stored while this one ran, taken as they are
        peers_kept: set[str] = set()  # peers not installed here whose earlier rows are kept
        edge_gates: dict[tuple, EdgeGates] = {}  # each case's edge gates: the store read once for its candidates

        def edges_of(spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str) -> EdgeGates:
            case = (spec.name, str(problem), dtype, mode)
            if case not in edge_gates:
                edge_gates[case] = EdgeGates(store, spec, dtype, device, mode, fp)
            return edge_gates[case]

        def take(spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str, impl: Impl,
                 bar: tuple[float, str] | None = None, waited: bool = False) -> tuple[dict | None, bool]:
            """(row, measured here) under this sweep's claim; (None, False) while another sweep holds it. ``waited``:
            another sweep held it earlier, so a contended row it stored since is taken as it is."""
            absent = impl.why_not(device, dtype) if impl.tier == Tier.PEER else None
            kept = _kept_peer_row(store, spec, impl, problem, dtype, fp.key, mode) if absent else None
            if kept is not None:  # measured where the peer was installed: kept, not measured over
                if impl.name not in peers_kept:
                    peers_kept.add(impl.name)
                    say(f"{impl.name}: {absent}; its rows stored where it was installed are kept, not measured again")
                return kept, False
            key = (spec.name, impl.name, str(problem), DTYPE_NAMES[dtype], mode, fp.key, impl.source_hash)
            if not store.claim(key, ttl):
                return None, False
            try:
                done = _fresh(store, spec, problem, dtype, fp.key, mode, since, -math.inf if waited else busy_since,
                              impl=impl.name).get(impl.name)
                if done is not None:  # another sweep stored it between our look and our claim
                    return done, False
                what = f"{spec.name} {impl.name} {problem} {DTYPE_NAMES[dtype]} {mode}"
                kw: dict[str, Any] = dict(prune_above_us=bar[0], best=bar[1]) if bar is not None else {}
                if not gate_all and impl.tier in GATED_LAST:
                    kw.update(gated=False, gate_first=False)  # gated in ``settle`` where a choice would name it
                edges = edges_of(spec, problem, dtype, mode).known(impl)  # a pass recorded earlier: not checked again
                if edges is not None:
                    kw["edges"] = edges
                if pool is None:
                    done = measure(spec, impl, problem, dtype, device, mode, **kw)
                else:
                    task = ("measure", spec.name, impl.name, problem, DTYPE_NAMES[dtype], mode) + ((kw,) if kw else ())
                    done, why = pool.run(task, what)
                    if why:
                        done = dict(base_row(spec, impl, problem, dtype, mode, fp), reason=f"crashed or hung: {why}")
                        broken[(spec.name, impl.name)] = why
                store.add([edges_of(spec, problem, dtype, mode).keep(impl, done)])
                if contended(done):
                    say(f"{what}: {done['reason']}: stored, excluded from decisions")
                return done, True
            finally:
                store.release(key)

        def settle(spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str) -> None:
            """Gate each candidate of the case timed without its gate that a choice would name, in turn; store the
            rest as never chosen (``choice.gate_in_turn``)."""

            def run_gate(impl: Impl, row: dict, _named_by: str, _waiting: dict) -> bool:
                nonlocal gates
                edges = edges_of(spec, problem, dtype, mode).known(impl)
                if pool is None:
                    done = gate_row(spec, impl, problem, dtype, device, mode, dict(row), edges)
                else:
                    what = f"{spec.name} {impl.name} {problem} {DTYPE_NAMES[dtype]} {mode} gate"
                    done, why = pool.run(("gate", spec.name, impl.name, problem, DTYPE_NAMES[dtype], mode, row, edges),
                                         what)
                    if why:
                        done = dict(row, ok=0, reason=f"gate crashed or hung: {why}")
                        broken[(spec.name, impl.name)] = why
                store.add([edges_of(spec, problem, dtype, mode).keep(impl, dict(done, timestamp=time.time()))])
                gates += 1
                return True

            if not gate_all:
                gate_in_turn(spec, lambda: list(_fresh(store, spec, problem, dtype, fp.key, mode, busy_since=busy_since,
                                                       waiting=True).values()),
                             run_gate, lambda r: store.add([r]), dtype, device, store, GATED_FOR)

        def settled(case: tuple) -> None:
            """``settle`` the case, then this sweep's rows of it replaced by the newest (gated, or never chosen)."""
            spec, problem, dtype, mode, _ = todo[index_of[case][0]]
            settle(spec, problem, dtype, mode)
            newest = _fresh(store, spec, problem, dtype, fp.key, mode, waiting=True)
            what = f"{spec.name} {problem} {DTYPE_NAMES[dtype]} {mode}"
            run = None if pool is None else lambda names: pool.run(
                ("host", spec.name, names, problem, DTYPE_NAMES[dtype], mode), f"{what} host side by side")
            new, why = recheck.retime(spec, list(newest.values()), problem, dtype, device, mode, run)
            if why:
                say(f"{what}: host side by side {why}: rows kept as timed")
            if new:  # launch-bound: the case's host times taken again side by side
                store.add(new)
                if any(waits_for_gate(r) for r in new):  # un-pruned by the rounds: gated where a choice names it
                    settle(spec, problem, dtype, mode)
                newest = _fresh(store, spec, problem, dtype, fp.key, mode, waiting=True)
            for k in index_of[case]:
                if results[k] is not None and todo[k][4].name in newest:
                    results[k] = newest[todo[k][4].name]

        gates = 0
        index_of: dict[tuple, list[int]] = {}  # the candidates of each (op, problem, dtype, mode), in sweep order
        for n, (spec, problem, dtype, mode, _) in enumerate(todo):
            index_of.setdefault((spec.name, str(problem), dtype, mode), []).append(n)
        results: list[dict | None] = [None] * len(todo)
        waiting: list[int] = []  # candidates another sweep holds
        fresh: dict[tuple, dict] = {}  # one store query per (op, problem, dtype, mode), not per implementation
        of_case: dict[tuple, list] = {}  # this sweep's rows per (op, problem, dtype, mode): the pruning bar
        bar = Progress(todo, disable=not progress, unit="meas", dynamic_ncols=True)
        for n, (spec, problem, dtype, mode, impl) in enumerate(bar):
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            bar.set_description(f"{spec.name} {impl.name} {problem} {DTYPE_NAMES[dtype]} {mode}")
            case = (spec.name, str(problem), dtype, mode)
            if case not in edge_gates:
                edge_gates.clear()  # as ``fresh``: only the current case's are needed
            if not force and case not in fresh:
                fresh.clear()  # cases come in order: only the current one is needed
                fresh[case] = _fresh(store, spec, problem, dtype, fp.key, mode, busy_since=busy_since)
            done = None if force else fresh[case].get(impl.name)
            if done is not None and contended(done):
                shared_busy += 1
            if done is None:
                done, now = take(spec, problem, dtype, mode, impl, prune_bar(of_case.get(case, ()), prune))
                if done is not None and not now and contended(done):
                    shared_busy += 1
                measured, busy = measured + now, busy + (now and contended(done))
                if now and not progress and measured % 50 == 0:
                    log(f"{measured} measured ({n + 1} of {len(todo)} looked at, "
                        f"{time.perf_counter() - started:.0f} s)")
                if done is None:
                    waiting.append(n)
            results[n] = done
            of_case.setdefault(case, []).append(done)
            if n == index_of[case][-1]:
                settled(case)
        bar.close()
        claimed = {(todo[n][0].name, str(todo[n][1]), todo[n][2], todo[n][3]) for n in waiting}
        if waiting:
            log(f"{len(waiting)} candidate(s) claimed by another sweep on this store: taking them from the store once "
                "it has stored them, or measuring them here if its claims expire")
        while waiting:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            edge_gates.clear()  # each look at them reads the passes another sweep recorded meanwhile
            for n in list(waiting):
                results[n], now = take(*todo[n], waited=True)
                if results[n] is not None and not now and contended(results[n]):
                    shared_busy += 1
                measured, busy = measured + now, busy + (now and contended(results[n]))
                if results[n] is not None:
                    waiting.remove(n)
            if waiting:
                time.sleep(CLAIM_POLL_S)
        edge_gates.clear()
        for case in claimed:  # their rows are all stored now
            settled(case)
        for spec, impl in with_progress([(s, i) for s in specs if cost_metadata for i in chosen(s)], progress):
            if (spec.name, impl.name) in broken:  # it would crash or hang again
                why = broken[spec.name, impl.name]
                meta = {"error": f"not collected: the implementation crashed or hung ({why})"}
            else:
                meta = _meta(store, spec, impl, device, fp, pool)
            if metas is not None:
                metas[(spec.name, impl.name)] = meta
    finally:
        if pool is not None:
            pool.close()
    log(f"{measured} measured now, {len(results) - measured} taken from the store (same source, same device)"
        + (f"; {gates} gate(s) run after their candidate's timing" if gates else "")
        + (f"; {pool.started} worker process(es) used" if pool else ""))
    if shared_busy:
        log(f"{shared_busy} row(s) another sweep on this store took while the machine was busy (reason 'contended: "
            "...') taken as they are, not measured again beside it: the busy machine was likely the two sweeps; "
            "excluded from every decision; run the same command on an idle machine to measure them again")
    if busy:
        log(f"{busy} measurement(s) taken while the machine was busy (reason 'contended: ...'): stored for the record, "
            "excluded from every decision; run the same command on an idle machine to measure them again")
    df = pd.DataFrame(results)
    if len(df):  # every store column, also one no row filled in (a sweep where no row has a reason)
        df = df.reindex(columns=[*df.columns, *(c for c in COLUMN_NAMES if c not in df.columns)])
    if metas is not None and len(df):
        df["graph_breaks"] = [breaks_str(metas.get((r.op, r.impl), {})) for r in df.itertuples()]
        df["loc"] = [metas.get((r.op, r.impl), {}).get("loc") for r in df.itertuples()]
    return df
