"""tiered-ops: measure every tier of every op, select per shape, report (one subcommand each, below)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

import torch

from .. import envs
from ..analysis import targets
from ..analysis.check import check, live_plan, report
from ..analysis.report import cross, render
from ..analysis.targets import load_spec
from ..decide.decide import select_backend, use_store
from ..measure.fingerprint import fingerprint
from ..measure.meta import breaks_str, stored_or_collect
from ..measure.timing import default_device
from ..registry import DTYPES, MODES
from ..store.store import Store, StoreError
from ..sweep import live
from ..sweep.bench import sweep
from ..sweep.shards import gpu_devices
from ..tiers.catalog import all_ops, get_op
from .args import build_parser, op_kwargs, protect_shapes, shape_problem
from .bench_out import report_and_summary, tables, wrapped
from .decisions import cmd_decisions
from .evidence import archived_note, check_files
from .io import UsageError, out_file, read_results
from .tune import cmd_tune


def _device(arg: str | None) -> torch.device:
    if arg:
        dev = torch.device(arg)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("error: --device cuda asked for, but torch sees no CUDA device")
        return torch.device("cuda", dev.index or 0) if dev.type == "cuda" else dev

    return default_device()


def _every_gpu(args: argparse.Namespace, dev: torch.device) -> list[torch.device] | None:
    """The sweep's devices when neither --gpus nor --device names them: every visible GPU where there are several
    (said on stdout, with how to keep to one), else None (the one device)."""
    if args.device or args.in_process or dev.type != "cuda" or args.shard:
        return None
    visible = torch.cuda.device_count()
    if visible < 2:
        return None
    print(f"{visible} GPUs visible: the cases are spread over all of them, one worker process each, into one store "
          f"(--gpus 1 or --device cuda:N measures on one)")
    return gpu_devices("all")


def _gpu(args: argparse.Namespace, what: str, why: str) -> torch.device | None:
    """The device for a command that measures on a GPU only; None (after saying so) when there is none."""
    dev = _device(args.device)
    if dev.type != "cuda":
        print(f"error: {what} needs a GPU ({why})", file=sys.stderr)
        return None
    return dev


def _store(args: argparse.Namespace) -> Store:
    return Store(args.db)


def cmd_list(args: argparse.Namespace) -> int:
    dev = _device(args.device)
    print(f"device: {dev}")
    specs = all_ops()
    wide = [max(len(x) for x in names) for names in zip(*((s.name, i.name, i.tier.label) for s in specs
                                                          for i in s.impls.values()))]
    for spec in specs:
        for impl in spec.impls.values():
            why = impl.why_not(dev)
            state = "available" if why is None else f"unavailable: {why}"
            if why is None and impl.timeable(dev):
                state += f" (not timeable here: {impl.timeable(dev)})"
            print(f"{spec.name:<{wide[0]}}  {impl.name:<{wide[1]}}  {impl.tier.label:<{wide[2]}}  {state}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib


    for module in args.imports or []:
        importlib.import_module(module)  # registers more ops (tests/plants: planted faulty kernels)
    dev = _device(args.device)
    specs = [get_op(o) for o in args.ops.split(",")] if args.ops else all_ops()
    problems = {s.name: ([shape_problem(s, sh, prm) for sh, prm in args.shapes] if args.shapes
                         else s.default_problems(dev.type)) for s in specs}
    dtypes = args.dtype or ([torch.bfloat16, torch.float32] if dev.type == "cuda" else [torch.float32])

    devices = gpu_devices(args.gpus) if args.gpus else _every_gpu(args, dev)
    if devices and len(devices) > 1 and args.in_process:
        raise ValueError("--gpus: several GPUs are measured in one worker process each; drop --in-process")
    store = _store(args)
    print(f"store: {store.path}")
    metas: dict = {}

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM: stop the workers and say what was kept, as for Ctrl-C

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        df = sweep(specs, problems, dtypes, dev, store, force=args.force, progress=not args.no_progress, metas=metas,
                   modes=args.mode or MODES, isolate=not args.in_process, timeout_s=args.timeout,
                   impls=args.impls.split(",") if args.impls else None, cost_metadata=not args.no_meta,
                   shard=args.shard, devices=devices, gate_all=args.gate_all, log=wrapped)
    except KeyboardInterrupt:
        print(f"\ninterrupted: every finished measurement is in {store.path}; the same command resumes",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.csv, index=False)
        print(f"wrote {len(df)} rows to {args.csv}")
    if args.tables:
        tables(df, specs, metas)
    report_and_summary(df, metas, args, Path(args.out) if args.out else envs.report_dir() / fingerprint(dev).slug,
                       store.path)
    return 0


def cmd_select(args: argparse.Namespace) -> int:

    params = op_kwargs(args.op, args)  # before anything runs
    store = use_store(_store(args))
    calls = args.calls if args.calls is not None or not args.policy else envs.calls()
    sel = select_backend(args.op, args.shape, args.dtype, _device(args.device), tune=False if args.no_tune else None,
                         policy=args.policy, calls=calls, mode=args.mode, context=args.context,
                         budget=args.budget, **params)
    print(f"{args.op} {'x'.join(map(str, args.shape))} {args.dtype} {args.mode} {args.context} "
          f"[{sel.record['policy']}]: {sel.name} "
          f"({sel.tier.label}) - {sel.record['reason']}")
    if args.json:
        print(json.dumps(sel.record, indent=2, default=str))
    else:
        for c in sel.record["candidates"]:
            us = "-" if c["caller_us"] is None else f"{c['caller_us']:.1f} us"
            fig = "" if c.get("policy_figure") is None else f" judged by {c['policy_figure']:.4g}"
            print(f"  {c['impl']:<14} {c['tier']:<8} {us:>12}  ok={c['ok']} fresh={c['fresh']}{fig}  "
                  f"{c['reason'] or ''}")
    if not store.writable and store.unsaved:
        print(f"nothing was saved: {store.unsaved} new measurement(s) kept in memory only ({store.kept_in_memory})",
              file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:

    spec, dev, store = get_op(args.op), _device(args.device), _store(args)
    fp = fingerprint(dev)
    print(f"{spec.name} on {fp.name} (torch {fp.torch}, triton {fp.triton}, cuda {fp.cuda})")
    for impl in spec.impls.values():
        m = stored_or_collect(store, spec, impl, dev)
        if args.json:
            print(json.dumps({"impl": impl.name, **m}, indent=2, default=str))
            continue
        gb = m.get("graph_breaks") or {}
        print(f"\n{impl.name} [{impl.tier.label}]  source {impl.source_hash}")
        print(f"  lines of code (own kernel + launcher + binding): {m['loc']}")
        print(f"  graph breaks through the op / unregistered contrast: {breaks_str(m)}")
        for label in ("registered", "unregistered"):
            d = gb.get(label)
            if d and (d.get("reasons") or d.get("error")):
                print(f"    {label}: {'; '.join(d.get('reasons') or []) or d.get('error')}")
        if gb.get("error"):
            print(f"    {gb['error']}")
        if "recompiles" in m:
            r = m["recompiles"]
            print(f"  recompiles over {len(r['shapes'])} shapes of one bucket: {r['static']} with dynamic=False "
                  f"(used), {r['dynamic']} with dynamic=True")
        if "build_s_extension" in m:
            print(f"  build: {m.get('build_s_own')} s for its object, {m['build_s_extension']} s whole extension")
        if "max_registers" in m:
            print(f"  kernels: {m['kernels']} compiled, max {m['max_registers']} registers, {m['spill_bytes']} bytes "
                  f"spilled, max {m['max_smem_bytes']} bytes shared memory")
        elif m.get("kernels_error"):
            print(f"  kernels: {m['kernels_error']}")
        print(f"  portability: {m['portability']}" + (f"; built for {m['archs']}" if m.get("archs") else ""))
        rows = [r for r in store.rows(op=spec.name, impl=impl.name, device_key=fp.key, ok=1)
                if r["source_hash"] == impl.source_hash]
        if rows:
            r, firsts = rows[-1], sorted(x["first_call_s"] for x in rows if x["first_call_s"] is not None)
            print(f"  last verified: {r['gpu_name']}, torch {r['torch_version']}, triton {r['triton_version']}, "
                  f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(r['timestamp']))} UTC; first call "
                  f"{firsts[0]:.3f}-{firsts[-1]:.3f} s over {len(rows)} shapes/dtypes")
        else:
            print("  last verified: never on this device with this source")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import pandas as pd


    if args.live:

        dev = _gpu(args, "check --live", "the CUDA tier runs nowhere else")
        if dev is None:
            return 2
        specs = [s for s in all_ops() if any(i.tier.label == "cuda" for i in s.impls.values())]
        problems, dtypes, modes = live_plan(specs)  # the default problems inside the held territories
        store = _store(args)
        sweep([s for s in specs if s.name in problems], problems, args.dtype or [DTYPES[d] for d in dtypes],
              dev, store, progress=not args.no_progress, modes=args.mode or modes, isolate=True)
        df = pd.DataFrame(store.rows(device_key=fingerprint(dev).key))
    else:
        return check_files(args)
    findings = check(df)
    print(report(findings))
    return 1 if any(f.fails for f in findings) else 0


def cmd_report(args: argparse.Namespace) -> int:

    if args.targets and not args.targets_spec:
        print("error: report --targets DIR needs --targets-spec FILE (the speed targets, e.g. benchmarks/targets.json)",
              file=sys.stderr)
        return 2
    read_results(args.results + (args.repeat or []))  # each file checked before anything is written
    rendered_by = "tiered-ops report " + " ".join(args.argv)
    files = render(args.results, args.out, args.meta, args.command or "not recorded", rendered_by.strip(),
                   write_csv=not args.no_csv,
                   repeat=args.repeat, targets=_read_targets(args.targets) if args.targets else None,
                   targets_spec=load_spec(args.targets_spec) if args.targets_spec else None,
                   archived=archived_note(args.results[0]))
    for f in files:
        print(f"wrote {f}")
    return 0


def _read_targets(folder: str | None) -> dict:
    import pandas as pd

    out = {}
    for name in ("grid", "picks", "dispatch"):
        f = Path(folder) / f"{name}.csv" if folder else None
        out[name] = pd.read_csv(f) if f is not None and f.exists() else None
    return out


def cmd_targets(args: argparse.Namespace) -> int:
    spec = targets.load_spec(args.spec) if args.spec else None
    points = live.load_grid(args.grid) if args.grid else None
    if args.live:
        dev = _gpu(args, "targets --live", "the targets are GPU figures")
        if dev is None:
            return 2
        main_db = args.db or envs.db()
        if not main_db or not Path(main_db).exists():
            print("error: targets --live decides from the default sweep's store: pass --db (or set TIERED_OPS_DB) "
                  "to a store the bench filled", file=sys.stderr)
            return 2
        disp = targets.target(spec, "dispatch")
        if points is None and disp is None:
            print("error: targets --live measures the grid of --grid FILE and the dispatch cost of --spec FILE's "
                  "dispatch target: give at least one", file=sys.stderr)
            return 2
        if not args.out_dir:
            print("error: targets --live needs --out-dir (where grid.csv, picks.csv and dispatch.csv go)",
                  file=sys.stderr)
            return 2
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)

        # The quick part first (dispatch cost), then the grid, exported even when interrupted: what finished counts.
        if disp is not None:
            live.live_dispatch(dev, main_db, disp["shapes"], disp["dtypes"]).to_csv(out / "dispatch.csv",
                                                                                       index=False)
            print(f"wrote {out}/dispatch.csv")
        if points is not None:
            try:
                live.live_grid(dev, main_db, str(out / "grid.sqlite"), points, timeout_s=args.timeout,
                               picks_csv=str(out / "picks.csv"), tuned_db=str(out / "tuned.sqlite"))
            except KeyboardInterrupt:
                print("grid interrupted: the points measured so far are kept")
            finally:
                wrote = live.export_grid(out, points)
            print(f"wrote {', '.join(f'{out}/{name}' for name in ('picks.csv', *wrote))}")
        args.results = args.results or []
    t = _read_targets(args.out_dir)
    results = read_results(args.results) if args.results else None
    if results is None and t["grid"] is None:
        if args.live:  # the dispatch cost alone: measured and written
            return 0
        print("error: targets needs --results (and/or --live / --out-dir with grid.csv)", file=sys.stderr)
        return 2
    if t["grid"] is not None and t["picks"] is not None:
        reg = targets.target(spec, "regret")
        for mode in dict.fromkeys(t["picks"]["mode"] if "mode" in t["picks"] else ["fwd_nograd"]):
            both = "tuned" in t["picks"]
            for tuned in (True, False) if both else (False,):
                n, geo, worst = targets.regret_summary(t["grid"], t["picks"], mode, tuned=tuned)
                bar = f" (targets {reg['geomean_at_most']:.2f} / {reg['max_at_most']:.2f})" if reg and \
                    reg["mode"] == mode and tuned == both else ""  # the targets judge the tuned picks where measured
                print(f"selection regret with tuning {'on' if tuned else 'off'} over {n} grid points ({mode}): "
                      f"geomean {geo:.3f}, max {worst:.3f}{bar}")
    if results is not None:
        if spec is None:
            print("error: rendering the targets needs --spec FILE (e.g. benchmarks/targets.json)", file=sys.stderr)
            return 2
        print(targets.render(results, spec, t["grid"], t["picks"], t["dispatch"]))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    frames = {Path(f).parent.name: read_results([f]) for f in args.results}
    out_file(args.out, "--out")
    if len(frames) < 2:
        print("error: compare needs results of at least two GPUs (reports/<gpu>/results.csv each)", file=sys.stderr)
        return 2
    archived = {Path(f).parent.name: a for f in args.results if (a := archived_note(f))}
    text = cross(frames, "tiered-ops compare " + " ".join(args.argv), archived)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import pandas as pd

    out_file(args.csv, "--csv")
    if args.meta:
        out_file(args.meta, "--meta")
    store = _store(args)
    df = pd.DataFrame(store.rows(context=args.context))
    df.to_csv(args.csv, index=False)
    print(f"wrote {len(df)} measurements from {store.path} to {args.csv}")
    if args.meta:
        rows = store.meta_rows()
        with open(args.meta, "w") as f:
            for r in rows:
                f.write(json.dumps(dict({k: r[k] for k in ("op", "impl", "device_key", "source_hash", "timestamp")},
                                        **r["meta"])) + "\n")
        print(f"wrote cost metadata of {len(rows)} implementations to {args.meta}")
    return 0


COMMANDS = {"list": cmd_list, "bench": cmd_bench, "select": cmd_select, "info": cmd_info, "check": cmd_check,
            "report": cmd_report, "targets": cmd_targets, "compare": cmd_compare, "export": cmd_export,
            "decisions": cmd_decisions, "tune": cmd_tune}


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(protect_shapes(raw))
    args.argv = raw[raw.index(args.cmd) + 1:]  # what followed the subcommand (named by report and compare)
    lib = logging.getLogger("tiered_ops")  # the library's progress and notes, on stderr
    handler, level = logging.StreamHandler(sys.stderr), lib.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    lib.addHandler(handler)
    lib.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return COMMANDS[args.cmd](args)
    except (ValueError, IndexError, TypeError, UsageError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"error: {e.filename}: {e.strerror}; check the path", file=sys.stderr)
        return 2
    finally:
        lib.removeHandler(handler)
        lib.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
