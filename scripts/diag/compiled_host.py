"""Where a compiled model step's time goes when the patched model's step is slower than stock's though both trace the
same decompositions: each variant in a process of its own (built, patched, compiled, tuned and warmed as
``benchmarks/compiled_worker.py`` does), then, with the calling thread pinned to one CPU:

- the step's median time (CUDA events; 200 calls) and the host's time to issue it (no synchronization inside);
- one profiler window of 20 steps: CUDA kernels, graph launches, copies and runtime calls per step, the GPU time of
  the kernels per step;
- cProfile of 200 steps: the Python functions with the most own time per step;
- what else lives in the process: its threads, child processes, tracked objects;
- Inductor's generated modules (``PyCodeCache``): a digest of each one's source, so two variants' graphs can be
  compared, and the sources themselves under ``--out``.

    python scripts/diag/compiled_host.py --config qwen3-4b-dims-2l --mode reduce-overhead --workload decode \\
        --variants stock,tiered --out /tmp/ch          # GPU
    TIERED_OPS_DB=/tmp/ch.sqlite python scripts/diag/compiled_host.py --config qwen3-tiny --quick --mode default \\
        --workload decode --variants stock,tiered --out /tmp/ch --reps 20     # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
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


def one(args: argparse.Namespace, variant: str) -> dict:
    from benchmarks.compiled_models import configs
    from benchmarks.compiled_worker import Runner, children
    from benchmarks.models_rows import timed

    cfg = configs(args.quick)[args.config]
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
    for _ in range(args.reps):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        if cuda:
            torch.cuda.synchronize()
    out["host_ms"] = statistics.median(host)
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
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
    out["python_us_per_step"] = [
        dict(fn=f"{Path(k[0]).name}:{k[1]}:{k[2]}", calls=v[1] / args.reps, own_us=v[2] / args.reps * 1e6,
             cum_us=v[3] / args.reps * 1e6) for k, v in top]
    out["threads"] = sorted(t.name for t in threading.enumerate())
    out["tasks"] = len(os.listdir(f"/proc/{os.getpid()}/task")) if Path("/proc/self/task").is_dir() else -1
    out["children"] = children()
    out["gc_objects"] = len(gc.get_objects())
    out["gc_counts"] = gc.get_count()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-4b-dims-2l")
    ap.add_argument("--quick", action="store_true", help="the tiny CPU configs")
    ap.add_argument("--mode", default="reduce-overhead")
    ap.add_argument("--workload", default="decode", choices=("prefill", "decode", "train"))
    ap.add_argument("--variants", default="stock,tiered")
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
        if v.startswith("tiered"):
            env["TIERED_OPS_DB"] = str(Path(args.out).resolve() / f"{v}.sqlite")
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
              f"{res['gc_objects']} objects; note {res['note']}")
        print(f"   per step: {res.get('per_step')}")
        for f in res["python_us_per_step"]:
            print(f"   {f['own_us']:8.1f} us own {f['cum_us']:8.1f} cum {f['calls']:6.1f} calls  {f['fn']}")
    if len(results) > 1:
        a, b = (set(r["inductor_modules"]) for r in results[:2])
        print(f"Inductor modules: {len(a)} vs {len(b)}, {len(a & b)} identical; "
              f"only {results[0]['variant']}: {sorted(a - b)}; only {results[1]['variant']}: {sorted(b - a)}")


if __name__ == "__main__":
    main()
