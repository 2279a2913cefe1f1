"""Compiled-model matrix: stock transformers against ``tiered_ops.patch`` in the natural flow (patch -> torch.compile
-> call, from a fresh store), each compiled model in a process of its own, graph breaks and recompiles counted per row.

A row is (config, dtype, compile mode, workload). Each of its variants (stock; tiered = ``tiered_ops.patch(model)``;
optionally stock-copy, an unpatched second stock, the control) runs in a worker process of its own
(benchmarks/compiled_worker.py, multiprocessing spawn): two compiled instances of one class in one process share
dynamo's cache (inlined modules are not guarded by identity), so compiling variants side by side would measure the
cache. A worker builds the model from the config (seed 0, the same inputs in every worker), runs one stock eager step
(the reference: the rel err column compares its compiled first step with it, float32), patches (tiered), compiles with
plain ``torch.compile(model, mode=...)`` (fullgraph not forced: breaks are what is counted), makes the first call
(first_call_s: tracing, compiling and, for tiered, whatever a miss costs), warms up, then serves timing requests. The
row's workers start together (imports and builds overlap) but compile one at a time, so a first call is never timed
beside another's compile; the parent then interleaves timing rounds between them (A, B, A, B, ..., the order rotated
per round), so each compiled model lives in its own process and the comparison is interleaved all the same.

Columns: graph_breaks (``sum(counters["graph_break"].values())`` of the worker after timing; the reasons are in note),
recompiles (frames dynamo compiled after the first call: during warm-up and timing; torch 2.13 keeps no
recompile counter of its own), graphs (``counters["stats"]
["unique_graphs"]``), cudagraph_skips (``counters["inductor"]["cudagraph_skips"]``: graphs a CUDA-graph mode ran
without them), first_call_s, rel_err, ms p50/p20/p80 of all timed calls, verdict against stock (and against
stock-copy where it runs, models_rows' rules: faster/slower only beyond the spread with every round agreeing), store
(fresh, or carried with ``--store``: "had" when the file held a store when the worker started), pid (the worker's).
The counters are the worker's whole process: torch.compile calls made by tiered_ops' own tuning in that process count
too (their reasons show in note). A worker that raises or dies is a row with its error, never a skip. Verdicts
compare only the rounds of one row: host-bound rows (decode) on a GPU host's noisy CPU say nothing across rows or runs.

Modes: default and reduce-overhead for every config; max-autotune and max-autotune-no-cudagraphs also for the config
marked so (``--modes`` runs the listed ones for every config instead). Workloads: prefill (1 x seq), decode (batch x 1
token, no KV cache, as benchmarks/models.py), train (forward, LM loss, backward; from no gradients each step).

Carried state: ``--store PATH`` makes every tiered worker use PATH (created on first use) instead of a fresh store, so a
rerun finds its decisions (its rows say "carried"); Inductor's cache is the caller's: point TORCHINDUCTOR_CACHE_DIR
(and TRITON_CACHE_DIR) at a kept folder and a rerun's first calls load compiled code instead of compiling it
(first_call_s then measures a warm cache). Rows are written as they finish (compiled_models.csv and .md in --out-dir),
and ``--deadline-s`` stops starting rows past it, so a cut run keeps what it finished.

GPU time, an estimate (not measured with this file): on the H200, benchmarks/models.py's in-process compiles of
stock 8B-dimension 2-layer models (Inductor, default mode) took 4-6 s for decode, 13 s for prefill and 21-22 s for
training, and 5 timed rounds 2-5 s (reports/nvidia-h200/models/*.log); a row here pays that per variant, plus each
worker's start (imports, build, the eager reference step) and, for tiered from a fresh store, its tuning on a miss (the
CUDA extension's first build took 36 s there, once per machine). Reckon about a minute per default-mode row, more
with reduce-overhead's recording and minutes for max-autotune's GEMM search: the 36 rows of the full plan do not fit
one 10-minute call; run a config (or a mode) per call, with --store and TORCHINDUCTOR_CACHE_DIR carried so a rerun
repeats little. In scripts/gpu.sh: the stage compiledmodels (COMPILED_MODELS_ARGS, COMPILED_MODELS_CARRY).

    python benchmarks/compiled_models.py --out-dir /tmp/cm                        # GPU: the whole matrix
    COMPILED_MODELS_ARGS="--configs qwen2-1.5b-dims-2l" bash scripts/gpu.sh compiledmodels   # one config a call
    python benchmarks/compiled_models.py --configs gpt2-medium-2l --modes max-autotune --workloads train
    python benchmarks/compiled_models.py --quick --configs llama-tiny --workloads prefill --out-dir /tmp/cm  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.compiled_worker import serve  # noqa: E402
from benchmarks.models import _commit  # noqa: E402
from benchmarks.models_rows import agreed, rounds_slower, save, spread, verdict  # noqa: E402

MODES = ("default", "reduce-overhead")
MORE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")  # for the config marked ``autotune``
WORKLOADS = ("prefill", "decode", "train")
CONTROL = "stock-copy"
COLUMNS = ("config", "family", "dtype", "mode", "workload", "shape", "variant", "ms_p50", "ms_p20", "ms_p80", "calls",
           "verdict", "rounds_slower", "verdict_vs_copy", "rounds_slower_vs_copy", "graph_breaks", "recompiles",
           "graphs", "cudagraph_skips", "first_call_s", "rel_err", "store", "pid", "error", "note", "backend", "device",
           "torch", "transformers")
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


def plan(args: argparse.Namespace) -> Iterator[tuple[str, dict, str, str, str]]:
    """(config name, config, dtype, mode, workload) of every row, in order."""
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
                    yield name, cfg, dtype, mode, workload


class WorkerError(Exception):
    pass


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """os.environ with ``values`` while a worker is spawned (a spawned process takes the parent's environment)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Worker:
    """One variant's process, seen from the parent."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        with _env(env):
            self.proc = ctx.Process(target=serve, args=(child, spec), name=f"compiled-{spec['variant']}")
            self.proc.start()
        child.close()

    def ask(self, msg: tuple | None, timeout: float) -> Any:
        if msg is not None:
            self.conn.send(msg)
        if not self.conn.poll(timeout):
            self.stop()
            raise WorkerError(f"{(msg or ('start',))[0]}: no answer in {timeout:.0f} s (worker stopped)")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise WorkerError(f"{(msg or ('start',))[0]}: the worker died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise WorkerError(value)
        return value

    def stop(self, wait: float = 10.0) -> None:
        """Asks the worker to end, then kills it if it has not within ``wait`` seconds (0: only ask)."""
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(("stop",))
        if wait:
            self.proc.join(wait)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)


def run_row(key: tuple[str, dict, str, str, str], args: argparse.Namespace, common: dict) -> list[dict]:
    """Every variant of one row: its workers started together, compiled one at a time, timed in interleaved rounds."""
    name, cfg, dtype, mode, workload = key
    shape = (cfg["batch"], 1) if workload == "decode" else (1, cfg["seq"])
    rows: dict[str, dict] = {}
    workers: dict[str, Worker] = {}
    tmp = Path(tempfile.mkdtemp(prefix="compiled_models_"))
    try:
        for v in args.variants.split(","):
            rows[v] = dict(common, config=name, family=cfg["family"], dtype=dtype, mode=mode, workload=workload,
                           shape="x".join(map(str, shape)), variant=v)
            fail = next((f.split(":")[2] for f in args.inject_failure
                         if f.split(":")[:2] == [v, workload]), "")
            spec = dict(config=cfg, dtype=dtype, mode=mode, workload=workload, variant=v, shape=shape,
                        device=args.device, backend=args.backend, warmup=args.warmup, settle_s=args.settle_s,
                        carried=bool(args.store),
                        fail=fail)
            store = args.store or str(tmp / f"{v}.sqlite")  # fresh: a new file per worker
            workers[v] = Worker(spec, {"TIERED_OPS_DB": store})
        alive: dict[str, Worker] = {}
        for v, w in workers.items():
            try:
                info = w.ask(None, args.worker_timeout)
                rows[v].update(store=info["store"], pid=info["pid"])
                alive[v] = w
            except WorkerError as e:
                rows[v]["error"] = str(e)
        first: dict[str, dict] = {}
        for v, w in list(alive.items()):
            try:
                first[v] = r = w.ask(("compile",), args.worker_timeout)
            except WorkerError as e:
                rows[v]["error"] = str(e)
                del alive[v]
                continue
            rows[v].update(first_call_s=round(r["first_call_s"], 2), rel_err=f"{r['rel_err']:.3e}", note=r["note"])
            print(f"{name} {dtype} {mode} {workload} {v}: first call {r['first_call_s']:.1f} s, "
                  f"{r['graph_breaks']} graph breaks, rel err {r['rel_err']:.2e}", file=sys.stderr, flush=True)
        reps = args.reps
        if alive and args.min_round_ms:  # a fast row takes more calls per round (the same for every variant)
            warm = statistics.median(r["warm_ms"] for v, r in first.items() if v in alive)
            reps = max(reps, min(args.reps * 20, math.ceil(args.min_round_ms / max(warm, 1e-3))))
        samples: dict[str, list[list[float]]] = {v: [] for v in alive}
        last = {v: first[v] for v in alive}
        for rnd in range(args.rounds):
            order = list(alive)
            for v in order[rnd % max(len(order), 1):] + order[:rnd % max(len(order), 1)]:
                try:
                    last[v] = r = alive[v].ask(("time", reps), args.worker_timeout)
                except WorkerError as e:
                    rows[v]["error"] = f"during timing: {e}"
                    del alive[v]
                    continue
                samples[v].append(r["ms"])
        for v, r in last.items():
            reasons = "; ".join(r["reasons"])
            late = r["frames"] - first[v]["frames_first"]
            rows[v].update(graph_breaks=r["graph_breaks"], recompiles=late, graphs=r["graphs"],
                           cudagraph_skips=r["cudagraph_skips"])
            rows[v]["note"] = "; ".join(x for x in (rows[v].get("note", ""), reasons and f"breaks: {reasons}") if x)
        _verdicts(rows, {v: s for v, s in samples.items() if v in alive and s})
    finally:  # every worker asked at once, then 10 s for them all: a run cut by SIGINT is killed 15 s later
        for w in workers.values():
            w.stop(wait=0)
        end = time.monotonic() + 10
        for w in workers.values():
            w.stop(wait=max(0.1, end - time.monotonic()))
        shutil.rmtree(tmp, ignore_errors=True)
    return list(rows.values())


def _verdicts(rows: dict[str, dict], samples: dict[str, list[list[float]]]) -> None:
    stats = {v: spread([t for rnd in s for t in rnd]) for v, s in samples.items()}
    for v, (p50, p20, p80) in stats.items():
        rows[v].update(ms_p50=round(p50, 4), ms_p20=round(p20, 4), ms_p80=round(p80, 4),
                       calls=sum(map(len, samples[v])))
        n = len(samples[v])
        for ref, suffix in (("stock", ""), (CONTROL, "_vs_copy")):
            if ref in stats and v not in ("stock", ref) and len(samples[ref]) == n:
                k = rounds_slower(samples[v], samples[ref])
                rows[v].update({f"rounds_slower{suffix}": f"{k}/{n}", f"verdict{suffix}": verdict(stats[v], stats[ref],
                                                                                                k, n)})
        if rows[v].get("verdict") and rows[v].get("verdict_vs_copy"):
            rows[v]["verdict"] = agreed(rows[v]["verdict"], rows[v]["verdict_vs_copy"])
        r = rows[v]
        print(f"  {v:10s} {p50:10.3f} ms ({p20:.3f}-{p80:.3f}) {r.get('verdict', '')} {r.get('rounds_slower', '')} "
              f"breaks {r.get('graph_breaks')} recompiles {r.get('recompiles')}", file=sys.stderr, flush=True)


def render(rows: list[dict], head: list[str]) -> str:
    out = ["# Compiled-model matrix", "", *head, "",
           "| config | dtype | mode | workload | variant | median ms | p20-p80 ms | vs stock | verdict | rounds slower "
           "| breaks | recompiles | graphs | cg skips | first call s | rel err | store | error / note |",
           "|---|---|---|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
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
                   f"| {r.get('first_call_s', '')} | {r.get('rel_err', '')} | {r.get('store', '')} | {err} |")
    return "\n".join(out) + "\n"


def write(rows: list[dict], out: Path, head: list[str]) -> None:
    save(rows, out, "compiled_models", COLUMNS, render(rows, head))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", help="comma-separated config names (default: every one)")
    p.add_argument("--dtypes", help="comma-separated, of bf16, fp16, fp32 (default: each config's own)")
    p.add_argument("--modes", help="comma-separated torch.compile modes for every config (default: default and "
                   "reduce-overhead, and max-autotune, max-autotune-no-cudagraphs for the config marked so; default "
                   "alone with a backend other than inductor)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--variants", default="stock,tiered", help=f"comma-separated, of stock, {CONTROL}, tiered")
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
    p.add_argument("--deadline-s", type=float, help="start no row after this many seconds from the start")
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
    args.store = str(Path(args.store).resolve()) if args.store else None
    return args


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
    head = [f"`python benchmarks/compiled_models.py {' '.join(sys.argv[1:] if argv is None else argv)}` at commit "
            f"{_commit()} on {gpu}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch "
            f"{torch.__version__}, transformers {transformers.__version__}; TIERED_OPS_TUNE="
            f"{os.environ.get('TIERED_OPS_TUNE', '(unset)')}, TORCHINDUCTOR_CACHE_DIR="
            f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(unset)')}.",
            f"Each variant compiled in a process of its own; {args.rounds} interleaved rounds of at least {args.reps} "
            f"calls (order rotated), after {args.warmup} warm-up calls. Breaks: dynamo's graph_break counter of the "
            "worker; recompiles: frames compiled after the first call. Verdict (models_rows): faster/slower only "
            "beyond the spread with every round agreeing. Rel err: the compiled first step against the stock eager "
            "step, float32."]
    rows: list[dict] = []
    try:
        for key in plan(args):
            if args.deadline_s is not None and time.monotonic() - t0 > args.deadline_s:
                print(f"deadline: {key[0]} {key[2]} {key[3]} {key[4]} and later rows not started", file=sys.stderr)
                break
            rows += run_row(key, args, common)
            write(rows, out, head)
    except KeyboardInterrupt:
        write(rows, out, head)
        print(f"interrupted: wrote {len(rows)} rows to {out / 'compiled_models.csv'}", file=sys.stderr)
        return 130
    write(rows, out, head)
    print(f"wrote {out / 'compiled_models.csv'} and {out / 'compiled_models.md'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
