"""Compiled-model matrix: stock transformers against ``tiered_ops.patch`` in the natural flow (patch -> torch.compile
-> call, from a fresh store), each compiled model in a process of its own, graph breaks and recompiles counted per row.

A row is (config, dtype, compile mode, workload). Each of its variants (stock; tiered = ``tiered_ops.patch(model)``;
in every row but those of the GPU-searching modes, and wherever ``--variants`` names it, stock-copy, an unpatched
second stock, the control: a step's time differs from one process to another; where named,
tiered-next, patched in a process that starts after the tiered worker's tuning and reads its store: the graph the next
run of the same program compiles, with the decisions made) runs in a worker process of its own
(benchmarks/compiled_worker.py, multiprocessing spawn): two compiled instances of one class in one process share
dynamo's cache (inlined modules are not guarded by identity), so compiling variants side by side would measure the
cache. A worker builds the model from the config (seed 0, the same inputs in every worker), runs one stock eager step
(the reference: the rel err column compares its compiled first step with it, float32), patches (tiered), compiles with
plain ``torch.compile(model, mode=...)`` (fullgraph not forced: breaks are what is counted), makes the first call
(first_call_s: tracing, compiling and, for tiered, whatever a miss costs; a tiered worker then waits for the tuning its
trace queued), then, when asked, warms up and serves timing requests. Rows run in batches (``--parallel K`` rows,
default 1; benchmarks/compiled_schedule.py): the batch's workers start together, then compile (K = 1: one variant at a
time, alone; K > 1: every variant of the batch at once, except the GPU-searching max-autotune modes, whose variants
compile one at a time, alone), then the rows are timed one after another with every other worker idle: the parent
interleaves a row's timing rounds (A, B, A, B, ..., the order rotated per round), so each compiled model lives in its
own process and the comparison is interleaved all the same, and no compile or tuning runs anywhere while a call is
timed (compiled_models_events.csv, every request's span by the workers' clocks, shows it). From its warm-up on, every
worker's calling thread runs on one CPU, the same for all (``--timing-cpu``, default the last this process may use):
unpinned, the control sat as far from stock as tiered did in host-bound rows (H200, f6ca16a). A row's variants compile
beside the same neighbours; first_call_beside counts them (0: alone) and the note says so. With K > 1 a tiered worker's
tuning (a fresh store's misses, measured before its row is timed) times its candidates beside the batch's other
compiles, as the rows' notes say; ``--tune-alone`` compiles each tiered variant alone instead, at the price of its
row's equal neighbours and of time (the tiered compiles one at a time).

Columns: graph_breaks (``sum(counters["graph_break"].values())`` of the worker after timing; the reasons are in note),
recompiles (frames dynamo compiled after the first call: during warm-up and timing; torch 2.13 keeps no
recompile counter of its own), graphs (``counters["stats"]
["unique_graphs"]``), cudagraph_skips (``counters["inductor"]["cudagraph_skips"]``: graphs a CUDA-graph mode ran
without them), first_call_s, rel_err, probe_us (a fixed host workload's median us in the worker before each
timing request, compiled_worker.Probe: a host-bound row's gap beside its host's), ms p50/p20/p80 of all timed calls,
verdict against stock (and against stock-copy where it runs, models_rows' rules: faster/slower only beyond the spread
with every round agreeing), store (fresh, or carried with ``--store``: "had" when the file held a store when the
worker started), pid (the worker's).
The counters are the worker's whole process: torch.compile calls made by tiered_ops' own tuning in that process count
too (their reasons show in note). A worker that raises or dies is a row with its error, never a skip. Verdicts
compare only the rounds of one row: host-bound rows (decode) on a GPU host's noisy CPU say nothing across rows or runs.

Modes: default and reduce-overhead for every config; max-autotune and max-autotune-no-cudagraphs also for the config
marked so, in the workloads of ``--autotune-workloads`` (default decode: on the H200 one variant's GEMM search took
37 s for gpt2-medium's decode, 108-138 s for its prefill, and a training step searches three GEMMs per linear layer;
``--modes`` runs the listed ones for every config and workload instead). Workloads: prefill (1 x seq), decode (batch x 1
token, no KV cache, as benchmarks/models.py), train (forward, LM loss, backward; from no gradients each step).

Carried state: ``--store PATH`` makes every tiered worker use PATH (created on first use) instead of a fresh store, so a
rerun finds its decisions (its rows say "carried"); Inductor's cache is the caller's: point TORCHINDUCTOR_CACHE_DIR
(and TRITON_CACHE_DIR) at a kept folder and a rerun's first calls load compiled code instead of compiling it
(first_call_s then measures a warm cache; the header says how many files each folder held at the start). Each variant
has a folder of its own inside them (``compiled_schedule.own_caches``): no first call loads what another variant of
its row compiled before it. Rows are
written as they finish (compiled_models.csv and .md in --out-dir, with compiled_models_events.csv), ``--deadline-s``
starts no batch that the longest batch so far would carry past it, so a cut run keeps what it finished, and ``--done
CSV`` (that run's compiled_models.csv) keeps its finished rows and runs only the rest. ``--part I/N`` runs the I-th of N
parts of the plan (each a share of every config, mode and workload; N calls cover the plan once).

Where a row's time goes, H200 figures from benchmarks/models.py (reports/nvidia-h200/models/*.log: torch 2.11, 8B
dimensions and GPT-2 small, 2 layers, default mode, each variant "prepared" in one process: tuning, compiling, warm-up):
a worker's start (spawn, imports, the model's build, the stock eager step; not measured on the H200; ~13 s from spawn to
ready for the tiny rows on this project's 2 shared CPU cores); stock's compile and first call 3-9 s for decode and
prefill, 18-21 s for training; tiered's, with the tuning its trace queued from a fresh store, 8-13 s and 31-49 s; the
warm-up (3 calls, plus reduce-overhead's CUDA-graph recording: not measured); 5 interleaved rounds 1-5 s. One row alone
(``--parallel 1``, each variant's compile alone) so takes ~25-90 s (Llama's decode, prefill, training: 14, 18, 75 s plus
a start each): at their mean, ~49 s, the rows need ~30 min and more, past the ~25 usable minutes of 3 calls. Batched by
4 (``--parallel 4``), measured on the H200 at 4594371 with two variants a row (reports/nvidia-h200/tree-4594371): a
batch of default or reduce-overhead rows took 94-111 s from its workers' start to its last timed call (starts ~10 s,
compiles 13-51 s at once, then the rows' timing); the GPU-searching rows compile alone (stock's max-autotune decode
37 s, max-autotune-no-cudagraphs prefill 138 s). With the control in every row a batch holds up to 12 workers (1
compile thread each on 16 cores); with it in the inference rows only, a third of the plan took 274-306 s (9d6ee93).
Each third of the plan holds 10 default or reduce-overhead rows and one or two GPU-searching decode rows; a call cut by
its deadline leaves the rest to a fourth call with ``--done``.

The plan of calls (scripts/gpu.sh; the stage ends batches by DEADLINE - RESERVE, then packs the compile caches (at most
40 s) and the files; each part's caches in a folder of their own, so its first calls start from an empty cache and a
rerun of that part, on the same machine or with the folder carried, finds them):

    COMPILED_MODELS_CACHE_DIR=/tmp/cmcache-1 COMPILED_MODELS_ARGS="--part 1/3 --parallel 4" DEADLINE=560 RESERVE=55 \\
        bash scripts/gpu.sh build compiledmodels
    COMPILED_MODELS_CACHE_DIR=/tmp/cmcache-2 COMPILED_MODELS_ARGS="--part 2/3 --parallel 4" DEADLINE=560 RESERVE=55 \\
        bash scripts/gpu.sh build compiledmodels
    COMPILED_MODELS_CACHE_DIR=/tmp/cmcache-3 COMPILED_MODELS_ARGS="--part 3/3 --parallel 4" DEADLINE=560 RESERVE=55 \\
        bash scripts/gpu.sh build compiledmodels

(``build``: the CUDA extension, built once a machine: its first build took 36 s on the H200.) A call that ended with
"deadline:" or was cut: take compiled_models/compiled_models.csv out of its logs.tar.gz (logs-small.tar.gz where that
was too large to come back), join its compiled_cache.tar.xz.part* into compiled_cache.tar.xz, and carry them; one
more call runs every row the three left, from their three CSVs: ``COMPILED_MODELS_ARGS="--parallel 4
--done 1.csv --done 2.csv --done 3.csv"`` (the finished rows are copied into its output, the rest run; with
COMPILED_MODELS_CACHE_DIR=/tmp/cmcache-4 their first calls start from an empty cache), or one part's rest with ``--part
I/3 --done I.csv`` and ``COMPILED_MODELS_CACHE=compiled_cache.tar.xz`` (its new rows' first calls then load what the cut
call compiled: the header says how many files the caches held).

    python benchmarks/compiled_models.py --out-dir /tmp/cm                        # GPU: the whole matrix, row by row
    python benchmarks/compiled_models.py --part 2/3 --parallel 4 --out-dir /tmp/cm   # GPU: one third, batched by 4
    python benchmarks/compiled_models.py --configs gpt2-medium-2l --modes max-autotune --workloads train
    python benchmarks/compiled_models.py --quick --configs llama-tiny --workloads prefill --out-dir /tmp/cm  # CPU
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.compiled_schedule import CONTROL, EVENT_COLUMNS, NEXT, compile_threads, run_batch, variants  # noqa: E402
from benchmarks.models import _commit  # noqa: E402
from benchmarks.models_rows import save  # noqa: E402

MODES = ("default", "reduce-overhead")
MORE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")  # for the config marked ``autotune``
WORKLOADS = ("prefill", "decode", "train")
COLUMNS = ("config", "family", "dtype", "mode", "workload", "shape", "variant", "ms_p50", "ms_p20", "ms_p80", "calls",
           "verdict", "rounds_slower", "verdict_vs_copy", "rounds_slower_vs_copy", "graph_breaks", "recompiles",
           "graphs", "cudagraph_skips", "first_call_s", "first_call_beside", "rel_err", "probe_us", "store", "pid",
           "error", "note", "backend", "device", "torch", "transformers")
_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _cfg(family: str, kwargs: dict, dtype: str, seq: int, batch: int, autotune: bool = False) -> dict[str, Any]:
    cls = {"llama": "Llama", "qwen3": "Qwen3", "qwen2": "Qwen2", "mistral": "Mistral", "gpt2": "GPT2"}[family]
    model_cls = "GPT2LMHeadModel" if family == "gpt2" else f"{cls}ForCausalLM"
    pos = {"n_positions": max(1024, seq)} if family == "gpt2" else {"max_position_embeddings": max(8192, seq)}
    return dict(family=family, model_cls=model_cls, config_cls=f"{cls}Config", kwargs={**kwargs, **pos}, dtype=dtype,
                seq=seq, batch=batch, autotune=autotune)


def configs(quick: bool) -> dict[str, dict[str, Any]]:
    """name -> config: 2 layers each, dimensions of released models, bf16 and fp16, vocabularies 32000-151936, its
    prefill/train sequence length and decode batch. ``quick``: tiny ones for the CPU."""
    if quick:
        tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128)
        return {"llama-tiny": _cfg("llama", tiny, "bf16", 16, 2),
                "qwen3-tiny": _cfg("qwen3", {**tiny, "head_dim": 16}, "fp16", 16, 2),
                "gpt2-tiny": _cfg("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=0,
                                               eos_token_id=0, **_NO_DROPOUT), "bf16", 16, 2, autotune=True)}
    two = dict(num_hidden_layers=2)
    return {
        "llama3-3b-dims-2l": _cfg("llama", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                                                num_key_value_heads=8, vocab_size=128256, **two), "bf16", 2048, 8),
        "qwen3-4b-dims-2l": _cfg("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                                               num_key_value_heads=8, head_dim=128, vocab_size=151936, **two),
                                 "fp16", 1024, 16),
        "mistral-7b-dims-2l": _cfg("mistral", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                                   num_key_value_heads=8, vocab_size=32000, **two), "bf16", 4096, 4),
        "qwen2-1.5b-dims-2l": _cfg("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                                 num_key_value_heads=2, vocab_size=151936, **two), "fp16", 512, 32),
        "gpt2-medium-2l": _cfg("gpt2", dict(n_embd=1024, n_layer=2, n_head=16, vocab_size=50257, **_NO_DROPOUT),
                               "bf16", 1024, 8, autotune=True),
    }


def plan(args: argparse.Namespace) -> list[tuple[str, dict, str, str, str]]:
    """(config name, config, dtype, mode, workload) of every row of the call's part, in order. ``--part I/N``: row k of
    the whole plan goes to part (k + k // N) mod N + 1: the parts take turns, the first turn moving on by one every N
    rows, so N parts cover the plan once, each a share of every config, mode and workload (plain turns with N = 3
    would give one part every prefill row, another every training row: the plan's workloads come in threes)."""
    i, n = args.part
    return [row for k, row in enumerate(_plan(args)) if (k + k // n) % n == i - 1]


def _plan(args: argparse.Namespace) -> Iterator[tuple[str, dict, str, str, str]]:
    table = configs(args.quick)
    names = args.configs.split(",") if args.configs else list(table)
    for name in names:
        if name not in table:
            raise SystemExit(f"unknown config {name!r}; known: {', '.join(table)}")
        cfg = table[name]
        modes = (args.modes.split(",") if args.modes else ["default"] if args.backend != "inductor"
                 else [*MODES, *(MORE_MODES if cfg["autotune"] else ())])
        for dtype in (args.dtypes.split(",") if args.dtypes else [cfg["dtype"]]):
            for mode in modes:
                for workload in args.workloads.split(","):
                    if args.modes or mode not in MORE_MODES or workload in args.autotune_workloads.split(","):
                        yield name, cfg, dtype, mode, workload


def render(rows: list[dict], head: list[str]) -> str:
    out = ["# Compiled-model matrix", "", *head, "",
           "| config | dtype | mode | workload | variant | median ms | p20-p80 ms | vs stock | verdict | rounds slower "
           "| breaks | recompiles | graphs | cg skips | first call s | beside | rel err | host probe us | store "
           "| error / note |",
           "|---|---|---|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        stock = next((s for s in rows if s["variant"] == "stock" and s.get("ms_p50") and all(
            s[k] == r[k] for k in ("config", "dtype", "mode", "workload"))), None)
        speed = f"{stock['ms_p50'] / r['ms_p50']:.2f}x" if stock and r.get("ms_p50") else ""
        sp = f"{r['ms_p20']}-{r['ms_p80']}" if r.get("ms_p50") else ""
        err = f"**failed: {r['error']}**" if r.get("error") else r.get("note", "")
        out.append(f"| {r['config']} | {r['dtype']} | {r['mode']} | {r['workload']} {r['shape']} | {r['variant']} "
                   f"| {r.get('ms_p50', '')} | {sp} | {speed} | {r.get('verdict', '')} | {r.get('rounds_slower', '')} "
                   f"| {r.get('graph_breaks', '')} | {r.get('recompiles', '')} | {r.get('graphs', '')} "
                   f"| {r.get('cudagraph_skips', '')} "
                   f"| {r.get('first_call_s', '')} | {r.get('first_call_beside', '')} | {r.get('rel_err', '')} "
                   f"| {r.get('probe_us', '')} | {r.get('store', '')} | {err} |")
    return "\n".join(out) + "\n"


def write(rows: list[dict], out: Path, head: list[str], events: list[dict] | None = None) -> None:
    """The rows as compiled_models.csv and .md; ``events`` (each worker request's span): compiled_models_events.csv."""
    save(rows, out, "compiled_models", COLUMNS, render(rows, head))
    if events is not None:
        with open(out / "compiled_models_events.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(EVENT_COLUMNS))
            w.writeheader()
            w.writerows(events)


def _key(r: dict) -> tuple[str, str, str, str]:
    return r["config"], r["dtype"], r["mode"], r["workload"]


def finished(path: str, wanted: list[str] | Callable[[dict], list[str]]) -> list[dict]:
    """The rows of an earlier run's compiled_models.csv whose key (config, dtype, mode, workload) has a timed row of
    every one of the variants ``wanted`` (a list, or a function of the row): what a later call need not run again (a
    row with an error runs again)."""
    of = wanted if callable(wanted) else lambda r: wanted
    with open(path, newline="") as f:
        old = list(csv.DictReader(f))
    timed = {(_key(r), r["variant"]) for r in old if r.get("ms_p50") and not r.get("error")}
    whole = {_key(r) for r in old if all((_key(r), v) in timed for v in of(r))}
    return [dict(r, **{k: float(r[k]) for k in ("ms_p50", "ms_p20", "ms_p80")}) for r in old
            if _key(r) in whole and r["variant"] in of(r)]


def _held(var: str) -> str:
    """`` (N files at the start)`` for a cache folder named by ``var``, or nothing."""
    d = os.environ.get(var)
    return f" ({sum(len(f) for *_, f in os.walk(d))} files at the start)" if d and Path(d).is_dir() else ""


def _how(args: argparse.Namespace) -> str:
    if args.parallel <= 1:
        return "one at a time"
    return f"at once (max-autotune modes{' and tiered variants' * args.tune_alone} alone, one at a time)"


def _part(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise argparse.ArgumentTypeError(f"--part wants I/N with 1 <= I <= N, got {text!r}")
    return int(i), int(n)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", help="comma-separated config names (default: every one)")
    p.add_argument("--dtypes", help="comma-separated, of bf16, fp16, fp32 (default: each config's own)")
    p.add_argument("--modes", help="comma-separated torch.compile modes for every config (default: default and "
                   "reduce-overhead, and max-autotune, max-autotune-no-cudagraphs for the config marked so; default "
                   "alone with a backend other than inductor)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--autotune-workloads", default="decode", help="the workloads of the GPU-searching modes "
                   "(max-autotune, max-autotune-no-cudagraphs) of the config marked so (default decode; --modes "
                   "overrides)")
    p.add_argument("--variants", help=f"comma-separated, of stock, {CONTROL}, tiered, {NEXT} (patched in a process "
                   "of its own that reads the store the row's tiered variant tuned: what the next run compiles); auto: "
                   f"stock, {CONTROL} and tiered (default; stock,tiered in the GPU-searching modes and with --quick)")
    p.add_argument("--rounds", type=int, help="interleaved rounds per row (default 5; 2 with --quick)")
    p.add_argument("--reps", type=int, help="calls per variant and round (default 10; 2 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (default 3; 1 with --quick)")
    p.add_argument("--settle-s", type=float, default=120.0,
                   help="a tiered worker waits at most this for the background tuning its trace queued before it is "
                   "timed, so no measurement shares the GPU with the timed calls (default 120)")
    p.add_argument("--min-round-ms", type=float, help="each variant's calls per round span at least this many ms "
                   "(more calls than --reps on a fast row, at most 20x; default 100; 0 with --quick)")
    p.add_argument("--out-dir", help="where compiled_models.csv and .md go (default reports/<gpu>/compiled_models)")
    p.add_argument("--store", help="a carried tiered_ops store every tiered worker uses (default: a fresh one each)")
    p.add_argument("--quick", action="store_true", help="CPU smoke: tiny configs, backend eager, 2 rounds of 2 calls, "
                   "TIERED_OPS_TUNE=0 unless set (measuring every tier on a CPU takes minutes)")
    p.add_argument("--device", help="default: cuda when there is one (cpu with --quick)")
    p.add_argument("--backend", help="torch.compile backend (default inductor; eager with --quick)")
    p.add_argument("--part", type=_part, default=(1, 1), metavar="I/N",
                   help="the I-th of N parts of the plan (row k in part (k + k // N) mod N + 1: each a share of "
                   "every config, mode and workload): N calls cover it once")
    p.add_argument("--done", metavar="CSV", action="append", default=[],
                   help="an earlier call's compiled_models.csv (repeatable): its rows timed for every variant are kept "
                   "as they are and not run again (a cut call's rerun does only the rest)")
    p.add_argument("--parallel", type=int, default=1, metavar="K",
                   help="rows per batch: their workers start and compile at once, then each row is timed alone "
                   "(default 1)")
    p.add_argument("--tune-alone", action="store_true",
                   help="with --parallel above 1: each tiered variant compiles (and tunes) alone, after the batch's "
                   "other compiles, so that no tuning times kernels beside a compile (slower: the tiered compiles run "
                   "one at a time)")
    p.add_argument("--deadline-s", type=float, help="start no batch after this many seconds from the start, nor one "
                   "that the longest batch so far would carry past it")
    p.add_argument("--timing-cpu", default="auto", help="the CPU every worker's calling thread runs on from its "
                   "warm-up on, so a host-bound row's variants are timed on one core: auto (the last this process may "
                   "use; none where the OS cannot pin), none, or a CPU number")
    p.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds a worker may take to answer")
    p.add_argument("--inject-failure", action="append", default=[], metavar="VARIANT:WORKLOAD:HOW",
                   help="test hook: that variant's worker fails when asked to compile (HOW: raise, or exit: it dies)")
    args = p.parse_args(argv)
    q = args.quick
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not q else "cpu")
    args.rounds, args.reps = args.rounds or (2 if q else 5), args.reps or (2 if q else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 3)
    args.min_round_ms = args.min_round_ms if args.min_round_ms is not None else (0.0 if q else 100.0)
    args.backend = args.backend or ("eager" if q else "inductor")
    args.variants = args.variants or ("stock,tiered" if q else "auto")
    named = set(args.variants.split(","))
    if args.variants != "auto" and not named <= {"stock", CONTROL, "tiered", NEXT}:
        p.error(f"--variants: {', '.join(sorted(named - {'stock', CONTROL, 'tiered', NEXT}))}: not a variant")
    if NEXT in named and "tiered" not in named:
        p.error(f"--variants: {NEXT} reads the store the row's tiered variant tunes: name tiered too")
    args.store = str(Path(args.store).resolve()) if args.store else None
    args.timing_cpu = _timing_cpu(p, args.timing_cpu)
    return args


def _timing_cpu(p: argparse.ArgumentParser, value: str) -> int | None:
    """--timing-cpu as a CPU number, or None (unpinned)."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if value == "none" or (value == "auto" and not mine):
        return None
    if value == "auto":
        return mine[-1]
    if not value.isdigit() or (mine and int(value) not in mine):
        p.error(f"--timing-cpu: {value!r}: expected auto, none or one of the CPUs this process may use "
                f"({', '.join(map(str, mine)) or 'the OS pins none'})")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = parse(argv)
    if args.quick:
        os.environ.setdefault("TIERED_OPS_TUNE", "0")
    import transformers

    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out = Path(args.out_dir or f"reports/{gpu.lower().replace(' ', '-')}/compiled_models")
    common = dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__, backend=args.backend)
    var = "TORCHINDUCTOR_COMPILE_THREADS"
    threads = compile_threads(args).get(var, os.environ.get(var))
    head = [f"`python benchmarks/compiled_models.py {' '.join(sys.argv[1:] if argv is None else argv)}` at commit "
            f"{_commit()} on {gpu}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch "
            f"{torch.__version__}, transformers {transformers.__version__}; TIERED_OPS_TUNE="
            f"{os.environ.get('TIERED_OPS_TUNE', '(unset)')}, TORCHINDUCTOR_CACHE_DIR="
            f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(unset)')}{_held('TORCHINDUCTOR_CACHE_DIR')}, "
            f"TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '(unset)')}{_held('TRITON_CACHE_DIR')}.",
            f"Each variant compiled in a process of its own; {args.parallel} row(s) a batch, their workers started "
            f"together, then compiled {_how(args)}"
            f", then timed one row at a time ('beside': the other compiles a first call ran beside"
            f"{f'; {var}={threads}' if threads else ''}); "
            f"{args.rounds} interleaved rounds of at least {args.reps} "
            f"calls (order rotated), after {args.warmup} warm-up calls"
            f"{'' if args.timing_cpu is None else f', each worker calling from CPU {args.timing_cpu} from then on'}"
            ". Breaks: dynamo's graph_break counter of the "
            "worker; recompiles: frames compiled after the first call. Verdict (models_rows): faster/slower only "
            "beyond the spread with every round agreeing. Rel err: the compiled first step against the stock eager "
            "step, float32."]
    rows: list[dict] = []
    events: list[dict] = []

    def done(new: list[dict], spans: list[dict]) -> None:
        rows.extend(new)
        events.extend(spans)
        write(rows, out, head, events)

    keys, k, longest = plan(args), max(1, args.parallel), 0.0
    if args.done:
        mine = {(key[0], *key[2:]): key for key in keys}  # (config, dtype, mode, workload), as _key
        for path in args.done:
            rows += [r for r in finished(path, lambda r: variants(args, r["workload"], r["mode"])) if _key(r) in mine
                     and _key(r) not in {_key(x) for x in rows if x["variant"] == r["variant"]}]
        keys = [key for k4, key in mine.items() if k4 not in {_key(r) for r in rows}]
        head.append(f"{len(rows)} rows taken from {', '.join(args.done)} (finished by earlier calls); {len(keys)} "
                    "rows run.")
    try:
        for b in range(0, len(keys), k):
            now = time.monotonic() - t0
            if args.deadline_s is not None and now + longest > args.deadline_s:
                key = keys[b]
                print(f"deadline: {key[0]} {key[2]} {key[3]} {key[4]} and later rows not started ({now:.0f} s gone, "
                      f"the longest batch took {longest:.0f} s)", file=sys.stderr)
                break
            run_batch(keys[b:b + k], args, common, done)
            longest = max(longest, time.monotonic() - t0 - now)
    except KeyboardInterrupt:
        write(rows, out, head, events)
        print(f"interrupted: wrote {len(rows)} rows to {out / 'compiled_models.csv'}", file=sys.stderr)
        return 130
    write(rows, out, head, events)
    print(f"wrote {out / 'compiled_models.csv'} and {out / 'compiled_models.md'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
