"""What differs between a stock and a tiered_ops-patched transformers model under torch.compile(fullgraph=True).

Each variant is built as ``benchmarks/models.py`` builds it (``Variant``: a deep copy; ``tiered`` patched by
``tiered_ops.patch``, ``tiered-fused`` with ``fuse_residual=True``; ``stock-copy`` a second unpatched copy, the
control for what a copy and its place in the rounds cost by themselves), tuned as ``measure_row`` tunes it
(``tune(context="compiled")``; with ``--no-tune`` one eager step under TIERED_OPS_TUNE=0 primes the traced decisions
instead: no measuring, no CUDA extension build) and compiled through ``own_compile`` (Inductor), with the FX graph
cache off so that every variant's output code is generated. Per variant: dynamo's graphs and the FX calls whose
counts differ from stock's, tiered_ops custom ops left in the graph, Inductor's kernels (defined, launched per call),
extern calls and buffers allocated, the output code's diff against stock (names normalized), the guards (lines, us
per check) and interleaved timing (CUDA events on a GPU, else the wall clock; median, p20-p80, the per-round medians).
On CUDA also a torch.profiler table of each variant's top kernels and the kernels whose time differs from stock's.

    TIERED_OPS_DB=/tmp/cg.sqlite python benchmarks/compiled_graphs.py --model llama-tiny --dtype fp32   # CPU
    python benchmarks/compiled_graphs.py --model llama-8b-dims-2l --workload prefill                   # GPU
"""

from __future__ import annotations

import argparse
import collections
import difflib
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if "--no-tune" in sys.argv:
    os.environ["TIERED_OPS_TUNE"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.models import Variant, base_model, own_compile, step_fn  # noqa: E402
from benchmarks.models_rows import spread, timed  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def code_stats(codes: list[str]) -> dict[str, Any]:
    """Kernels defined and launched, extern calls, custom ops and buffers of Inductor's output modules."""
    defined = [re.findall(r"^(\w+) = async_compile\.\w+\(", c, re.M) for c in codes]
    launched = sum(len(re.findall(rf"\b{k}(\.run)?\(", c.split("def call(", 1)[-1])) for c, ks in zip(codes, defined)
                   for k in ks)
    code = "\n".join(codes)
    externs = collections.Counter(re.findall(r"extern_kernels\.(\w+)\(|torch\.ops\.(\w+\.\w+)", code))
    return dict(defined=sum(map(len, defined)), launched=launched,
                externs={a or b: n for (a, b), n in externs.items()},
                tiered_ops=len(re.findall(r"torch\.ops\.tiered_ops\.", code)),
                buffers=len(re.findall(r"empty_strided\w*\(", code)))


def normalized(code: str) -> list[str]:
    """Output code without what differs between two compiles of one graph (hashes, ids) and without its comment
    lines: the provenance Inductor writes above each kernel (the source variables' names, the FX nodes' numbering),
    which names what a graph was traced from, not what it runs."""
    out = []
    for line in code.splitlines():
        if re.match(r"\s*#", line):
            continue
        line = re.sub(r"/\S+/[a-z0-9]{2}/\w+\.(py|cpp|so)", "<path>", line)
        out.append(re.sub(r"\b[a-z0-9]{40,}\b", "<hash>", line))
    return out


def guards(compiled: Any, kwargs: dict[str, Any], train: bool, reps: int = 1000) -> tuple[int, float]:
    """(lines, us per check: the median of 5 batches of reps / 5) of the first cache entry of ``own_compile``'s code,
    checked with a call's locals (nan when they fail it)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    orig = compiled._torchdynamo_orig_callable
    entries = _debug_get_cache_entry_list(orig.__code__)
    if not entries:
        return 0, float("nan")
    gm = entries[0].guard_manager
    loc = {"args": (), "kwargs": kwargs} | dict(zip(orig.__code__.co_freevars,
                                                    (c.cell_contents for c in orig.__closure__ or ())))
    times = []
    with torch.set_grad_enabled(train):
        if not gm.check(loc):
            return str(gm).count("\n"), float("nan")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps // 5):
                gm.check(loc)
            times.append((time.perf_counter() - t) / (reps // 5) * 1e6)
    return str(gm).count("\n"), statistics.median(times)


def guard_text(compiled: Any) -> str:
    """The guards of the first cache entry of ``own_compile``'s code, as torch prints them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(compiled._torchdynamo_orig_callable.__code__)
    return str(entries[0].guard_manager) if entries else ""


def kernel_table(fn: Callable[[], Any], calls: int) -> dict[str, tuple[float, float]]:
    """CUDA kernel name -> (launches, GPU us) per call, from torch.profiler over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:100]][0] += 1 / calls
            out[e.name[:100]][1] += e.time_range.elapsed_us() / calls
    return {k: (v[0], v[1]) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b-dims-2l", help="a name of benchmarks/models.py's models(); "
                    "llama-tiny, qwen3-tiny, gpt2-tiny are its --quick configs")
    ap.add_argument("--workload", default="prefill", choices=("prefill", "decode", "train"))
    ap.add_argument("--variants", default="stock,stock-copy,tiered,tiered-fused")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, help="tokens (default 2048 on CUDA, 64 on the CPU)")
    ap.add_argument("--no-tune", action="store_true", help="no tiered_ops.tune: TIERED_OPS_TUNE=0 and an eager step")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5, help="calls per variant per round")
    ap.add_argument("--diff-lines", type=int, default=40, help="output-code diff lines shown per variant")
    ap.add_argument("--kernels", type=int, default=12, help="kernels listed per variant (CUDA)")
    ap.add_argument("--save", help="a folder to write each variant's FX graph and output code into")
    args = ap.parse_args()
    dev, cuda = torch.device(args.device), args.device.startswith("cuda")
    seq = args.seq or (2048 if cuda else 64)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    inductor_config.fx_graph_cache = False  # every variant generates its code (a cache hit shows none)
    base, cfg, arch = base_model(args.model, seq, dev, DTYPES[args.dtype])
    train = args.workload == "train"
    base.train(train)
    ids = torch.randint(0, cfg.vocab_size, (1, 1 if args.workload == "decode" else seq), device=dev)
    kw = dict(input_ids=ids, use_cache=False) | (dict(labels=ids) if train else {})
    print(f"{args.model} {args.workload} {args.dtype} {seq if args.workload != 'decode' else 1} tokens on "
          f"{torch.cuda.get_device_name(dev) if cuda else 'cpu'}; torch {torch.__version__}", flush=True)
    fns, stats, codes, compiled = {}, {}, {}, {}
    for name in args.variants.split(","):
        v = Variant(name, base, arch)
        v.model.train(train)
        if name.startswith("tiered") and args.no_tune:  # an eager step primes the traced decisions (eager: nothing
            step_fn(v.model, args.workload, ids)()  # stored, nothing measured)
        elif not args.no_tune:
            v.tune(kw, train, "compiled")
        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, example: list, graphs: list = graphs) -> Callable[..., Any]:
            from torch._inductor.compile_fx import compile_fx

            graphs.append(gm)
            return compile_fx(gm, example)

        counters.clear()
        compiled[name] = own_compile(v.model, name, backend)
        fn = step_fn(compiled[name], args.workload, ids)
        _, code = run_and_get_code(fn)
        fns[name], codes[name] = fn, "\n".join(code)
        fx = collections.Counter(str(n.target) for g in graphs for n in g.graph.nodes
                                 if n.op in ("call_function", "call_method", "call_module"))
        st = code_stats(code) | dict(graphs=len(graphs), fx=fx, breaks=sum(counters["graph_break"].values()),
                                            recompiles=sum(counters["recompiles"].values()))
        call_kw = dict(input_ids=ids) | (dict(labels=ids) if train else {}) | dict(use_cache=False)  # step_fn's order
        st["guards"] = guards(compiled[name], call_kw, train)
        stats[name] = st
        print(f"  {name:13s} {v.note or 'unpatched'}: {st['graphs']} graph(s), {sum(fx.values())} FX calls, "
              f"{st['breaks']} breaks; Inductor: {st['defined']} kernels defined, {st['launched']} launched per call, "
              f"{st['buffers']} buffers, tiered_ops ops {st['tiered_ops']}, extern {st['externs']}; guards "
              f"{st['guards'][0]} lines, {st['guards'][1]:.1f} us/check", flush=True)
        if args.save:  # the FX graphs, the output code and the guards
            Path(args.save).mkdir(parents=True, exist_ok=True)
            Path(args.save, f"{name}.guards.txt").write_text(guard_text(compiled[name]))
            Path(args.save, f"{name}.fx.py").write_text("\n\n".join(g.code for g in graphs))
            Path(args.save, f"{name}.inductor.py").write_text(codes[name])
    ref = next(iter(stats))
    for name in list(stats)[1:]:
        fx_a, fx_b = stats[ref]["fx"], stats[name]["fx"]
        moved = {k: fx_b[k] - fx_a[k] for k in set(fx_a) | set(fx_b) if fx_b[k] != fx_a[k]}
        diff = [ln for ln in difflib.unified_diff(normalized(codes[ref]), normalized(codes[name]), lineterm="", n=0)
                if not ln.startswith(("---", "+++", "@@"))]
        print(f"  {name} against {ref}: FX call counts that differ {moved or 'none'}; "
              f"output code: {len(diff)} lines differ (normalized)")
        for ln in diff[:args.diff_lines]:
            print(f"      {ln[:160]}")
    samples: dict[str, list[float]] = {v: [] for v in fns}
    rounds: dict[str, list[float]] = {v: [] for v in fns}  # each round's median: calls within a round are not
    order = list(fns)  # independent (clocks, power), so the rounds say how far apart two medians may fall
    for r in range(args.rounds):
        for v in order[r % len(order):] + order[:r % len(order)]:
            ms = timed(fns[v], args.reps, cuda)
            samples[v] += ms
            rounds[v].append(statistics.median(ms))
    for v in fns:
        p50, p20, p80 = spread(samples[v])
        print(f"  {v:13s} {p50:9.3f} ms ({p20:.3f}-{p80:.3f}), {p50 / spread(samples[ref])[0]:.3f}x {ref}'s; "
              f"round medians {' '.join(f'{x:.3f}' for x in rounds[v])}")
    if cuda:
        tables = {v: kernel_table(fns[v], 10) for v in fns}
        for v, t in tables.items():
            print(f"  {v}: {sum(n for n, _ in t.values()):.0f} kernels/call, "
                  f"{sum(us for _, us in t.values()):.1f} us GPU/call; top kernels (launches/call, us/call):")
            for k, (n, us) in sorted(t.items(), key=lambda kv: -kv[1][1])[:args.kernels]:
                print(f"      {n:5.1f} {us:9.1f}  {k}")
            if v != ref:
                for k in sorted(set(t) | set(tables[ref])):
                    d = t.get(k, (0, 0.0))[1] - tables[ref].get(k, (0, 0.0))[1]
                    if abs(d) >= 2.0:
                        print(f"      {d:+8.1f} us against {ref}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
