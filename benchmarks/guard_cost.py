"""The host cost of a compiled model's guards, stock against patched: each variant built, tuned and compiled as
``benchmarks/models.py`` does (``Variant``, ``tune(context="compiled")``, ``own_compile``), but with a backend that runs
nothing (the first call's outputs, kept), so that a call's time is dynamo's frame entry, its guard check and the
wrappers around it. Prints, per variant, the guard tree's lines, the median of 2000 direct checks of it, and the host
time per call (median of interleaved rounds of 20 calls). Runs on the CPU or a GPU.

    TIERED_OPS_DB=/tmp/guards.sqlite python benchmarks/guard_cost.py --model qwen3-tiny --workload decode

``--explain DIR`` also writes, per variant, what a call runs besides its guard check: the frame's cache entries, the
graph's inputs and calls, the bytecode dynamo runs around the graph, and a profile of 200 calls.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dis
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.compiled_graphs import guards  # noqa: E402
from benchmarks.models import Variant, base_model, own_compile, step_fn  # noqa: E402
from tiered_ops.registry import DTYPES  # noqa: E402


def null_backend(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
    """A backend that keeps each graph it is given in ``graphs``, runs it once and returns those outputs on every
    later call: no compute in the timed calls."""
    def backend(gm: torch.fx.GraphModule, example: list) -> Callable[..., Any]:
        kept: list = []
        graphs.append(gm)

        def run(*args: Any) -> Any:
            if not kept:
                kept.append(gm(*args))
            return kept[0]

        return run

    return backend


def explain(name: str, compiled: Any, graphs: list[torch.fx.GraphModule], fn: Callable[[], Any], out: Path) -> None:
    """What one variant's call runs besides its guard check, into ``out/<name>.txt``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(compiled._torchdynamo_orig_callable.__code__)
    lines = [f"{name}: {len(entries)} cache entries on the compiled frame"]
    for i, gm in enumerate(graphs):
        nodes = collections.Counter(str(n.target) if n.op == "call_function" else n.op for n in gm.graph.nodes)
        lines += [f"graph {i}: {nodes['placeholder']} inputs, {len(gm.graph.nodes)} nodes; calls:"]
        lines += [f"  {c:4d} {t}" for t, c in nodes.most_common() if t not in ("placeholder", "output")]
    for i, e in enumerate(entries):
        text = io.StringIO()
        dis.dis(e.code, file=text)
        ops = text.getvalue().count("\n")
        lines += [f"entry {i}: bytecode of {ops} lines"] + text.getvalue().splitlines()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    lines += ["profile of 200 calls (by own time):", text.getvalue()]
    (out / f"{name}.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-tiny", help="a name of benchmarks/models.py's models() (quick or not)")
    ap.add_argument("--workload", default="decode", choices=("prefill", "decode"))
    ap.add_argument("--variants", default="stock,tiered,tiered-fused")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    ap.add_argument("--seq", type=int, default=64, help="prefill tokens")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--explain", type=Path, default=None, help="a folder for each variant's explain file")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.recompile_limit = 64
    base, config, arch = base_model(args.model, args.seq, dev, DTYPES[args.dtype])
    ids = torch.randint(0, config.vocab_size, (1, 1 if args.workload == "decode" else args.seq), device=dev)
    kwargs = dict(input_ids=ids, use_cache=False)
    fns: dict[str, Callable[[], Any]] = {}
    checks: dict[str, tuple[int, float]] = {}
    comps: dict[str, Any] = {}
    graphs: dict[str, list[torch.fx.GraphModule]] = {}
    for name in args.variants.split(","):
        v = Variant(name, base, arch)
        v.tune(kwargs, False, "compiled", show=False)
        graphs[name] = []
        compiled = own_compile(v.model, name, null_backend(graphs[name]))
        fns[name] = step_fn(compiled, args.workload, ids)
        fns[name]()
        comps[name] = compiled
        checks[name] = guards(compiled, kwargs, train=False, reps=2000)
        if checks[name][1] != checks[name][1]:  # nan
            raise SystemExit(f"{name}: the guards fail on the call's own arguments")
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for k in order:
            t = time.perf_counter()
            for _ in range(20):
                fns[k]()
            samples[k].append((time.perf_counter() - t) / 20 * 1e6)
    print(f"{args.model} {args.workload} {args.dtype} on {dev}; torch {torch.__version__}")
    for k in fns:
        lines, us = checks[k]
        host = statistics.median(samples[k])
        print(f"  {k:13s} guards {lines} lines, {us:.1f} us per check; host per call {host:.1f} us (median of "
              f"{args.rounds} rounds of 20)")
    if args.explain:
        args.explain.mkdir(parents=True, exist_ok=True)
        for k in fns:
            explain(k, comps[k], graphs[k], fns[k], args.explain)
        print(f"wrote {', '.join(str(args.explain / f'{k}.txt') for k in fns)}")


if __name__ == "__main__":
    main()
