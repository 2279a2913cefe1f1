"""Why a patched model under torch.compile(fullgraph=True) is slower than stock: for each (model, workload) asked, the
stock model, the patched one as tuned for the compiled context, and the patched one with every compiled-context
decision forced to the compile tier (the op's eager code traced into the caller's graph), each compiled once; then
dynamo's counters (graphs, breaks, recompiles), the kernels launched per call (torch.profiler, by name, with their
GPU time and where it differs from stock's), the host
time per call, and interleaved timing (median, p20-p80).

    python scripts/diag/compiled_model.py --cases llama-8b-dims-2l:decode,gpt2-small:prefill [--rounds 8 --reps 10]
        [--ops layer_norm] [--stock-copy] [--kernels N] [--timeline CALLS] [--fuse-residual] [--with-fused]
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tiered_ops  # noqa: E402
from benchmarks.models import models, own_compile, peak_mib, spread, step_fn, timed  # noqa: E402
from tiered_ops.decide import decide  # noqa: E402
from tiered_ops.decide.decide import Selection  # noqa: E402


def force_compile_tier() -> int:
    """Every compiled-context decision made so far now names the compile tier; the per-call caches are cleared."""
    n = 0
    for key, sel in list(decide._decisions.items()):
        if key[-1] == "compiled" and sel.impl.tier.label != "compile":
            impl = decide.get_op(sel.record["op"]).impls["compile"]
            decide._decisions[key] = Selection(impl.fn, impl, dict(sel.record, chosen="compile"))
            n += 1
    decide._calls.clear()
    return n


def kernels(fn: Callable[[], Any], calls: int = 10) -> tuple[collections.Counter, dict[str, float]]:
    """Kernel names launched per call, and each name's GPU microseconds per call (torch.profiler over ``calls``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    names: collections.Counter = collections.Counter()
    us: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name[:90]] += 1
            us[e.name[:90]] += e.time_range.elapsed_us() / calls
    return collections.Counter({k: v // calls for k, v in names.items()}), dict(us)


def timeline(fn: Callable[[], Any], calls: int = 20) -> dict[str, float]:
    """Where one call's time goes, medians over ``calls`` (torch.profiler, CPU and GPU on one clock; the GPU idle
    before each call, as the models benchmark's events see it), in us from the call's start: ``host`` until the call
    returns, ``first`` the first kernel's start, ``last_launch`` the last kernel's start, ``end`` the last kernel's end
    (what the benchmark's events measure, less the event's own latency), ``busy`` the GPU's kernel time (union) and
    ``gaps`` its idle time between the first kernel's start and the last one's end."""
    from torch.profiler import ProfilerActivity, profile, record_function

    mark = "tiered_ops_diag_call"
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function(mark):
                fn()
            torch.cuda.synchronize()
    evs = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in evs
                   if e.name == mark and e.device_type == torch.autograd.DeviceType.CPU)
    kern = sorted((e.time_range.start, e.time_range.end) for e in evs
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    per: dict[str, list[float]] = collections.defaultdict(list)
    for i, (s, e) in enumerate(spans):
        nxt = spans[i + 1][0] if i + 1 < len(spans) else float("inf")
        ks = [(a, b) for a, b in kern if s <= a < nxt]
        if not ks:
            continue
        busy, cur_a, cur_b = 0.0, ks[0][0], ks[0][1]
        for a, b in ks[1:]:
            if a > cur_b:
                busy, cur_a, cur_b = busy + cur_b - cur_a, a, b
            else:
                cur_b = max(cur_b, b)
        busy += cur_b - cur_a
        end = max(b for _, b in ks)
        for k, v in (("host", e - s), ("first", ks[0][0] - s), ("last_launch", ks[-1][0] - s), ("end", end - s),
                     ("busy", busy), ("gaps", end - ks[0][0] - busy)):
            per[k].append(v)
    return {k: statistics.median(v) for k, v in per.items()}


def guard_us(compiled: Callable[..., Any], kwargs: dict[str, Any], train: bool, reps: int = 2000) -> str:
    """The compiled caller's guards: their lines, and the microseconds one check of them takes on this host (the
    first cache entry of ``own_compile``'s code, checked with the locals a call of it has, in the call's grad mode)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    orig = compiled._torchdynamo_orig_callable
    entries = _debug_get_cache_entry_list(orig.__code__)
    if not entries:
        return "no cache entry"
    gm = entries[0].guard_manager
    loc = {"args": (), "kwargs": kwargs} | {n: c.cell_contents for n, c in zip(orig.__code__.co_freevars,
                                                                               orig.__closure__ or ())}
    with torch.set_grad_enabled(train):
        if not gm.check(loc):
            return f"{len(entries)} cache entries; the first one's guards do not pass these locals"
        t = time.perf_counter()
        for _ in range(reps):
            gm.check(loc)
        us = (time.perf_counter() - t) / reps * 1e6
    return f"{len(entries)} cache entries; guards: {str(gm).count(chr(10))} lines, {us:.1f} us per check"


def host_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Host time of one call (the caller's Python and launches), the median over ``reps``, not waiting on the GPU."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama-8b-dims-2l:decode,gpt2-small:prefill")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ops", help="comma-separated ops patch swaps in (default: all it can)")
    ap.add_argument("--stock-copy", action="store_true",
                    help="also a deep copy of the stock model, unpatched: what a second copy costs by itself")
    ap.add_argument("--kernels", type=int, default=14, help="kernel names listed per variant")
    ap.add_argument("--fuse-residual", action="store_true", help="patch with fuse_residual=True")
    ap.add_argument("--with-fused", action="store_true",
                    help="also a variant patched with fuse_residual=True beside the one patched as asked")
    ap.add_argument("--timeline", type=int, default=0, metavar="CALLS",
                    help="also where a call's time goes (host, first kernel, GPU busy and idle, end), medians of CALLS")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    from torch._dynamo.utils import counters

    for case in args.cases.split(","):
        name, workload = case.split(":")
        cls, cfg, _ = models(False, args.seq)[name]
        torch.manual_seed(0)
        with torch.device("cuda"):
            base = cls(cfg).to(torch.bfloat16).eval()
        if getattr(base, "loss_type", None) is None:
            base.loss_type = "ForCausalLM"
        train = workload == "train"
        if train:
            base.train()
        ids = torch.randint(0, cfg.vocab_size, (1, 1 if workload == "decode" else args.seq), device="cuda")
        tiered = copy.deepcopy(base)
        patched = tiered_ops.patch(tiered, ops=args.ops.split(",") if args.ops else None,
                                   fuse_residual=args.fuse_residual)
        print(f"== {name} {workload}: {patched}", flush=True)
        kw = dict(input_ids=ids, use_cache=False) | (dict(labels=ids) if train else {})
        rep = tiered_ops.tune(tiered, kw, train=train, context="compiled")
        for c in rep.calls:
            print(f"  decided {c.call.op} {c.call.problem} {c.call.mode}: {c.chosen} ({c.tier}) - {c.reason[:300]}")
        fns: dict[str, Callable[[], Any]] = {}
        variants = [("stock", base)] + ([("stock-copy", copy.deepcopy(base))] if args.stock_copy else [])
        variants.append(("tiered", tiered))
        if args.with_fused:
            fused = copy.deepcopy(base)
            tiered_ops.patch(fused, ops=args.ops.split(",") if args.ops else None, fuse_residual=True)
            tiered_ops.tune(fused, kw, train=train, context="compiled")
            variants.append(("tiered-fused", fused))
        for vname, model in variants + [("tiered-compile-tier", None)]:
            if vname == "tiered-compile-tier":
                print(f"  forced {force_compile_tier()} compiled decisions to the compile tier")
                model = copy.deepcopy(tiered)
            torch._dynamo.reset() if vname == "stock" else None
            counters.clear()
            t0 = time.perf_counter()
            compiled = own_compile(model, vname)
            fn = step_fn(compiled, workload, ids)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            stats = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
            call_kw = dict(input_ids=ids, labels=ids) if train else dict(input_ids=ids)
            call_kw["use_cache"] = False  # the order of step_fn's call: its kwargs are guarded
            print(f"  {vname}: compiled+warm {time.perf_counter() - t0:.1f} s; dynamo {stats}; "
                  f"{guard_us(compiled, call_kw, train)}", flush=True)
            fns[vname] = fn
        samples: dict[str, list[float]] = {v: [] for v in fns}
        order = list(fns)
        for r in range(args.rounds):
            for v in order[r % len(order):] + order[:r % len(order)]:
                samples[v] += timed(fns[v], args.reps, True)
        gpu_us: dict[str, dict[str, float]] = {}
        tl: dict[str, dict[str, float]] = {}
        for v, fn in fns.items():
            p50, p20, p80 = spread(samples[v])
            k, gpu_us[v] = kernels(fn)
            peak = f"; peak {peak_mib(fn, torch.device('cuda'))} MiB" if train else ""
            print(f"  {v:22s} {p50:8.3f} ms ({p20:.3f}-{p80:.3f}); host {host_ms(fn):.3f} ms/call; "
                  f"{sum(k.values())} kernels/call, {sum(gpu_us[v].values()):.1f} us of them on the GPU{peak}")
            if args.timeline:
                tl[v] = timeline(fn, args.timeline)
                figs = ", ".join(f"{k} {x:.1f}" for k, x in tl[v].items())
                print(f"      timeline (us from the call's start): {figs}"
                      + ("" if v == "stock" else "; against stock: " + ", ".join(
                          f"{k} {x - tl['stock'][k]:+.1f}" for k, x in tl[v].items() if k in tl["stock"])))
            for kname, n in k.most_common(args.kernels):
                print(f"      {n:4d}  {gpu_us[v][kname]:8.1f} us  {kname}")
            if v != "stock":  # kernels whose GPU time per call differs from stock's by 1 us or more
                for kname in sorted(set(gpu_us[v]) | set(gpu_us["stock"])):
                    d = gpu_us[v].get(kname, 0.0) - gpu_us["stock"].get(kname, 0.0)
                    if abs(d) >= 1.0:
                        print(f"      {d:+8.1f} us against stock  {kname}")
        del fns, tiered, base, variants
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
