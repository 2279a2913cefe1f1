"""The compiled-model matrix in the order people write it: a fresh store, ``tiered_ops.patch(model)``,
``torch.compile(model, mode=...)``, call. Each (config, workload, mode, variant) runs in a process of its own (a
graph break or a slow compile of one cannot touch another's classes, caches or store), which reports its first
call's seconds, the steady state (median and p20-p80 of --rounds x --reps calls), dynamo's counts of graph breaks
(``torch._dynamo.utils.counters["graph_break"]``), graphs and recompiles (the ``recompiles`` log's records), and the
logits' relative error against the stock model's eager call in that process.

Configs (random weights, nothing downloaded; 2 layers): Llama at Llama-3-8B dims in bf16, Llama at 2048 hidden /
32000 vocab in fp16, Qwen3 at Qwen3-8B dims in bf16, GPT-2 small in fp16; decode is one token per sequence, no cache,
at the batch each config names; train one sequence of its length (forward, LM loss, backward). The default mode and
reduce-overhead for every config, max-autotune and max-autotune-no-cudagraphs for the first. Speed vs stock: stock's
median over the variant's (above 1: faster). A trace's miss queues its bucket for background tuning: the child waits
for that queue (at most --settle-s) before timing, so the worker's measurements do not share the GPU with the timed
calls; the compiled graph keeps what it traced.

    python benchmarks/models_natural.py --configs llama-h4096-v128k-bf16 --modes default   # on a GPU, ~1 min a row
    python benchmarks/models_natural.py --quick --out-dir /tmp/natural                    # CPU smoke: tiny configs
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.models_rows import rel_err, spread, timed  # noqa: E402

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
WORKLOADS = ("decode", "train")
VARIANTS = ("stock", "tiered")
COLUMNS = ("config", "dtype", "workload", "batch", "tokens", "mode", "variant", "first_call_s", "ms_p50", "ms_p20",
           "ms_p80", "speed_vs_stock", "graph_breaks", "graphs", "recompiles", "rel_err_vs_stock_eager",
           "tuning_pending", "note", "device", "torch", "transformers")


def configs(quick: bool) -> dict[str, dict[str, Any]]:
    """name -> family, config arguments, dtype, decode batch, train sequence, the modes it runs."""
    every = list(MODES[:2])
    if quick:
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
        return {
            "llama-tiny-bf16": dict(family="llama", kw=small, dtype="bf16", batch=4, seq=16, modes=list(MODES)),
            "qwen3-tiny-fp16": dict(family="qwen3", kw=dict(small, head_dim=16), dtype="fp16", batch=2, seq=16,
                                    modes=every),
            "gpt2-tiny-fp16": dict(family="gpt2", kw=dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                                          n_positions=64), dtype="fp16", batch=3, seq=16,
                                   modes=every)}
    llama8 = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    return {
        "llama-h4096-v128k-bf16": dict(family="llama", kw=llama8, dtype="bf16", batch=1, seq=2048, modes=list(MODES)),
        "llama-h2048-v32k-fp16": dict(family="llama", kw=dict(hidden_size=2048, intermediate_size=5632,
                                                              num_hidden_layers=2, num_attention_heads=16,
                                                              num_key_value_heads=4, vocab_size=32000,
                                                              max_position_embeddings=4096),
                                      dtype="fp16", batch=8, seq=1024, modes=every),
        "qwen3-h4096-v152k-bf16": dict(family="qwen3", kw=dict(llama8, intermediate_size=12288, head_dim=128,
                                                               vocab_size=151936),
                                       dtype="bf16", batch=4, seq=2048, modes=every),
        "gpt2-h768-v50k-fp16": dict(family="gpt2", kw=dict(n_positions=1024), dtype="fp16", batch=16, seq=512,
                                    modes=every)}


def _model(cfg: dict[str, Any], device: torch.device) -> torch.nn.Module:
    import transformers as T

    cls, conf = {"llama": (T.LlamaForCausalLM, T.LlamaConfig), "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config),
                 "gpt2": (T.GPT2LMHeadModel, T.GPT2Config)}[cfg["family"]]
    extra = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if cfg["family"] == "gpt2" else {}
    torch.manual_seed(0)
    with device:
        model = cls(conf(**cfg["kw"], **extra)).to({"bf16": torch.bfloat16, "fp16": torch.float16}[cfg["dtype"]])
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # GPT-2 names none: transformers then logs on each call
    return model


def _step(model: Any, workload: str, ids: torch.Tensor) -> Any:
    if workload == "train":
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.logits.detach()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


class _Recompiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Recompiling function" in record.getMessage():
            self.n += 1


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One row, in this process: the model built, stock's eager logits kept, then patch (tiered) -> compile -> call."""
    from torch._dynamo.utils import counters

    import tiered_ops
    from tiered_ops.decide import background

    cfg, dev = job["cfg"], torch.device(job["device"])
    recompiles = _Recompiles()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(recompiles)
    model = _model(cfg, dev)
    vocab = model.config.vocab_size
    shape = (cfg["batch"], 1) if job["workload"] == "decode" else (1, cfg["seq"])
    ids = torch.randint(0, vocab, shape, device=dev, generator=torch.Generator(dev).manual_seed(1))
    model.train(job["workload"] == "train")
    ref = _step(model, job["workload"], ids).float()
    model.zero_grad(set_to_none=True)
    if job["variant"] == "tiered":
        tiered_ops.patch(model)
    # a backend other than Inductor (the CPU smoke's eager) takes no mode: the row's mode is then a label
    opts = {"backend": job["backend"]} if job["backend"] != "inductor" else (
        {} if job["mode"] == "default" else {"mode": job["mode"]})
    compiled = torch.compile(model, **opts)
    cuda = dev.type == "cuda"
    t0 = time.perf_counter()
    out = _step(compiled, job["workload"], ids)
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    err = rel_err(out, ref)
    pending = background.pending()
    if pending and job["settle_s"] > 0:
        background.wait_for_tuning(job["settle_s"])
        pending = background.pending()
    for _ in range(job["warmup"]):
        _step(compiled, job["workload"], ids)
    ms = []
    for _ in range(job["rounds"]):
        ms += timed(lambda: _step(compiled, job["workload"], ids), job["reps"], cuda)
        model.zero_grad(set_to_none=True)
    p50, p20, p80 = spread(ms)
    breaks = counters["graph_break"]
    why = sorted(breaks.items(), key=lambda kv: -kv[1])[:2]
    return dict(first_call_s=round(first, 2), ms_p50=round(p50, 4), ms_p20=round(p20, 4), ms_p80=round(p80, 4),
                graph_breaks=sum(breaks.values()), graphs=counters["stats"]["unique_graphs"],
                recompiles=recompiles.n, rel_err_vs_stock_eager=f"{err:.3e}", tuning_pending=pending,
                note="; ".join(f"{n}x {k.splitlines()[0][:120]}" for k, n in why))


def _run_child(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``job`` in a process of its own with a fresh store; its row, or a note saying why there is none."""
    with tempfile.TemporaryDirectory(prefix="natural-") as tmp:
        env = dict(os.environ, TIERED_OPS_DB=str(Path(tmp) / "store.sqlite"))
        try:
            done = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True,
                                  text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return dict(note=f"failed: no result within {timeout:.0f} s")
    rows = [ln[4:] for ln in done.stdout.splitlines() if ln.startswith("ROW ")]
    if done.returncode or not rows:
        tail = [ln for ln in done.stderr.splitlines() if ln.strip()][-1:] or [f"exit {done.returncode}"]
        return dict(note=f"failed: {tail[0][:240]}")
    return json.loads(rows[-1])


def render(rows: list[dict], head: str) -> str:
    shown = [c for c in COLUMNS if c not in ("device", "torch", "transformers")]
    lines = [head, "", "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in shown) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path, head: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "models-natural.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "models-natural.md").write_text(render(rows, head))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="CPU smoke: tiny configs, backend eager, 1 round of 2 calls")
    p.add_argument("--out-dir", help="where models-natural.csv and .md go (default reports/<gpu>/)")
    p.add_argument("--device", help="default: cuda when there is one (cpu with --quick)")
    p.add_argument("--configs", help="comma-separated config names (default: all)")
    p.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default: each config's own)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--backend", help="torch.compile backend (default inductor; eager with --quick)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 5; 1 with --quick)")
    p.add_argument("--reps", type=int, help="calls per round (default 20; 2 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (default 5; 0 with --quick)")
    p.add_argument("--settle-s", type=float, help="wait at most this for background tuning before timing "
                   "(default 120; 0 with --quick)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per child process")
    args = p.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    q = args.quick
    device = args.device or ("cuda" if torch.cuda.is_available() and not q else "cpu")
    backend = args.backend or ("eager" if q else "inductor")
    base = dict(device=device, backend=backend, rounds=args.rounds or (1 if q else 5),
                reps=args.reps or (2 if q else 20),
                warmup=args.warmup if args.warmup is not None else (0 if q else 5),
                settle_s=args.settle_s if args.settle_s is not None else (0.0 if q else 120.0))
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    out = Path(args.out_dir or f"reports/{gpu.lower().replace(' ', '-')}")
    common = dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__)
    head = (f"`python benchmarks/models_natural.py {' '.join(sys.argv[1:] if argv is None else argv)}` on {gpu}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, backend {backend}: each row a "
            "process of its own with a fresh store; patch -> torch.compile(model, mode) -> call; "
            f"{base['rounds']} rounds of {base['reps']} calls after {base['warmup']} warm-up calls.")
    rows: list[dict] = []
    for name, cfg in configs(q).items():
        if args.configs and name not in args.configs.split(","):
            continue
        for workload in args.workloads.split(","):
            for mode in (args.modes.split(",") if args.modes else cfg["modes"]):
                stock = None
                for variant in args.variants.split(","):
                    job = dict(base, cfg=cfg, workload=workload, mode=mode, variant=variant)
                    t0 = time.perf_counter()
                    row = dict(common, config=name, dtype=cfg["dtype"], workload=workload, mode=mode, variant=variant,
                               batch=cfg["batch"] if workload == "decode" else 1,
                               tokens=cfg["batch"] if workload == "decode" else cfg["seq"])
                    row.update(_run_child(job, args.timeout_s))
                    if variant == "stock":
                        stock = row.get("ms_p50")
                    elif stock and row.get("ms_p50"):
                        row["speed_vs_stock"] = round(stock / row["ms_p50"], 3)
                    rows.append(row)
                    print(f"{name} {workload} {mode} {variant}: first {row.get('first_call_s')} s, "
                          f"{row.get('ms_p50')} ms, breaks {row.get('graph_breaks')}, recompiles "
                          f"{row.get('recompiles')} ({time.perf_counter() - t0:.0f} s) {row.get('note', '')}",
                          file=sys.stderr)
                    write(rows, out, head)  # as it goes: a cut run keeps its rows
    print(f"wrote {out / 'models-natural.csv'} and {out / 'models-natural.md'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
