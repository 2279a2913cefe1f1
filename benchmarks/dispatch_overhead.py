"""Per-call dispatch overhead: ``tiered_ops.<op>`` minus the chosen implementation called directly, and the same for
the callable ``select_backend`` returns (obtained once), per op at its launch-bound shape (a GPU: one row of 4096 in
bf16; a CPU: 4 x 64 fp32). Target on the GPU host: <= 1.0 us. Decisions come from the store in use
(TIERED_OPS_TUNE=0: nothing is measured; eager where nothing is stored), so the direct call is whatever is chosen;
``--tune``: each case's bucket is measured first where the store has no decision (blocking), so the direct call is
what a tuned process runs.

The three callers are timed in interleaved rounds (public, direct, selection; the next round in another order), each
a batch of back-to-back calls (synchronized at the end on a GPU), with the garbage collector off. An overhead is the
median over rounds of (caller - direct) of the same round, so a drift of the machine between rounds cancels; its
p20-p80 over rounds says how steady it was; ``*_min_us``: the fastest round of the caller minus the fastest of the
direct call (on a loaded machine the least disturbed estimate). ``*_paired_us``: the median over single calls
of (caller - direct), each caller call timed beside one direct call (the order alternating), so the host's noise
in an implementation that costs tens of us falls on both sides of each pair. ``select_backend_lookup_us``: one
``select_backend(...)`` call itself (its cached lookup, nothing run). On a CPU torch runs on one thread here.

On a GPU the CUDA extension is loaded first, so calls are keyed in C++ (``cuda_src/call_key.cpp``), as in any
process that has it built; ``--python-key`` times the Python key alone (the CPU's, or a GPU's without the extension).

``--stub``: the chosen implementation replaced by a function of the op's signature that returns its first argument,
so the dispatch's own cost is timed without the implementation's variance (a loaded CPU host).

``--evict MB``: also ``*_cold_us``, the median over single calls of (caller - direct) with MB streamed through the CPU
caches (a CPU tensor written) before each timed call, as an implementation's own work does: what the dispatch costs
when what it reads is no longer cached (with ``--stub``, the dispatch's own cold cost).

Each round-based overhead has a 95 % confidence interval of its median (``*_ci_lo_us``, ``*_ci_hi_us``: order
statistics, no assumption on the distribution). ``--until-ci US``: more rounds, ``--rounds`` at a time, while either
caller's interval is wider than +-US, for at most ``--max-s`` seconds per op: an implementation whose host time
varies by several us from round to round (cross_entropy's) needs thousands of rounds to resolve 1 us. The verdict
per caller: ``meets`` where the interval lies at or under the target, ``over`` where it lies above, else ``open``.

    python benchmarks/dispatch_overhead.py [--csv out.csv] [--ops rms_norm,softmax] [--rounds 60] [--calls 200] [--stub]
        [--python-key] [--tune] [--evict 16] [--until-ci 0.1 --max-s 60]
"""

from __future__ import annotations

import argparse
import csv
import inspect
import os
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("TIERED_OPS_TUNE", "0")  # the overhead is timed here, not a measurement
# Inductor compiles in this process: its pool of compile workers, started by the first compile (a compile tier
# chosen, or tuned), would start and import torch in several processes while the rounds run (the H100 host measured
# cross_entropy's compile tier with round differences spread over -1 to 7 us beside it).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

import tiered_ops  # noqa: E402
from tiered_ops.measure.recheck import interleaved as rotated_rounds  # noqa: E402  (the harness's rotated rounds)
from tiered_ops.measure.timing import no_gc  # noqa: E402  (the harness's window without collections)
from tiered_ops.runtime import dispatch  # noqa: E402
from tiered_ops.tiers import cuda_ext  # noqa: E402


def batch_us(fn: Callable[[], Any], calls: int, cuda: bool) -> float:
    """Host time per call of ``calls`` back-to-back calls (synchronized before and after on a GPU, so a
    launch-bound call is timed at the rate the host issues it)."""
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def interleaved(fns: dict[str, Callable[[], Any]], calls: int, rounds: int, cuda: bool) -> dict[str, list[float]]:
    """Per-call times of each of ``fns`` in ``rounds`` rounds, the order rotated each round (ABC, BCA, CAB, ...)."""
    for f in fns.values():
        for _ in range(50):
            f()
    with no_gc():
        return rotated_rounds(fns, rounds, lambda f: batch_us(f, calls, cuda))


def paired(fn: Callable[[], Any], direct: Callable[[], Any], pairs: int, cuda: bool) -> list[float]:
    """(fn - direct) in us of ``pairs`` pairs of single calls, each pair timed back to back with the order
    alternating (synchronized before and after on a GPU, never between calls)."""
    clock = time.perf_counter_ns
    out = []
    with no_gc():
        if cuda:
            torch.cuda.synchronize()
        for i in range(pairs):
            first, second = (fn, direct) if i % 2 == 0 else (direct, fn)
            t0 = clock()
            first()
            t1 = clock()
            second()
            t2 = clock()
            out.append(((t1 - t0) - (t2 - t1)) / 1e3 * (1 if i % 2 == 0 else -1))
        if cuda:
            torch.cuda.synchronize()
    return out


def cold(fn: Callable[[], Any], direct: Callable[[], Any], pairs: int, evict: torch.Tensor | None,
         cuda: bool) -> list[float]:
    """(fn - direct) in us of ``pairs`` pairs of single calls, ``evict`` written before each timed call (so what a call
    reads comes from memory, not the CPU caches; None: nothing written, the calls warm); the GPU synchronized before
    each call, never inside the timing."""
    clock = time.perf_counter_ns
    out = []
    with no_gc():
        for _ in range(pairs):
            t = []
            for f in (fn, direct):
                if evict is not None:
                    evict.add_(1.0)
                if cuda:
                    torch.cuda.synchronize()
                t0 = clock()
                f()
                t.append(clock() - t0)
            out.append((t[0] - t[1]) / 1e3)
    return out


TARGET_US = 1.0  # on the GPU host, for tiered_ops.<op> and a select_backend callable alike


def median_ci(xs: list[float]) -> tuple[float, float]:
    """A 95 % confidence interval of the median of ``xs``: the order statistics n/2 -+ 0.98 sqrt(n) (binomial, normal
    approximation; the whole range below 7 samples)."""
    v = sorted(xs)
    k = max(0, int(len(v) / 2 - 0.98 * len(v) ** 0.5))
    return v[k], v[len(v) - 1 - k]


def verdict(ci: tuple[float, float], target: float = TARGET_US) -> str:
    return "meets" if ci[1] <= target else "over" if ci[0] > target else "open"


def spread(xs: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of ``xs``."""
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return statistics.median(xs), q[1], q[7]


def cases(dev: torch.device) -> dict[str, tuple[tuple, dict]]:
    """op -> (call arguments, select_backend parameters) at the launch-bound default."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n, rows = (4096, 1) if dev.type == "cuda" else (64, 4)
    x, r, w = (torch.randn(rows, n, device=dev, dtype=dt) for _ in range(3))
    w = w[0]
    t = torch.randint(0, n, (rows,), device=dev)
    # segment_sum: 16 rows of 256 in 4 segments (a gather-side call of a few rows, launch-bound as the others)
    vals = torch.randn(16, 256, device=dev, dtype=dt)
    offsets = torch.tensor([0, 3, 8, 8, 16], device=dev)
    return {
        "rms_norm": ((x, (n,), w, 1e-6), dict(normalized_shape=(n,))),
        "fused_add_rms_norm": ((x, r, (n,), w, 1e-6), dict(normalized_shape=(n,))),
        "layer_norm": ((x, (n,), w, w, 1e-5), dict(normalized_shape=(n,))),
        "softmax": ((x, -1), dict(dim=-1)),
        "gelu": ((x,), dict(bias=False)),  # select_backend's problem defaults to a bias
        "cross_entropy": ((x, t), {}),
        "muladd": ((x, r, w.expand(rows, n).contiguous()), {}),
        "segment_sum": ((vals, offsets), dict(segments=4)),
    }


def stub_of(spec: tiered_ops.OpSpec) -> Callable[..., Any]:
    """A function with ``spec``'s signature that returns its first argument and does nothing else."""
    sig = inspect.signature(spec.reference)
    ns: dict[str, Any] = {}
    exec(f"def stub{sig.replace(return_annotation=inspect.Signature.empty)}:\n    return {next(iter(sig.parameters))}",
         ns)  # noqa: S102
    return ns["stub"]


def _chosen(op: str) -> Any:
    """The selection the public function calls for its cached signature of ``op`` (inference, eager context)."""
    calls = tiered_ops.runtime.memo._calls
    key = next((k for k in calls if k[0] == op and k[-1] == 0 and not k[-2]), None)
    return calls.get(key) if key is not None else None


def measure_op(op: str, a: tuple, params: dict, dev: torch.device, calls: int, rounds: int,
               stub: bool = False, evict_mb: float = 0.0, until_ci: float = 0.0, max_s: float = 60.0) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    public = getattr(tiered_ops, op)
    x = a[0]
    with torch.no_grad():
        public(*a)  # the slow path once: the call is cached
        if stub:
            # the implementation each caller runs (the public function's and the selection's, where they differ)
            spec = tiered_ops.get_op(op)
            sels = [tiered_ops.select_backend(op, tuple(x.shape), x.dtype, dev, **params), _chosen(op)]
            impls = {id(s.impl): s.impl for s in sels if s is not None}.values()
            kept = [(i, i.unchecked) for i in impls]
            for i, _ in kept:
                i.unchecked = stub_of(spec)
            try:
                tiered_ops.clear_cache()
                return measure_op(op, a, params, dev, calls, rounds, evict_mb=evict_mb, until_ci=until_ci,
                                  max_s=max_s)
            finally:
                for i, fn in kept:
                    i.unchecked = fn
                tiered_ops.clear_cache()
        sel = tiered_ops.select_backend(op, tuple(x.shape), x.dtype, dev, **params)
        chosen = _chosen(op)
        direct = (chosen or sel).fn
        lookup = lambda: tiered_ops.select_backend(op, tuple(x.shape), x.dtype, dev, **params)  # noqa: E731
        callers = {"public": lambda: public(*a), "direct": lambda: direct(*a), "select": lambda: sel(*a)}
        start = time.perf_counter()
        t = interleaved(callers, calls, rounds, cuda)
        while until_ci > 0 and time.perf_counter() - start < max_s and any(
                hi - lo > 2 * until_ci for lo, hi in (median_ci(_diffs(t, c)) for c in ("public", "select"))):
            for c, more in interleaved(callers, calls, rounds, cuda).items():
                t[c] += more
        t_lookup = interleaved({"lookup": lookup}, calls, max(5, rounds // 4), False)["lookup"]
        pair_pub = spread(paired(lambda: public(*a), lambda: direct(*a), calls * rounds // 3, cuda))
        pair_sel = spread(paired(lambda: sel(*a), lambda: direct(*a), calls * rounds // 3, cuda))
        colds = {}
        if evict_mb > 0:
            buf = torch.zeros(int(evict_mb * 2**20 / 4))
            for name, fn in (("public", lambda: public(*a)), ("select_backend", lambda: sel(*a))):
                c = spread(cold(fn, lambda: direct(*a), max(50, calls * rounds // 24), buf, cuda))
                colds.update({f"{name}_cold_us": round(c[0], 3), f"{name}_cold_p20_us": round(c[1], 3),
                              f"{name}_cold_p80_us": round(c[2], 3)})
    # whether the public calls were served by the C++ key (its key of this call cached): None where it is not in use
    ckey = None
    if dispatch._ckey is not None:  # (grad mode off, as the calls were made: it is part of the key)
        bound = inspect.signature(tiered_ops.get_op(op).reference).bind(*a)
        bound.apply_defaults()
        with torch.no_grad():
            k = dispatch._ckey(op, *bound.arguments.values())
        ckey = "none" if k is None else k in tiered_ops.runtime.memo._hot
    d_pub, d_sb = _diffs(t, "public"), _diffs(t, "select")
    pub, sb, pub_ci, sb_ci = spread(d_pub), spread(d_sb), median_ci(d_pub), median_ci(d_sb)
    return dict(op=op, shape="x".join(map(str, x.shape)), dtype=str(x.dtype).removeprefix("torch."), device=dev.type,
                chosen=(chosen or sel).name, direct_us=round(statistics.median(t["direct"]), 3),
                public_us=round(statistics.median(t["public"]), 3), public_overhead_us=round(pub[0], 3),
                select_backend_overhead_us=round(sb[0], 3),
                public_overhead_p20_us=round(pub[1], 3), public_overhead_p80_us=round(pub[2], 3),
                select_backend_overhead_p20_us=round(sb[1], 3), select_backend_overhead_p80_us=round(sb[2], 3),
                select_us=round(statistics.median(t["select"]), 3), select_chosen=sel.name,
                select_backend_lookup_us=round(statistics.median(t_lookup), 3), rounds=len(t["direct"]), calls=calls,
                public_overhead_ci_lo_us=round(pub_ci[0], 3), public_overhead_ci_hi_us=round(pub_ci[1], 3),
                select_backend_overhead_ci_lo_us=round(sb_ci[0], 3),
                select_backend_overhead_ci_hi_us=round(sb_ci[1], 3),
                public_verdict=verdict(pub_ci), select_backend_verdict=verdict(sb_ci),
                public_overhead_min_us=round(min(t["public"]) - min(t["direct"]), 3),
                select_backend_overhead_min_us=round(min(t["select"]) - min(t["direct"]), 3),
                public_paired_us=round(pair_pub[0], 3), public_paired_p20_us=round(pair_pub[1], 3),
                public_paired_p80_us=round(pair_pub[2], 3), select_backend_paired_us=round(pair_sel[0], 3),
                select_backend_paired_p20_us=round(pair_sel[1], 3), select_backend_paired_p80_us=round(pair_sel[2], 3),
                ckey_hit=ckey, **colds)


def _diffs(t: dict[str, list[float]], caller: str) -> list[float]:
    """(caller - direct) per round."""
    return [c - d for c, d in zip(t[caller], t["direct"])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", help="write the table here too")
    p.add_argument("--ops", help="comma-separated ops (default: all measured here)")
    p.add_argument("--calls", type=int, default=200, help="calls per batch")
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds per op")
    p.add_argument("--stub", action="store_true", help="time the dispatch alone: the implementation a stub")
    p.add_argument("--python-key", action="store_true", help="key calls in Python even where the C++ key loads")
    p.add_argument("--tune", action="store_true", help="measure each case's bucket first where nothing is stored")
    p.add_argument("--evict", type=float, default=0.0, metavar="MB",
                   help="also time each caller with MB streamed through the CPU caches before each call")
    p.add_argument("--until-ci", type=float, default=0.0, metavar="US",
                   help="more rounds while a caller's 95%% interval of the median is wider than +-US")
    p.add_argument("--max-s", type=float, default=60.0, help="with --until-ci: seconds of rounds per op at most")
    args = p.parse_args(argv)
    if args.tune:
        tiered_ops.set_tuning("blocking")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not args.python_key:
        why = cuda_ext.load(dev)
        if why:
            print(f"the C++ key is unavailable: {why}")
    if args.python_key:
        dispatch.use_call_key(None)
    # c++ vectorcall: the generated functions' own C fast path (no Python frame of ours on a hit)
    key = "python" if dispatch._ckey is None else "c++ vectorcall" if dispatch._fast is not None else "c++"
    print(f"calls keyed in {key}")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # steadier times of a small op on a shared host; the dispatch is one thread
    rows = []
    for op, (a, params) in cases(dev).items():
        if (args.ops and op not in args.ops.split(",")) or op not in tiered_ops.OPS:
            continue
        rows.append(dict(measure_op(op, a, params, dev, args.calls, args.rounds, args.stub, args.evict, args.until_ci,
                                    args.max_s), key=key))
    print(f"{'op':<20} {'shape':>8} {'chosen':>8} {'direct us':>10} {'op-direct (p20-p80)':>22} "
          f"{'select-direct (p20-p80)':>24} {'lookup us':>10} {'min: op, select':>16} {'paired: op, select':>18}")
    for r in rows:
        pub = f"{r['public_overhead_us']:.2f} ({r['public_overhead_p20_us']:.2f}-{r['public_overhead_p80_us']:.2f})"
        sb = (f"{r['select_backend_overhead_us']:.2f} ({r['select_backend_overhead_p20_us']:.2f}-"
              f"{r['select_backend_overhead_p80_us']:.2f})")
        print(f"{r['op']:<20} {r['shape']:>8} {r['chosen']:>8} {r['direct_us']:10.2f} {pub:>22} {sb:>24} "
              f"{r['select_backend_lookup_us']:10.2f} {r['public_overhead_min_us']:8.2f}"
              f"{r['select_backend_overhead_min_us']:8.2f} {r['public_paired_us']:9.2f}"
              f"{r['select_backend_paired_us']:9.2f}  c++ key hit: {r['ckey_hit']}"
              + (f"  cold: op {r['public_cold_us']:.2f}, select {r['select_backend_cold_us']:.2f}"
                 if "public_cold_us" in r else ""))
    print(f"target on the GPU host: op-direct and select-direct <= {TARGET_US} us; the 95% interval of each median, "
          "and where it lies (meets: at or under, over: above, open: across):")
    for r in rows:
        print(f"  {r['op']:<20} op {r['public_overhead_ci_lo_us']:.2f}-{r['public_overhead_ci_hi_us']:.2f} "
              f"{r['public_verdict']:<6} select {r['select_backend_overhead_ci_lo_us']:.2f}-"
              f"{r['select_backend_overhead_ci_hi_us']:.2f} {r['select_backend_verdict']:<6} ({r['rounds']} rounds)")
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
