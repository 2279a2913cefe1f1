"""Where one model step's time goes, per variant: the step's time as the caller sees it (CUDA events around calls, the
wall clock on a CPU), the host's time to issue it (no synchronization inside the step, so a step whose host time
nears its whole time is host-bound), and on a GPU the kernels' time per step from torch.profiler, by family (matmuls,
attention, tiered_ops' kernels, PyTorch's elementwise and reduction kernels, Triton kernels of Inductor, the rest)
and the top kernels. Each variant is built, tuned and compiled as ``benchmarks/models.py`` does it.

    python benchmarks/step_profile.py --model llama-8b-dims-2l --workload train --context eager     # GPU
    TIERED_OPS_DB=/tmp/sp.sqlite python benchmarks/step_profile.py --model llama-tiny --seq 64      # CPU
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.compiled_graphs import kernel_table  # noqa: E402
from benchmarks.models import TUNE_CONTEXT, Variant, base_model, own_compile, step_fn  # noqa: E402
from benchmarks.models_rows import spread, timed  # noqa: E402
from benchmarks.step_trace import analyze, load, render  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# kernel families after tiered_ops' own, first match wins (names as the profiler reports them)
FAMILIES = [
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("inductor", r"^triton_"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|index"),
    ("reduction", r"reduce|softmax|norm"),
]


def own_kernels() -> frozenset[str]:
    """The names of tiered_ops' kernels: each ``@triton.jit`` function of triton_src and ``__global__`` of cuda_src."""
    names = set()
    for f in (ROOT / "triton_src").glob("*.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\n\s*def (\w+)", f.read_text()))
    for f in [*(ROOT / "cuda_src").glob("*.cu"), *(ROOT / "cuda_src").glob("*.cuh")]:
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)", f.read_text()))
    return frozenset(names)


OWN = own_kernels()


def family(name: str) -> str:
    if OWN & set(re.findall(r"\w+", name)):
        return "tiered_ops"
    return next((f for f, pat in FAMILIES if re.search(pat, name, re.I)), "other")


def host_ms(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    """Median host time to issue one call (ms), each call's work synchronized away before the next is issued."""
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(out)


def syncs(fn: Callable[[], Any]) -> collections.Counter:
    """The synchronizing CUDA calls of one call of ``fn``, by the Python line that made them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                               if "synchroniz" in str(w.message))


class Clocks:
    """The SM clock (MHz) and the board's power (W) sampled by nvidia-smi every 50 ms while the block runs."""

    def __init__(self, on: bool) -> None:
        self.on = on and shutil.which("nvidia-smi") is not None

    def __enter__(self) -> "Clocks":
        if not self.on:
            self.proc = None
            return self
        cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50",
               f"--id={torch.cuda.current_device()}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.samples: list[tuple[float, float]] = []
        if self.proc is None:
            return
        self.proc.terminate()
        out, _ = self.proc.communicate()
        for line in out.splitlines():
            try:
                sm, watts = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((sm, watts))

    def __str__(self) -> str:
        if not self.samples:
            return "no clock samples"
        sm, watts = zip(*self.samples)
        return (f"SM clock median {statistics.median(sm):.0f} MHz (min {min(sm):.0f}), power median "
                f"{statistics.median(watts):.0f} W over {len(sm)} samples")


def trace_step(fn: Callable[[], Any], path: Path) -> str:
    """One call of ``fn`` under torch.profiler, as a Chrome trace at ``path`` (gzipped), and where its GPU waited."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("step"):
            fn()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))  # a path ending in .gz: the profiler gzips it
    return render(analyze(load(path)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b-dims-2l", help="a name of benchmarks/models.py's models()")
    ap.add_argument("--workload", default="train", choices=("prefill", "decode", "train"))
    ap.add_argument("--context", default="eager", choices=("eager", "compile"))
    ap.add_argument("--variants", default="stock,tiered,liger")
    ap.add_argument("--seq", type=int, help="tokens (default 2048 on CUDA, 64 on the CPU)")
    ap.add_argument("--reps", type=int, default=10, help="calls timed per variant")
    ap.add_argument("--kernels", type=int, default=15, help="top kernels listed per variant (GPU)")
    ap.add_argument("--no-tune", action="store_true", help="no tiered_ops.tune: the calls read what is stored")
    ap.add_argument("--trace", help="a folder for one step's Chrome trace per variant (GPU), each read for where "
                    "the GPU waited (benchmarks/step_trace.py)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    seq = args.seq or (2048 if cuda else 64)
    base, config, arch = base_model(args.model, seq, dev)
    train = args.workload == "train"
    ids = torch.randint(0, config.vocab_size, (1, 1 if args.workload == "decode" else seq), device=dev)
    kw = dict(input_ids=ids, use_cache=False) | (dict(labels=ids) if train else {})
    print(f"{args.model} {args.workload} {args.context} bf16 {ids.shape[1]} tokens on "
          f"{torch.cuda.get_device_name(dev) if cuda else 'cpu'}; torch {torch.__version__}", flush=True)
    tables: dict[str, dict[str, tuple[float, float]]] = {}
    for name in args.variants.split(","):
        try:
            v = Variant(name, base, arch)
        except Exception as e:  # noqa: BLE001 - a peer that is not installed here is reported, not fatal
            print(f"  {name}: {type(e).__name__}: {e}")
            continue
        v.model.train(train)
        with v.active():
            if not args.no_tune:
                v.tune(kw, train, TUNE_CONTEXT[args.context])
            model = own_compile(v.model, name) if args.context == "compile" else v.model
            fn = step_fn(model, args.workload, ids)
            for _ in range(3):
                fn()
            with Clocks(cuda) as clocks:
                p50, p20, p80 = spread(timed(fn, args.reps, cuda))
            host = host_ms(fn, args.reps, cuda)
            line = f"  {name:13s} step {p50:.3f} ms ({p20:.3f}-{p80:.3f}), host to issue it {host:.3f} ms"
            if cuda:
                tables[name] = t = kernel_table(fn, 5)
                gpu = sum(us for _, us in t.values()) / 1e3
                fams: dict[str, float] = collections.defaultdict(float)
                for k, (_, us) in t.items():
                    fams[family(k)] += us / 1e3
                line += (f", kernels {gpu:.3f} ms in {sum(n for n, _ in t.values()):.0f} launches: "
                         + ", ".join(f"{f} {ms:.3f}" for f, ms in sorted(fams.items(), key=lambda kv: -kv[1])))
            print(line, flush=True)
            for k, (n, us) in sorted(tables.get(name, {}).items(), key=lambda kv: -kv[1][1])[:args.kernels]:
                print(f"      {n:5.1f} {us:9.1f} us  [{family(k)}] {k}")
            if cuda:
                print(f"    while timed: {clocks}")
                found = syncs(fn)
                print(f"    synchronizing calls in one step: {sum(found.values())}"
                      + "".join(f"; {n} at {where}" for where, n in found.most_common(5)))
                if args.trace:
                    stem = f"{args.model}-{args.workload}-{args.context}-{name}.json.gz"
                    print(trace_step(fn, Path(args.trace) / stem), flush=True)
        v.model.zero_grad(set_to_none=True)
        del v, model, fn
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
