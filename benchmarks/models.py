"""Model-level benchmark: stock transformers vs tiered_ops.patch (with and without fuse_residual) vs Liger's patch.

Models, built from configs with random weights (nothing is downloaded), in bf16: Llama-3-8B dimensions with 2 layers
(hidden 4096, intermediate 14336, 32 heads, 8 kv heads, vocab 128256), Qwen3-8B dimensions with 2 layers (hidden
4096, intermediate 12288, 32 heads, 8 kv heads, head_dim 128, vocab 151936), Mistral-7B-v0.3 dimensions with 2 layers
(hidden 4096, intermediate 14336, 32 heads, 8 kv heads, vocab 32768, no sliding window) and GPT-2 small; dropout 0.
Workloads: prefill (1 x --seq tokens, inference), decode (1 x 1 without a cache: the launch-bound end) and train
(1 x --seq: forward, LM loss, backward). Contexts: eager, torch.compile(fullgraph=True), CUDA graphs (inference, on a
GPU; captured after an eager warm-up on a side stream, torch's recipe). Liger: apply_liger_kernel_to_<arch>(model=...)
with its defaults except the fused linear cross entropy (off, so that logits exist); the module functions it
replaces (RoPE) are put back after it and swapped in only while Liger's rows run, so every variant runs in one process.
The variants tiered and tiered-fused keep the fused LM head + loss off too. With it on, for training only (a step then
makes no logits): tiered-lce (tiered_ops.patch with every op, linear_cross_entropy included) and liger-lce (Liger's
defaults, fused_linear_cross_entropy=True); their rows are checked by the loss and the gradients' norm against stock's.

Timing: the variants of one row are measured in interleaved rounds (--rounds, each round times --reps calls of every
variant, more on a fast row so that a round spans --min-round-ms, the order rotated per round), so drift hits all of
them alike. Each row: the median and p20-p80 of all its calls, and a verdict against stock: faster where its median
is below stock's p20, stock's median above its p80 and the variant's median below stock's in every round (the rounds
paired: a GPU's clocks drift by 10 % from round to round on an 8B-dimension prefill, and the calls of one round are
not independent samples), slower in the mirror case, else a tie within the spread. A control, stock-copy (an
unpatched second copy of stock, timed as one more variant), is the run's own noise floor: two identical models that a
verdict tells apart are noise. Each variant also gets a verdict against the control, and the row's verdict is faster
or slower only where both verdicts say so, else tie. Also
the logits' relative error against stock eager (float32; in training also the loss's and the norm of every
parameter's gradient, from the row's first step), the seconds tiered_ops.tune took, and for training the peak memory.

Writes models.csv and models.md into --out-dir (default reports/<gpu>/) after every row, so a cut run keeps what it
measured. Expected runtime on an H100, one model per call (--models): ~4-6 min for llama-8b-dims-2l or qwen3-8b-dims-2l
(compiles dominate), ~3 min for gpt2-small; all three exceed one 9-minute call (mistral-7b-dims-2l: not yet timed).

    python benchmarks/models.py --models llama-8b-dims-2l          # on a GPU
    python benchmarks/models.py --quick --out-dir /tmp/models      # CPU smoke: tiny configs, every code path
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.models_build import (  # noqa: E402
    CONTROL,
    FUSED_LOSS,
    Skip,
    Variant,
    base_model,
    graphed,
    models,
    own_compile,
    step_fn,
)
from benchmarks.models_rows import (  # noqa: E402
    agreed,
    rel_err,
    rounds_slower,
    spread,
    timed,
    verdict,
    write,
)
from benchmarks.step_memory import Peak, differences, recorded_peak  # noqa: E402

VARIANTS = ("stock", "stock-copy", "tiered", "tiered-fused", "liger", *FUSED_LOSS)
WORKLOADS = ("prefill", "decode", "train")
CONTEXTS = ("eager", "compile", "graphs")
TUNE_CONTEXT = {"eager": "eager", "compile": "compiled", "graphs": "graphed"}


def build(v: Variant, workload: str, context: str, ids: torch.Tensor, args: argparse.Namespace
          ) -> Callable[[], torch.Tensor]:
    if context == "eager":
        return step_fn(v.model, workload, ids)
    if context == "compile":
        return step_fn(own_compile(v.model, v.name, args.backend), workload, ids)
    return graphed(step_fn(v.model, workload, ids))


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The norm of every parameter's gradient together, in float32."""
    return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()
                                                 if p.grad is not None]))


def checked(fn: Callable[[], torch.Tensor], out: torch.Tensor, model: torch.nn.Module, workload: str
            ) -> dict[str, torch.Tensor]:
    """What a row's first call is checked by: its logits where it made them; in training its loss and the norm of the
    gradients (the first step's: from none)."""
    got = {"logits": out.float().clone()} if out.dim() == 3 else {}
    if workload == "train":
        got.update(loss=fn.loss.float().clone(), grad_norm=grad_norm(model))
    return got


def unsupported(workload: str, context: str, device: torch.device) -> str | None:
    if context == "graphs" and device.type != "cuda":
        return "CUDA graphs need a GPU"
    if context == "graphs" and workload == "train":
        return "CUDA graphs: inference only here"
    return None


def measure_row(name: str, variants: dict[str, Variant], workload: str, context: str, ids: torch.Tensor,
                args: argparse.Namespace, common: dict, reference: dict) -> list[dict]:
    """Every variant of one (workload, context): prepared, then timed in interleaved rounds."""
    dev = ids.device
    rows, fns, prep_s = {}, {}, {}
    peaks: dict[str, Peak] = {}
    for vname, v in variants.items():
        t0 = time.perf_counter()
        row = dict(common, model=name, variant=vname, workload=workload, context=context, tokens=ids.numel(),
                   note=v.note)
        rows[vname] = row
        v.model.train(workload == "train")
        try:
            with v.active():
                if vname.startswith("tiered") and args.tune:
                    kw = dict(input_ids=ids, use_cache=False) | ({"labels": ids} if workload == "train" else {})
                    row["tune_s"] = round(v.tune(kw, workload == "train", TUNE_CONTEXT[context], show=False), 2)
                fn = build(v, workload, context, ids, args)
                v.model.zero_grad(set_to_none=True)  # the first step's gradients alone: checked
                got = checked(fn, fn(), v.model, workload)
                for _ in range(args.warmup):
                    fn()
                if workload == "train" and dev.type == "cuda":  # from zeroed gradients (optimizer.zero_grad()'s
                    # None): what the step holds then depends on the step alone, not on the rows run before it
                    v.model.zero_grad(set_to_none=True)
                    peaks[vname] = recorded_peak(fn)
                    row["peak_mib"] = peaks[vname].requested_mib
        except Exception as e:  # a variant that cannot run a context is a result too
            row["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(f"{name} {vname} {workload} {context}: {row['note']}", file=sys.stderr)
            continue
        if vname == "stock" and context == "eager":
            reference[workload] = got
        for what, col in (("logits", "rel_err_vs_stock"), ("loss", "loss_rel_err_vs_stock"),
                          ("grad_norm", "grad_norm_rel_err_vs_stock")):
            if what in got and what in reference.get(workload, {}):
                row[col] = f"{rel_err(got[what], reference[workload][what]):.3e}"
        del got
        fns[vname] = fn
        prep_s[vname] = time.perf_counter() - t0
    for vname, p in peaks.items():  # a training peak above stock's: the allocations that differ, in the log
        if vname != "stock" and "stock" in peaks and p.requested > peaks["stock"].requested:
            print(f"{name} {vname} {workload} {context}: peak {p.requested_mib} MiB against stock's "
                  f"{peaks['stock'].requested_mib}; the blocks that differ:", file=sys.stderr)
            for line in differences(peaks["stock"], p, ("stock", vname)):
                print(f"  {line}", file=sys.stderr)
            if args.out_dir:  # both steps' events, to read where the peaks part
                for who in ("stock", vname):
                    peaks[who].save(Path(args.out_dir) / f"peak-{name}-{workload}-{context}-{who}.json.gz")
    del peaks
    t0 = time.perf_counter()
    samples: dict[str, list[list[float]]] = {v: [] for v in fns}  # per round
    order = list(fns)
    reps = args.reps
    if fns and args.min_round_ms:  # a fast row takes more calls per round (the same for every variant): its medians
        # are steadier on a noisy host
        with variants[order[0]].active():
            warm = statistics.median(timed(fns[order[0]], 3, dev.type == "cuda"))
        reps = max(reps, min(args.reps * 20, math.ceil(args.min_round_ms / max(warm, 1e-3))))
    for r in range(args.rounds):
        for vname in order[r % len(order):] + order[:r % len(order)]:
            with variants[vname].active():
                samples[vname].append(timed(fns[vname], reps, dev.type == "cuda"))
            if workload == "train":
                for p in variants[vname].model.parameters():
                    p.grad = None
    timing_s = time.perf_counter() - t0
    stats = {v: spread([t for rnd in ms for t in rnd]) for v, ms in samples.items()}
    for vname, (p50, p20, p80) in stats.items():
        rows[vname].update(ms_p50=round(p50, 4), ms_p20=round(p20, 4), ms_p80=round(p80, 4),
                           calls=sum(map(len, samples[vname])))
        n = len(samples[vname])
        if "stock" in stats and vname != "stock":
            k = rounds_slower(samples[vname], samples["stock"])
            rows[vname].update(rounds_slower=f"{k}/{n}", verdict=verdict(stats[vname], stats["stock"], k, n))
        if CONTROL in stats and vname not in ("stock", CONTROL):
            k = rounds_slower(samples[vname], samples[CONTROL])
            rows[vname].update(rounds_slower_vs_copy=f"{k}/{n}",
                               verdict_vs_copy=verdict(stats[vname], stats[CONTROL], k, n))
            if "verdict" in rows[vname]:
                rows[vname]["verdict"] = agreed(rows[vname]["verdict"], rows[vname]["verdict_vs_copy"])
        print(f"{name} {vname:12s} {workload:7s} {context:7s} {p50:10.3f} ms ({p20:.3f}-{p80:.3f}) "
              f"{rows[vname].get('verdict', '')} {rows[vname].get('rounds_slower', '')}"
              f"{' vs copy ' + rows[vname]['rounds_slower_vs_copy'] if 'rounds_slower_vs_copy' in rows[vname] else ''}",
              file=sys.stderr)
    print(f"{name} {workload} {context}: prepared in {', '.join(f'{k} {v:.0f} s' for k, v in prep_s.items())} "
          f"(tuning, compiling, warm-up), timed in {timing_s:.0f} s", file=sys.stderr)
    del fns
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def _commit() -> str:
    """The tree measured: TIERED_OPS_TREE where the caller names it (a copied working tree's own git may hold an older
    base), else git's HEAD here."""
    if os.environ.get("TIERED_OPS_TREE"):
        return os.environ["TIERED_OPS_TREE"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", help="where models.csv and models.md go (default reports/<gpu>/)")
    p.add_argument("--quick", action="store_true", help="CPU smoke: tiny configs, seq 16, 2 rounds of 2 calls")
    p.add_argument("--device", help="default: cuda when there is one (cpu with --quick)")
    p.add_argument("--seq", type=int, help="prefill and training tokens (default 2048; 16 with --quick)")
    p.add_argument("--rounds", type=int, help="interleaved rounds per row (default 5; 2 with --quick)")
    p.add_argument("--reps", type=int, help="calls of each variant per round (default 10; 2 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (default 3; 0 with --quick)")
    p.add_argument("--min-round-ms", type=float, help="each variant's calls per round span at least this many ms "
                   "(more calls than --reps on a fast row, at most 20x; default 100; 0 with --quick)")
    p.add_argument("--backend", help="torch.compile backend (default inductor; eager with --quick)")
    p.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                   help="tiered_ops.tune before the tiered rows (default on; off with --quick)")
    p.add_argument("--models", help="comma-separated model names (default: all)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--contexts", default=",".join(CONTEXTS))
    args = p.parse_args(argv)
    q = args.quick
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not q else "cpu")
    args.seq, args.rounds = args.seq or (16 if q else 2048), args.rounds or (2 if q else 5)
    args.reps = args.reps or (2 if q else 10)
    args.warmup = args.warmup if args.warmup is not None else (0 if q else 3)
    args.min_round_ms = args.min_round_ms if args.min_round_ms is not None else (0.0 if q else 100.0)
    args.backend = args.backend or ("eager" if q else "inductor")
    args.tune = (not q) if args.tune is None else args.tune
    # one model's forward code is traced per variant and workload: past dynamo's default limit it would run eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    if not args.tune:
        os.environ["TIERED_OPS_TUNE"] = "0"  # decisions from the store, or eager: nothing is measured
    import transformers

    try:
        import liger_kernel

        liger = getattr(liger_kernel, "__version__", "installed")
    except ImportError:
        liger = ""
    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    out = Path(args.out_dir or f"reports/{gpu.lower().replace(' ', '-')}")
    common = dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__, liger=liger, dtype="bf16")
    head = [f"`python benchmarks/models.py {' '.join(sys.argv[1:] if argv is None else argv)}` at commit {_commit()} "
            f"on {gpu}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, liger {liger or 'not installed'}.",
            f"bf16, prefill/train {args.seq} tokens, decode 1 token (no cache). {args.rounds} interleaved rounds of "
            f"{args.reps} calls per variant (order rotated per round; a fast row takes as many more as span "
            f"{args.min_round_ms:g} ms per variant and round: the calls column says how many in all), after "
            f"{args.warmup} warm-up calls; CUDA events "
            "(wall clock on a CPU). Verdict vs stock: faster/slower when each median lies outside the other's "
            "p20-p80 and every round agrees (rounds slower: the rounds whose median was above stock's), and the same "
            "against stock-copy, an unpatched copy of stock (the control; vs copy: the rounds above its median), "
            "else tie. "
            "Rel err: logits against stock eager, float32; loss and grad norm rel err (training): the loss and the "
            "norm of all the gradients of the row's first step against stock eager's (the fused-loss variants "
            f"{' and '.join(FUSED_LOSS)} make no logits; they run for training only). Tune s: tiered_ops.tune for that "
            "workload and context. Peak MiB: one training step from zeroed gradients (set to None), above the "
            "memory held before it, in bytes the step requested (benchmarks/step_memory.py)."]
    rows: list[dict] = []
    for name in models(q, args.seq):
        if args.models and name not in args.models.split(","):
            continue
        base, config, arch = base_model(name, args.seq, dev)
        variants = {}
        for vname in args.variants.split(","):
            try:
                variants[vname] = Variant(vname, base, arch)
            except Skip as e:
                rows.append(dict(common, model=name, variant=vname, note=str(e)))
        del base
        ids = {"prefill": torch.randint(0, config.vocab_size, (1, args.seq), device=dev),
               "decode": torch.randint(0, config.vocab_size, (1, 1), device=dev)}
        ids["train"] = ids["prefill"]
        reference: dict[str, torch.Tensor] = {}
        for workload in args.workloads.split(","):
            for context in args.contexts.split(","):
                why = unsupported(workload, context, dev)
                if why:
                    rows += [dict(common, model=name, variant=v, workload=workload, context=context, note=why)
                             for v in variants]
                else:
                    run = {k: v for k, v in variants.items() if workload == "train" or k not in FUSED_LOSS}
                    rows += [dict(common, model=name, variant=k, workload=workload, context=context,
                                  note="the fused LM head + loss: training only (a call without labels makes logits "
                                       "as the unfused variant's)") for k in variants if k not in run]
                    rows += measure_row(name, run, workload, context, ids[workload], args, common, reference)
                write(rows, out, head)  # as it goes: a cut run keeps its rows
        del variants
    write(rows, out, head)
    print(f"wrote {out / 'models.csv'} and {out / 'models.md'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
