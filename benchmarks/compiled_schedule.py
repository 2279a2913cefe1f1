"""The schedule of benchmarks/compiled_models.py: a batch of rows whose workers start, build and compile while nothing
is timed, then each row's interleaved timing rounds, one row at a time, with every worker of the batch idle.

A batch runs in three stages, each ended before the next begins:

1. start: every worker of every row of the batch is spawned at once (imports, the model's build and the stock eager
   reference step overlap; nothing is measured);
2. compile (patch, ``torch.compile``, the first call, and for tiered the wait for the tuning its trace queued): with one
   row a batch, each variant alone, one after another; with more, every variant of every row at once, except a row whose
   mode searches kernels by timing them on the GPU (``ALONE_MODES``), whose variants compile one at a time after the
   others, each with nothing else compiling, and with ``--tune-alone`` every tiered variant likewise (its tuning then
   times no kernel beside a compile, but its row's variants meet unequal neighbours). The number of other workers
   compiling while a variant's compile ran is its row's ``first_call_beside`` (0: alone), from the workers' own
   timestamps, and a note says so where it is not 0;
3. time, row after row: the row's warm-up calls, then its rounds (A, B, A, B, ..., the order rotated per round); no
   worker of the batch compiles or tunes then (the tiered workers' tuning was waited for in stage 2, then ended with
   its worker processes; jobs still pending after ``--settle-s`` were dropped, said in the worker's note and every
   row of its batch; a variant timed with child processes of its own alive says how many).

Every request's span (start, compile, warm, time) is kept as an event, written as compiled_models_events.csv: what
shows that no timed call ran beside a compile.
"""

from __future__ import annotations

import contextlib
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

from benchmarks.compiled_worker import serve
from benchmarks.models_rows import agreed, rounds_slower, spread, verdict

CONTROL = "stock-copy"
NEXT = "tiered-next"  # a second patched process reading the store the row's tiered worker tuned: the next run's graph
ALONE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")  # GEMM search: kernels timed on the GPU as it compiles
EVENT_COLUMNS = ("config", "dtype", "mode", "workload", "variant", "pid", "stage", "start", "end")


class WorkerError(Exception):
    pass


def variants(args: Any, workload: str, mode: str = "default") -> list[str]:
    """A row's variants: ``--variants``, or with ``auto`` stock, the control (``CONTROL``, a second unpatched stock in
    a process of its own) and tiered: one process's time differs from another's with the same code (host-bound steps:
    between two measuring workers, a factor with quartiles 0.77 and 1.30, benchmarks/PERF_LOG.md; a GPU-bound training
    step by a few per cent, its memory laid out by another process's allocations), so a verdict must also hold against
    the control's. Not in the GPU-searching modes (``ALONE_MODES``), whose variants compile one at a time (37 s and more
    each on the H200: their GEMM search times kernels on the GPU)."""
    if args.variants != "auto":
        named = args.variants.split(",")
        return [v for v in named if v != NEXT] + [NEXT] * (NEXT in named)  # NEXT compiles after tiered
    return ["stock", "tiered"] if mode in ALONE_MODES else ["stock", CONTROL, "tiered"]


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
        self.started = time.time()
        with _env(env):
            self.proc = ctx.Process(target=serve, args=(child, spec), name=f"compiled-{spec['variant']}")
            self.proc.start()
        child.close()

    def send(self, msg: tuple) -> None:
        self.conn.send(msg)

    def ask(self, msg: tuple | None, timeout: float, what: str = "start") -> Any:
        """``msg`` sent (None: nothing sent, the answer to an earlier request awaited), then its answer."""
        what = msg[0] if msg is not None else what
        if msg is not None:
            self.conn.send(msg)
        if not self.conn.poll(timeout):
            self.stop()
            raise WorkerError(f"{what}: no answer in {timeout:.0f} s (worker stopped)")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise WorkerError(f"{what}: the worker died (exit code {self.proc.exitcode})") from None
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


class Row:
    """One row's variants: their result rows, workers, first-call results and the events of their requests."""

    def __init__(self, key: tuple[str, dict, str, str, str], args: Any, common: dict, env: dict[str, str]) -> None:
        name, cfg, dtype, mode, workload = key
        self.key, self.mode = key, mode
        shape = (cfg["batch"], 1) if workload == "decode" else (1, cfg["seq"])
        self.rows: dict[str, dict] = {}
        self.workers: dict[str, Worker] = {}
        self.alive: dict[str, Worker] = {}
        self.first: dict[str, dict] = {}
        self.events: list[dict] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="compiled_models_"))
        for v in variants(args, workload, mode):
            self.rows[v] = dict(common, config=name, family=cfg["family"], dtype=dtype, mode=mode, workload=workload,
                                shape="x".join(map(str, shape)), variant=v)
            fail = next((f.split(":")[2] for f in args.inject_failure if f.split(":")[:2] == [v, workload]), "")
            spec = dict(config=cfg, dtype=dtype, mode=mode, workload=workload, variant=v, shape=shape,
                        device=args.device, backend=args.backend, warmup=args.warmup, settle_s=args.settle_s,
                        carried=bool(args.store), fail=fail, timing_cpu=args.timing_cpu)
            # fresh: a new file per worker; the next run's: the tiered worker's (compiled after it, see compile_all)
            store = args.store or str(self.tmp / f"{'tiered' if v == NEXT else v}.sqlite")
            self.workers[v] = Worker(spec, {**env, "TIERED_OPS_DB": store, **own_caches(v)})

    def event(self, v: str, stage: str, t0: float, t1: float) -> None:
        name, _, dtype, mode, workload = self.key
        self.events.append(dict(config=name, dtype=dtype, mode=mode, workload=workload, variant=v,
                                pid=self.rows[v].get("pid", ""), stage=stage, start=f"{t0:.3f}", end=f"{t1:.3f}"))

    def fail(self, v: str, e: Exception, prefix: str = "") -> None:
        self.rows[v]["error"] = f"{prefix}{e}"
        self.alive.pop(v, None)

    def ready(self, timeout: float) -> None:
        for v, w in self.workers.items():
            try:
                info = w.ask(None, timeout)
                self.rows[v].update(store=info["store"], pid=info["pid"])
                self.alive[v] = w
                self.event(v, "start", w.started, time.time())
            except WorkerError as e:
                self.fail(v, e)

    def compiled(self, v: str, r: dict) -> None:
        self.first[v] = r
        self.rows[v].update(first_call_s=round(r["first_call_s"], 2), rel_err=f"{r['rel_err']:.3e}", note=r["note"])
        self.event(v, "compile", r["t0"], r["t1"])
        name, _, dtype, mode, workload = self.key
        print(f"{name} {dtype} {mode} {workload} {v}: first call {r['first_call_s']:.1f} s, "
              f"{r['graph_breaks']} graph breaks, rel err {r['rel_err']:.2e}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Every worker asked at once, then 10 s for them all: a run cut by SIGINT is killed 15 s later."""
        for w in self.workers.values():
            w.stop(wait=0)
        end = time.monotonic() + 10
        for w in self.workers.values():
            w.stop(wait=max(0.1, end - time.monotonic()))
        shutil.rmtree(self.tmp, ignore_errors=True)


def compile_all(batch: list[Row], timeout: float, together: bool, tune_alone: bool = False) -> None:
    """Stage 2: ``together``: every variant of the batch's rows compiled at once, but a row of ``ALONE_MODES`` one
    variant at a time with nothing beside it, and with ``tune_alone`` every tiered variant too (after the others: its
    tuning times kernels with nothing compiling beside it; its row's first calls then meet unequal neighbours, which
    first_call_beside shows); else every variant alone, one after another. Then each variant's
    ``first_call_beside``."""
    def alone(row: Row, v: str) -> bool:
        return not together or row.mode in ALONE_MODES or (tune_alone and v.startswith("tiered")) or v == NEXT

    # NEXT after its row's tiered variant, whose tuning fills the store it reads: the alone ones run in the rows' order
    at_once = [(row, v) for row in batch for v in list(row.alive) if not alone(row, v)]
    for row, v in at_once:
        row.alive[v].send(("compile",))
    for row, v in at_once:
        try:
            row.compiled(v, row.alive[v].ask(None, timeout, "compile"))
        except WorkerError as e:
            row.fail(v, e)
    for row, v in [(row, v) for row in batch for v in list(row.alive) if alone(row, v)]:
        if v == NEXT and "tiered" not in row.alive:
            row.fail(v, WorkerError("its row's tiered variant failed: no store of its tuning to read"))
            continue
        try:
            row.compiled(v, row.alive[v].ask(("compile",), timeout))
        except WorkerError as e:
            row.fail(v, e)
    spans = [(row, v, r["t0"], r["t1"]) for row in batch for v, r in row.first.items()]
    for row, v, t0, t1 in spans:
        row.rows[v]["first_call_beside"] = sum(1 for o, u, s0, s1 in spans if (o, u) != (row, v) and s0 < t1
                                               and s1 > t0)


def time_row(row: Row, args: Any, pending: int) -> None:
    """Stage 3 for one row: warm-up, then interleaved rounds; counters, verdicts. ``pending``: tuning jobs still
    pending in the batch's workers (said in the note)."""
    warm: dict[str, float] = {}
    for v in list(row.alive):
        try:
            r = row.alive[v].ask(("warm",), args.worker_timeout)
        except WorkerError as e:
            row.fail(v, e, "during warm-up: ")
            continue
        warm[v] = r["warm_ms"]
        row.event(v, "warm", r["t0"], r["t1"])
    reps = args.reps
    if warm and args.min_round_ms:  # a fast row takes more calls per round (the same for every variant)
        reps = max(reps, min(args.reps * 20, math.ceil(args.min_round_ms / max(statistics.median(warm.values()),
                                                                                 1e-3))))
    samples: dict[str, list[list[float]]] = {v: [] for v in row.alive}
    probes: dict[str, list[float]] = {v: [] for v in row.alive}
    last = {v: row.first[v] for v in row.alive}
    for rnd in range(args.rounds):
        order = list(row.alive)
        k = rnd % max(len(order), 1)
        for v in order[k:] + order[:k]:
            try:
                last[v] = r = row.alive[v].ask(("time", reps), args.worker_timeout)
            except WorkerError as e:
                row.fail(v, e, "during timing: ")
                continue
            samples[v].append(r["ms"])
            probes[v].append(r["probe_us"])
            row.event(v, "time", r["t0"], r["t1"])
    for v, r in last.items():
        reasons = "; ".join(r["reasons"])
        late = r["frames"] - row.first[v]["frames_first"]
        row.rows[v].update(graph_breaks=r["graph_breaks"], recompiles=late, graphs=r["graphs"],
                           cudagraph_skips=r["cudagraph_skips"])
        beside = row.rows[v].get("first_call_beside")
        notes = (row.rows[v].get("note", ""), reasons and f"breaks: {reasons}",
                 beside and f"first call{' and its tuning' * v.startswith('tiered')} beside {beside} other compiles",
                 pending and f"{pending} tuning jobs of the batch dropped unmeasured at --settle-s",
                 r.get("children") and f"timed with {r['children']} child processes alive")
        row.rows[v]["note"] = "; ".join(x for x in notes if x)
    verdicts(row.rows, {v: s for v, s in samples.items() if v in row.alive and s})
    for v, pr in probes.items():
        if pr:  # the host probe's median over the rounds (Probe): beside ms, what the worker's host did
            row.rows[v]["probe_us"] = round(statistics.median(pr), 1)
    for v, text in host_notes({v: r["probe_us"] for v, r in row.rows.items() if r.get("probe_us")}).items():
        row.rows[v]["note"] = "; ".join(x for x in (row.rows[v].get("note", ""), text) if x)


HOST_APART = 1.25  # a worker's probe this far from stock's (either way) is said in its row's note


def host_notes(probe_us: dict[str, float]) -> dict[str, str]:
    """Each variant whose host probe (median us) is ``HOST_APART`` times stock's or more apart from it, with a note
    saying so: a host-bound row's gap there is its worker's host as much as its model's."""
    stock = probe_us.get("stock")
    if not stock:
        return {}
    out = {}
    for v, us in probe_us.items():
        if v != "stock" and max(us / stock, stock / us) >= HOST_APART:
            way = "slower" if us > stock else "faster"
            out[v] = (f"host probe {us / stock:.2f}x stock's ({us:.0f} against {stock:.0f} us): "
                      f"this worker's host ran {way}")
    return out


def own_caches(variant: str) -> dict[str, str]:
    """Inductor's and Triton's on-disk caches of ``variant``'s workers: a folder of its own inside each cache folder
    the caller set (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``), so that no variant's first call loads what
    another compiled before it (stock's and tiered's graphs are alike where tiered traces the decompositions: a
    max-autotune row's second variant would load the first's kernels and GEMM search); a rerun still finds its own."""
    return {k: os.path.join(os.environ[k], variant) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
            if os.environ.get(k)}


def compile_threads(args: Any) -> dict[str, str]:
    """With several rows a batch and no TORCHINDUCTOR_COMPILE_THREADS set, each worker's Inductor gets the host's cores
    shared out (at least 1), so that the batch's compiles together never start more compile processes than cores."""
    if args.parallel <= 1 or os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"):
        return {}
    cores = len(os.sched_getaffinity(0))  # the cores this process may run on, not the host's
    most = max(len(variants(args, w)) for w in ("prefill", "train"))
    return {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, cores // (args.parallel * most)))}


def run_batch(keys: list[tuple[str, dict, str, str, str]], args: Any, common: dict,
              done: Any = None) -> list[dict]:
    """Every row of ``keys`` through the three stages; ``done(rows, events)`` after each row is timed (rows written as
    they finish). Returns the events."""
    batch: list[Row] = []
    events: list[dict] = []
    try:
        for key in keys:
            batch.append(Row(key, args, common, compile_threads(args)))
        for row in batch:
            row.ready(args.worker_timeout)
        compile_all(batch, args.worker_timeout, args.parallel > 1, args.tune_alone)
        pending = sum(r.get("pending", 0) for row in batch for r in row.first.values())
        for row in batch:
            time_row(row, args, pending)
            row.close()  # its workers gone (and their GPU memory) before the next row is timed
            events += row.events
            if done:
                done(list(row.rows.values()), row.events)
    finally:
        for row in batch:
            row.close()
    return events


def verdicts(rows: dict[str, dict], samples: dict[str, list[list[float]]]) -> None:
    """Each variant's spread over every timed call, and its verdict against stock (and the control) from the rounds."""
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
