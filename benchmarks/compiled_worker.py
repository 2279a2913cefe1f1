"""The worker process of benchmarks/compiled_models.py: one variant of one row (config, dtype, compile mode, workload)
built, patched, compiled and called in a process of its own, then timed on the parent's request.

Protocol over a multiprocessing pipe, one request at a time: the worker sends ``("ready", info)`` once it has built the
model from its config (seed 0) and run one stock eager step (the reference its compiled output is compared with), then
answers ``("compile",)`` (patch, ``torch.compile``, the first call, for tiered the wait for the tuning its trace queued
and the end of background tuning, dynamo's counters), ``("warm",)`` (the warm-up calls and a first timing, made where
nothing else runs) and ``("time", reps)`` (milliseconds of ``reps`` calls, the counters again and the live child
processes) with ``("ok", result)``, and ends on ``("stop",)``. Any exception is answered ``("error", text)`` and ends
the worker; a crash closes the pipe. Each result carries ``t0``/``t1``: the wall clock (``time.time()``, one clock for
every process of the host) when the request's work began and ended, so the parent can show that no timed call ran beside
another worker's compile.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.models_rows import rel_err, timed  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def counts() -> dict[str, Any]:
    """This process's dynamo counters: graph breaks (all reasons), frames compiled, unique graphs, the graphs Inductor
    ran without the CUDA graphs their mode asked for, break reasons."""
    from torch._dynamo.utils import counters

    return dict(graph_breaks=int(sum(counters["graph_break"].values())),
                frames=int(counters["frames"].get("total", 0)),
                graphs=int(counters["stats"].get("unique_graphs", 0)),
                cudagraph_skips=int(counters["inductor"].get("cudagraph_skips", 0)),
                reasons=[_reason(r) for r in counters["graph_break"]])


def _reason(text: str) -> str:
    """A graph break's reason in one line: its first line, and the reason a ``torch.compiler.disable`` gave."""
    line = text.strip().splitlines()[0][:160] if text.strip() else ""
    why = re.search(r"reason: ([^\n]*?)\)?\s*$", text, re.M)
    return f"{line} ({why.group(1)[:160]})" if why else line


def build(spec: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The model of ``spec['config']`` (a transformers class name and its config's class and kwargs) in its dtype,
    random weights from seed 0, in train mode for the train workload, else eval; a model naming no loss type gets the
    causal LM's (as benchmarks/models.py's ``base_model``)."""
    import transformers

    cfg = spec["config"]
    config = getattr(transformers, cfg["config_cls"])(**cfg["kwargs"])
    torch.manual_seed(0)
    with device:
        model = getattr(transformers, cfg["model_cls"])(config).to(DTYPES[spec["dtype"]])
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"
    return model.train(spec["workload"] == "train")


def step(model: Any, workload: str, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """benchmarks/models.py's ``step_fn``; a training step starts from no gradients (``zero_grad(set_to_none=True)``,
    as a training loop's optimizer step leaves them), so a step's work never depends on the steps before it."""
    from benchmarks.models_build import step_fn

    fn = step_fn(model, workload, ids)
    if workload != "train":
        return fn
    params = [p for p in (model._orig_mod if hasattr(model, "_orig_mod") else model).parameters()]

    def train() -> torch.Tensor:
        for p in params:
            p.grad = None
        return fn()

    return train


class Runner:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.device = torch.device(spec["device"])
        self.cuda = self.device.type == "cuda"
        store = os.environ.get("TIERED_OPS_DB", "")
        self.store = ("" if not spec["variant"].startswith("tiered") else "tiered's" if spec["variant"] == "tiered-next"
                      else "fresh" if not spec["carried"] else
                      f"carried ({'had' if Path(store).is_file() and Path(store).stat().st_size else 'new'})")
        self.model = build(spec, self.device)
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, spec["config"]["kwargs"].get("vocab_size", 50257), tuple(spec["shape"]),
                                 generator=g).to(self.device)
        self.reference = step(self.model, spec["workload"], self.ids)().float().clone()
        self.fn: Callable[[], torch.Tensor] | None = None
        self.probe = Probe()

    def info(self) -> dict[str, Any]:
        return dict(store=self.store, pid=os.getpid())

    def compile(self) -> dict[str, Any]:
        spec, note, t_start = self.spec, "", time.time()
        if spec["variant"].startswith("tiered"):
            import tiered_ops

            # the fused LM head + loss off, so that training has logits to compare
            ops = [o for o in tiered_ops.models.patching.PATCHABLE_OPS if o != "linear_cross_entropy"]
            report = tiered_ops.patch(self.model, ops=ops)
            left = sorted({f"{x.cls}: {x.reason}" for x in report.left})
            note = f"{len(report.swapped)} swapped" + (f"; left {'; '.join(left)}" if left else "")
        if spec["fail"] == "raise":
            raise RuntimeError("injected failure (--inject-failure)")
        if spec["fail"] == "exit":
            os._exit(3)
        kw: dict[str, Any] = {} if spec["mode"] == "default" else {"mode": spec["mode"]}
        if spec["backend"] != "inductor":
            if kw:  # other backends ignore a mode: the row would time the default mode under another's name
                raise ValueError(f"mode {spec['mode']} needs the inductor backend, not {spec['backend']}")
            kw["backend"] = spec["backend"]
        compiled = torch.compile(self.model, **kw)  # plain, as users write it: breaks are what is counted
        self.fn = step(compiled, spec["workload"], self.ids)
        before = counts()
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.fn()
        if self.cuda:
            torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        err = rel_err(out, self.reference)
        first = counts()
        pending = 0
        if spec["variant"].startswith("tiered"):  # the buckets its trace queued: measured before it is timed
            from tiered_ops.decide import background

            background.wait_for_tuning(spec.get("settle_s", 120.0))
            pending = background.pending()
            # then background tuning ends, its worker processes with it, as a long-running process's do once idle
            # (after background.IDLE_S): their exit would otherwise fall in some later row's timing
            background.shutdown()
        return dict(first_call_s=first_s, rel_err=err, pending=pending,
                    note=note + (f"; {pending} tuning jobs still pending at --settle-s, dropped" if pending else ""),
                    frames_before=before["frames"], frames_first=first["frames"], t0=t_start, t1=time.time(),
                    **counts())

    def warm(self) -> dict[str, Any]:
        """The warm-up calls (a CUDA-graph mode records its graphs here), then the median of 3 timed calls; from here
        on the calling thread runs on the spec's ``timing_cpu`` where it names one (every variant's on the same core:
        a host-bound step's time moves with the core that issues it)."""
        assert self.fn is not None, "compile first"
        pin(self.spec.get("timing_cpu"))
        t0 = time.time()
        for _ in range(self.spec["warmup"]):
            self.fn()
        warm = statistics.median(timed(self.fn, 3, self.cuda))
        return dict(warm_ms=warm, t0=t0, t1=time.time(), **counts())

    def time(self, reps: int) -> dict[str, Any]:
        assert self.fn is not None, "compile first"
        t0 = time.time()
        probe = statistics.median(self.probe() for _ in range(5))
        ms = timed(self.fn, reps, self.cuda)
        return dict(ms=ms, probe_us=probe, t0=t0, t1=time.time(), children=children(), **counts())


class Probe:
    """A fixed piece of host work on objects the worker made at its start, timed (us) on the calling thread before each
    timing request: a worker whose thread runs slower for no reason of its model's (its CPU's speed at the time, a
    neighbour, where its memory lies) runs this slower too, so a host-bound row's gap can be told from its host's."""

    def __init__(self, n: int = 20000) -> None:
        items = [{"v": float(i)} for i in range(n)]
        random.Random(0).shuffle(items)  # walked out of allocation order: memory, not just the interpreter
        self.items = items

    def __call__(self) -> float:
        t, s = time.perf_counter(), 0.0
        for d in self.items:
            s += d["v"]
        return (time.perf_counter() - t) * 1e6


def pin(cpu: int | None) -> None:
    """The calling thread on ``cpu`` alone (Linux's affinity of pid 0 is the calling thread's); None: as it was."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def children() -> int:
    """This process's live child processes (Linux: /proc; -1 elsewhere): what else of its own ran while it was timed."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return -1
    kids: set[str] = set()
    for t in tasks.iterdir():
        with contextlib.suppress(OSError):
            kids.update((t / "children").read_text().split())
    return len(kids)


def serve(conn: Any, spec: dict[str, Any]) -> None:
    """The worker's loop (the target of a spawned process). Ctrl-C is the parent's: it stops the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def error(stage: str, e: BaseException) -> None:
        traceback.print_exc()
        text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        conn.send(("error", f"{stage}: {type(e).__name__}: {text}"))

    try:
        runner = Runner(spec)
    except Exception as e:  # noqa: BLE001 - a worker's failure is a row with its error
        return error("build", e)
    conn.send(("ready", runner.info()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        try:
            conn.send(("ok", runner.compile() if msg[0] == "compile" else runner.warm() if msg[0] == "warm"
                       else runner.time(msg[1])))
        except Exception as e:  # noqa: BLE001
            return error(msg[0], e)
