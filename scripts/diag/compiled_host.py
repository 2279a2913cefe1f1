"""Where a compiled model step's time goes when the patched model's step is slower than stock's though both trace the
same decompositions: each variant in a process of its own (built, patched, compiled, tuned and warmed as
``benchmarks/compiled_worker.py`` does), then, with the calling thread pinned to one CPU:

- the step's median time (CUDA events; 200 calls) and the host's time to issue it (no synchronization inside);
- one profiler window of 20 steps: CUDA kernels, graph launches, copies and runtime calls per step, the GPU time of
  the kernels per step;
- cProfile of 200 steps: the Python functions with the most own time per step;
- what else lives in the process: its threads, child processes, tracked objects, and the CPU time each of its threads
  and each CPU of the machine spent during the timed calls (an idle thread of the process's own, or a busy sibling of
  the calling thread's CPU, slows every function of the step alike);
- the host's time with the garbage collector off and the live objects frozen, between two timings as it is; what
  can slow every call alike (trace, profile and monitoring hooks, torch modes, forced dispatch keys, dynamo's frame
  callback, global module hooks);
- Inductor's generated modules (``PyCodeCache``): a digest of each one's source, so two variants' graphs can be
  compared, and the sources themselves under ``--out``.

    python scripts/diag/compiled_host.py --config qwen3-4b-dims-2l --mode reduce-overhead --workload decode \\
        --variants stock,tiered --out /tmp/ch          # GPU
    TIERED_OPS_DB=/tmp/ch.sqlite python scripts/diag/compiled_host.py --config qwen3-tiny --quick --mode default \\
        --workload decode --variants stock,tiered --out /tmp/ch --reps 20     # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import hashlib
import json
import logging
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from scripts.diag.guard_count import guard_lines  # noqa: E402


def one(args: argparse.Namespace, variant: str) -> dict:
    from benchmarks.compiled_models import configs
    from benchmarks.compiled_worker import Runner, children
    from benchmarks.models_rows import timed

    cfg = configs(args.quick)[args.config]
    if variant == "stock-import":  # stock's model in a process that imported tiered_ops and loaded its extension
        import tiered_ops
        from tiered_ops.tiers import cuda_ext

        out_ext = cuda_ext.load_if_built(torch.device("cuda")) if torch.cuda.is_available() else False
        logging.getLogger(__name__).info("tiered_ops %s imported; extension loaded: %s", tiered_ops.__name__, out_ext)
    shape = (cfg["batch"], 1) if args.workload == "decode" else (1, cfg["seq"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = dict(config=cfg, dtype=cfg["dtype"], mode=args.mode, workload=args.workload, variant=variant, shape=shape,
                device=device, backend="inductor", warmup=20, settle_s=120.0, carried=False, fail="",
                timing_cpu=args.cpu)
    r = Runner(spec)
    first = r.compile()
    r.warm()
    cuda = device == "cuda"
    fn = r.fn
    out: dict = dict(variant=variant, breaks=first["graph_breaks"], graphs=first["graphs"], note=first.get("note"))
    out["ms"] = statistics.median(timed(fn, args.reps, cuda))
    if cuda:
        torch.cuda.synchronize()
    host = []
    before_threads, before_cpus, t_window = thread_ticks(), cpu_ticks(), time.perf_counter()
    for _ in range(args.reps):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        if cuda:
            torch.cuda.synchronize()
    out["host_ms"] = statistics.median(host)
    out["busy"] = busy(before_threads, before_cpus, time.perf_counter() - t_window, main=threading.get_native_id())
    out["host_ab"] = host_ab(fn, args.reps, cuda)
    out["hooks"] = hooks()
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        steps = 20
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
        kinds: dict[str, float] = {}
        gpu_us = 0.0
        for e in prof.key_averages():
            name = e.key
            if name.startswith(("cuda", "cu")) and e.device_type.name == "CPU":
                kinds[name] = e.count / steps
            if e.device_type.name == "CUDA":
                gpu_us += e.self_device_time_total
                kinds["kernels"] = kinds.get("kernels", 0) + e.count / steps
        out["per_step"] = dict(sorted(kinds.items()))
        out["gpu_us_per_step"] = gpu_us / steps
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    pr.disable()
    stats = pstats.Stats(pr)
    out["python_calls_per_step"] = stats.total_calls / args.reps  # the same work makes the same calls
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
    out["python_us_per_step"] = [
        dict(fn=f"{Path(k[0]).name}:{k[1]}:{k[2]}", calls=v[1] / args.reps, own_us=v[2] / args.reps * 1e6,
             cum_us=v[3] / args.reps * 1e6) for k, v in top]
    out["threads"] = sorted(t.name for t in threading.enumerate())
    out["tasks"] = len(os.listdir(f"/proc/{os.getpid()}/task")) if Path("/proc/self/task").is_dir() else -1
    out["children"] = children()
    out["gc_objects"] = len(gc.get_objects())
    out["gc_counts"] = gc.get_count()
    out["guard_lines"] = len(guard_lines(type(r.model).forward))  # every cache entry's, checked before each call
    out["placement"] = placement(args.cpu)
    from torch._inductor.codecache import PyCodeCache

    mods = {}
    dest = Path(args.out) / f"code-{variant}"
    dest.mkdir(parents=True, exist_ok=True)
    for m in list(getattr(PyCodeCache, "modules", [])):
        path = getattr(m, "__file__", None)
        if path and Path(path).is_file():
            text = Path(path).read_text()
            digest = hashlib.sha1(text.encode()).hexdigest()[:12]
            mods[Path(path).name] = digest
            (dest / f"{digest}.py").write_text(text)
    out["inductor_modules"] = sorted(mods.values())
    return out


def host_ab(fn, reps: int, cuda: bool) -> dict:
    """The host's time to issue a step (median ms) as it is, with the garbage collector off and every live object
    frozen out of its generations, then as it is again: a process holding many more objects pays for it in the
    collections a step's allocations set off, spread over every function alike."""
    def host() -> float:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
            if cuda:
                torch.cuda.synchronize()
        return round(statistics.median(ts), 4)

    out = {"as_is": host()}
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        out["gc_off_frozen"] = host()
    finally:
        gc.enable()
        gc.unfreeze()
    out["as_is_again"] = host()
    out["gc_counts"] = list(gc.get_count())
    out["gc_threshold"] = list(gc.get_threshold())
    out["gc_collections"] = [s.get("collections") for s in gc.get_stats()]
    return out


def hooks() -> dict:
    """What can make every call of a process slower without more calls: trace and profile functions, monitoring
    tools, the profiler's and anomaly mode's callbacks, torch function and dispatch modes, dispatch keys forced on or
    off for the thread, dynamo's frame callback, global module hooks, intra-op threads, the GIL's switch interval."""
    out: dict = dict(trace=repr(sys.gettrace()), profile=repr(sys.getprofile()),
                     switch_interval=sys.getswitchinterval(), gc_enabled=gc.isenabled(), modules=len(sys.modules),
                     torch_threads=torch.get_num_threads())
    mon = getattr(sys, "monitoring", None)
    if mon is not None:
        out["monitoring_tools"] = {i: mon.get_tool(i) for i in range(6) if mon.get_tool(i)}
    with contextlib.suppress(Exception):
        out["profiler_enabled"] = torch.autograd._profiler_enabled()
    out["anomaly"] = torch.is_anomaly_enabled()
    out["grad"] = torch.is_grad_enabled()
    with contextlib.suppress(Exception):
        from torch.overrides import _get_current_function_mode_stack
        out["function_modes"] = [type(m).__name__ for m in _get_current_function_mode_stack()]
    with contextlib.suppress(Exception):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        out["dispatch_modes"] = [type(m).__name__ for m in _get_current_dispatch_mode_stack()]
    with contextlib.suppress(Exception):
        out["tls_include"] = str(torch._C._dispatch_tls_local_include_set())
        out["tls_exclude"] = str(torch._C._dispatch_tls_local_exclude_set())
    with contextlib.suppress(Exception):
        out["eval_frame_callback"] = repr(torch._C._dynamo.eval_frame.get_eval_frame_callback())
    with contextlib.suppress(Exception):
        from torch.nn.modules import module as m
        out["global_module_hooks"] = sum(len(getattr(m, n)) for n in dir(m) if n.startswith("_global_") and
                                         isinstance(getattr(m, n), dict))
    return out


def placement(cpu: int | None) -> dict:
    """Where the process sits (Linux): the calling CPU's SMT siblings and NUMA node, the CPU each thread last ran on,
    and the process's resident pages per NUMA node (memory first touched on another node than the calling CPU's is
    read across the interconnect by every function alike)."""
    out: dict = {}
    if cpu is None or not Path("/proc/self/numa_maps").exists():
        return out
    top = Path(f"/sys/devices/system/cpu/cpu{cpu}")
    with contextlib.suppress(OSError):
        out["siblings"] = (top / "topology" / "thread_siblings_list").read_text().strip()
    out["node"] = next((d.name for d in top.glob("node*")), None)
    last: dict[int, int] = {}
    for t in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            c = int((t / "stat").read_text().rsplit(")", 1)[1].split()[36])
            last[c] = last.get(c, 0) + 1
    out["threads_last_cpu"] = dict(sorted(last.items()))
    pages: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/numa_maps").read_text().splitlines():
            for f in line.split():
                if f.startswith("N") and "=" in f:
                    k, v = f.split("=", 1)
                    pages[k] = pages.get(k, 0) + int(v)
    out["pages_per_node"] = pages
    return out


def thread_ticks() -> dict[str, int]:
    """``tid name`` -> user + system clock ticks of each thread of this process (Linux; empty elsewhere)."""
    out = {}
    for t in Path("/proc/self/task").glob("*") if Path("/proc/self/task").is_dir() else []:
        try:
            fields = (t / "stat").read_text().rsplit(")", 1)[1].split()
            out[f"{t.name} {(t / 'comm').read_text().strip()}"] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return out


def cpu_ticks() -> dict[str, int]:
    """``cpuN`` -> busy clock ticks (all but idle and iowait) of each CPU of the machine (Linux; empty elsewhere)."""
    out = {}
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            name, *v = line.split()
            if name.startswith("cpu") and name != "cpu":
                n = [int(x) for x in v]
                out[name] = sum(n) - n[3] - n[4]
    except OSError:
        pass
    return out


def busy(threads: dict[str, int], cpus: dict[str, int], seconds: float, main: int) -> dict:
    """The share of ``seconds`` each thread of this process other than ``main`` and each CPU was busy since the
    ``threads`` and ``cpus`` readings (only those above 2 %), and the calling thread's own share."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    now_t, now_c = thread_ticks(), cpu_ticks()
    share = {k: (now_t[k] - v) / hz / seconds for k, v in threads.items() if k in now_t}
    cpu = {k: (now_c[k] - v) / hz / seconds for k, v in cpus.items() if k in now_c}
    own = next((v for k, v in share.items() if k.split()[0] == str(main)), None)
    return dict(seconds=round(seconds, 3), calling_thread=own,
                threads={k: round(v, 3) for k, v in share.items() if v > 0.02 and k.split()[0] != str(main)},
                cpus={k: round(v, 3) for k, v in cpu.items() if v > 0.02})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-4b-dims-2l")
    ap.add_argument("--quick", action="store_true", help="the tiny CPU configs")
    ap.add_argument("--mode", default="reduce-overhead")
    ap.add_argument("--workload", default="decode", choices=("prefill", "decode", "train"))
    ap.add_argument("--variants", default="stock,tiered",
                    help="in order, of stock, stock-copy, stock-import (tiered_ops imported, its extension "
                         "loaded), tiered, tiered-next (after tiered: its store, no tuning)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cpu", type=int, default=None, help="the CPU the calling thread runs on (default: the last)")
    ap.add_argument("--out", default="compiled_host")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu is None and hasattr(os, "sched_getaffinity"):
        args.cpu = max(os.sched_getaffinity(0))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.one:
        res = one(args, args.one)
        (Path(args.out) / f"{args.one}.json").write_text(json.dumps(res, indent=1))
        return
    results = []
    for v in args.variants.split(","):
        env = dict(os.environ)
        if v.startswith("tiered"):  # tiered-next: patched in a process that reads what tiered tuned (run it after)
            env["TIERED_OPS_DB"] = str(Path(args.out).resolve() / "tiered.sqlite")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", v]
        t = time.time()
        p = subprocess.run(cmd, env=env)
        path = Path(args.out) / f"{v}.json"
        if p.returncode or not path.is_file():
            print(f"{v}: failed (exit {p.returncode})")
            continue
        res = json.loads(path.read_text())
        results.append(res)
        print(f"== {v} ({time.time() - t:.0f} s): {res['ms']:.3f} ms per step, host {res['host_ms']:.3f} ms, "
              f"GPU {res.get('gpu_us_per_step', 0):.0f} us; breaks {res['breaks']} graphs {res['graphs']}; "
              f"{res['tasks']} threads ({', '.join(res['threads'])}), {res['children']} children, "
              f"{res['gc_objects']} objects, {res['python_calls_per_step']:.0f} Python calls a step; "
              f"note {res['note']}")
        print(f"   per step: {res.get('per_step')}")
        print(f"   busy while timed: {res.get('busy')}; guard lines: {res.get('guard_lines')}")
        print(f"   placement: {res.get('placement')}")
        print(f"   host A/B: {res.get('host_ab')}")
        print(f"   hooks: {res.get('hooks')}")
        for f in res["python_us_per_step"]:
            print(f"   {f['own_us']:8.1f} us own {f['cum_us']:8.1f} cum {f['calls']:6.1f} calls  {f['fn']}")
    if len(results) > 1:
        a, b = (set(r["inductor_modules"]) for r in results[:2])
        print(f"Inductor modules: {len(a)} vs {len(b)}, {len(a & b)} identical; "
              f"only {results[0]['variant']}: {sorted(a - b)}; only {results[1]['variant']}: {sorted(b - a)}")


if __name__ == "__main__":
    main()
