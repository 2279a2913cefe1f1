"""Model-level benchmark: stock transformers vs Liger's patch vs tiered_ops.patch (after tiered_ops.tune).

Models, built from configs with random weights (nothing is downloaded), in bf16: a Llama-architecture model at
Llama-3-8B dimensions with 2 layers (hidden 4096, intermediate 14336, 32 heads, 8 kv heads, vocab 128256) and
GPT-2 small (768, 12 layers, 12 heads; its position table raised to the prefill length). Dropout is 0.
Workloads: prefill (1 x --seq tokens, inference), one-token forward (1 x 1 without a cache: the launch-bound
end) and a training step (1 x --seq: forward, LM loss, backward). Contexts: eager, torch.compile(fullgraph=True)
and CUDA graphs (inference, on a GPU). Liger: its apply_liger_kernel_to_<arch>(model=...) with its defaults
except the fused linear cross entropy (off, so that logits exist to compare); it patches transformers' module
functions for the rest of the process, so it runs last. Each row: the median (p20, p80) of CUDA-event timings of
--reps runs after --warmup, the logits' relative error against stock eager in float32, and the seconds
tiered_ops.tune took for that workload and context. Writes models.csv (long format) and models.md to --out-dir.

    python benchmarks/models.py --out-dir reports/models          # on a GPU
    python benchmarks/models.py --tiny --out-dir /tmp/models      # CPU smoke: hidden 64, 2 layers, seq 16
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import tiered_ops

VARIANTS = ("stock", "tiered", "liger")  # liger last: its patch changes transformers' module functions
WORKLOADS = ("prefill", "decode", "train")
CONTEXTS = ("eager", "compile", "graphs")
TUNE_CONTEXT = {"eager": "eager", "compile": "compiled", "graphs": "graphed"}
COLUMNS = ("model", "variant", "workload", "context", "tokens", "dtype", "ms_p50", "ms_p20", "ms_p80", "reps",
           "rel_err_vs_stock", "tune_s", "note", "device", "torch", "transformers", "liger")


class Skip(Exception):
    """A row that cannot be measured here, with why."""


def models(tiny: bool, seq: int) -> dict[str, tuple[Any, Any, str]]:
    """name -> (model class, config, liger architecture name)."""
    import transformers as T

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if tiny:
        llama = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, max_position_embeddings=max(64, seq))
        gpt2 = T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=max(64, seq),
                            bos_token_id=0, eos_token_id=0, **no_dropout)
        return {"llama-tiny-2l": (T.LlamaForCausalLM, llama, "llama"),
                "gpt2-tiny-2l": (T.GPT2LMHeadModel, gpt2, "gpt2")}
    llama = T.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=max(8192, seq))
    gpt2 = T.GPT2Config(n_positions=max(1024, seq), **no_dropout)  # the defaults are GPT-2 small
    return {"llama-8b-dims-2l": (T.LlamaForCausalLM, llama, "llama"), "gpt2-small": (T.GPT2LMHeadModel, gpt2, "gpt2")}


def variant(name: str, base: torch.nn.Module, arch: str) -> tuple[torch.nn.Module, str]:
    """A copy of ``base`` under ``name``'s patch, and a note on what the patch did."""
    model = copy.deepcopy(base)
    if name == "tiered":
        report = tiered_ops.patch(model)
        left = "; ".join(sorted({f"{x.cls}: {x.reason}" for x in report.left}))
        return model, f"{len(report.swapped)} modules swapped" + (f", left {left}" if left else "")
    if name == "liger":
        try:
            import liger_kernel.transformers as L
        except ImportError:
            raise Skip("liger not installed") from None
        apply = getattr(L, f"apply_liger_kernel_to_{arch}", None)
        if apply is None:
            raise Skip(f"liger has no {arch} patch")
        apply(model=model, fused_linear_cross_entropy=False)
        return model, "liger defaults, fused linear cross entropy off (logits kept)"
    return model, ""


def step_fn(model: Any, workload: str, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One call of ``workload`` on ``model`` (an nn.Module or its compiled form), returning the logits."""
    if workload == "train":
        params = [p for p in model.parameters()] if isinstance(model, torch.nn.Module) else None

        def train() -> torch.Tensor:
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            for p in params or ():
                p.grad = None
            return out.logits.detach()

        return train

    def infer() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits

    return infer


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` captured in a CUDA graph (its inputs are static): each call replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def timed(fn: Callable[[], Any], warmup: int, reps: int, cuda: bool) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` (CUDA events on a GPU, else the wall clock)."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
    return ms


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def build(model: torch.nn.Module, workload: str, context: str, ids: torch.Tensor, args: argparse.Namespace
          ) -> Callable[[], torch.Tensor]:
    if context == "eager":
        return step_fn(model, workload, ids)
    if context == "compile":
        torch._dynamo.reset()
        return step_fn(torch.compile(model, fullgraph=True, backend=args.backend), workload, ids)
    return graphed(step_fn(model, workload, ids))


def unsupported(workload: str, context: str, device: torch.device) -> str | None:
    if context == "graphs" and device.type != "cuda":
        return "CUDA graphs need a GPU"
    if context == "graphs" and workload == "train":
        return "CUDA graphs: inference only here"
    return None


def measure_model(name: str, cls: Any, config: Any, arch: str, args: argparse.Namespace, base_row: dict
                  ) -> list[dict]:
    dev, dtype = torch.device(args.device), torch.bfloat16
    torch.manual_seed(0)
    with dev:
        base = cls(config).to(dtype).eval()
    if getattr(base, "loss_type", None) is None:  # GPT-2 names none: transformers then logs, which breaks fullgraph
        base.loss_type = "ForCausalLM"
    vocab = config.vocab_size
    inputs = {"prefill": torch.randint(0, vocab, (1, args.seq), device=dev),
              "decode": torch.randint(0, vocab, (1, 1), device=dev)}
    inputs["train"] = inputs["prefill"]
    reference: dict[str, torch.Tensor] = {}
    rows = []
    for vname in VARIANTS:
        common = dict(base_row, model=name, variant=vname, dtype="bf16")
        try:
            model, note = variant(vname, base, arch)
        except Skip as e:
            rows.append(dict(common, note=str(e)))
            print(f"{name} {vname}: {e}", file=sys.stderr)
            continue
        for workload in WORKLOADS:
            ids = inputs[workload]
            model.train(workload == "train")
            for context in CONTEXTS:
                row = dict(common, workload=workload, context=context, tokens=ids.numel(), note=note)
                why = unsupported(workload, context, dev)
                if why:
                    rows.append(dict(row, note=why))
                    continue
                try:
                    if vname == "tiered":
                        if args.tune:
                            kw = dict(input_ids=ids, use_cache=False) | ({"labels": ids} if workload == "train" else {})
                            report = tiered_ops.tune(model, kw, train=workload == "train",
                                                     context=TUNE_CONTEXT[context])
                            row["tune_s"] = round(report.seconds, 2)
                        step_fn(model, workload, ids)()  # the decisions exist before any trace or capture
                    fn = build(model, workload, context, ids, args)
                    out = fn()
                    ms = timed(fn, args.warmup, args.reps, dev.type == "cuda")
                except Exception as e:  # a variant that cannot run a context is a result too
                    rows.append(dict(row, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
                    print(f"{name} {vname} {workload} {context}: {rows[-1]['note']}", file=sys.stderr)
                    continue
                if vname == "stock" and context == "eager":
                    reference[workload] = out.float().clone()
                q = statistics.quantiles(ms, n=5, method="inclusive") if len(ms) > 1 else [ms[0]] * 4
                rows.append(dict(row, ms_p50=round(statistics.median(ms), 4), ms_p20=round(q[0], 4),
                                 ms_p80=round(q[3], 4), reps=len(ms),
                                 rel_err_vs_stock=(f"{rel_err(out, reference[workload]):.3e}"
                                                   if workload in reference else "")))
                print(f"{name} {vname:6s} {workload:7s} {context:7s} {rows[-1]['ms_p50']:10.3f} ms  "
                      f"rel err {rows[-1]['rel_err_vs_stock'] or '-'}", file=sys.stderr)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def render(rows: list[dict], args: argparse.Namespace) -> str:
    """models.md: per model, each workload x context, every variant's median and its speedup over stock."""
    r0 = rows[0] if rows else {}
    out = ["# Model-level benchmark", "",
           f"`{' '.join(['python', 'benchmarks/models.py', *sys.argv[1:]])}` on {r0.get('device')}; torch "
           f"{r0.get('torch')}, transformers {r0.get('transformers')}, liger {r0.get('liger') or 'not installed'}. "
           f"bf16, prefill/train {args.seq} tokens, decode 1 token (no cache). Median of {args.reps} CUDA-event "
           f"timings after {args.warmup} warm-up calls (wall clock on a CPU). Rel err: logits against stock eager, "
           "in float32. Tune s: tiered_ops.tune for that workload and context (0 when already stored).", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        out += [f"## {model}", "", "| workload | context | variant | median ms | p20-p80 ms | vs stock | rel err | "
                "tune s | note |", "|---|---|---|---:|---|---:|---:|---:|---|"]
        mine = [r for r in rows if r["model"] == model]
        for r in sorted(mine, key=lambda r: (WORKLOADS.index(r.get("workload") or "prefill"),
                                             CONTEXTS.index(r.get("context") or "eager"))):
            stock = next((s for s in mine if s["variant"] == "stock" and s.get("workload") == r.get("workload")
                          and s.get("context") == r.get("context") and s.get("ms_p50")), None)
            speed = f"{stock['ms_p50'] / r['ms_p50']:.2f}x" if stock and r.get("ms_p50") else ""
            spread = f"{r['ms_p20']}-{r['ms_p80']}" if r.get("ms_p50") else ""
            out.append(f"| {r.get('workload', '')} | {r.get('context', '')} | {r['variant']} | {r.get('ms_p50', '')} "
                       f"| {spread} | {speed} | {r.get('rel_err_vs_stock', '')} | {r.get('tune_s', '')} "
                       f"| {r.get('note', '')} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True, help="where models.csv and models.md are written")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: hidden 64, 2 layers, seq 16, 3 reps")
    p.add_argument("--device", help="default: cuda when there is one (cpu with --tiny)")
    p.add_argument("--seq", type=int, help="prefill and training tokens (default 2048; 16 with --tiny)")
    p.add_argument("--reps", type=int, help="timed runs per row (default 20; 3 with --tiny)")
    p.add_argument("--warmup", type=int, help="untimed runs first (default 3; 1 with --tiny)")
    p.add_argument("--backend", help="torch.compile backend (default inductor; eager with --tiny: the trace only)")
    p.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                   help="tune before the tiered rows (default on; off with --tiny: measuring on a CPU takes minutes)")
    p.add_argument("--models", help="comma-separated model names (default: both)")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    args.seq = args.seq or (16 if tiny else 2048)
    args.reps = args.reps or (3 if tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 3)
    args.backend = args.backend or ("eager" if tiny else "inductor")
    args.tune = (not tiny) if args.tune is None else args.tune
    if not args.tune:
        os.environ["TIERED_OPS_TUNE"] = "0"  # decisions from the store, or eager: nothing is measured
    import transformers

    try:
        import liger_kernel
        liger = getattr(liger_kernel, "__version__", "installed")
    except ImportError:
        liger = ""
    dev = torch.device(args.device)
    base_row = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                    torch=torch.__version__, transformers=transformers.__version__, liger=liger)
    rows: list[dict] = []
    for name, (cls, config, arch) in models(tiny, args.seq).items():
        if args.models and name not in args.models.split(","):
            continue
        rows += measure_model(name, cls, config, arch, args, base_row)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "models.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)
    (out / "models.md").write_text(render(rows, args))
    print(f"wrote {out / 'models.csv'} and {out / 'models.md'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
