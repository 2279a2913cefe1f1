"""Where a patched model's CUDA-graph capture fails: a Llama at 8B dimensions (2 layers, bf16, prefill of SEQ tokens),
patched, warmed on a side stream and captured as torch's recipe does, with tiered_ops' log at DEBUG and synchronizing
calls made errors during the capture (the first offending call raises with its Python stack).
    python scripts/diag/capture_repro.py [--seq 2048] [--fuse-residual] [--tune]"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tiered_ops  # noqa: E402
from benchmarks.models import models, step_fn  # noqa: E402
from tiered_ops.decide import capture, table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--fuse-residual", action="store_true")
    ap.add_argument("--tune", action="store_true", help="tiered_ops.tune(context='graphed') first")
    ap.add_argument("--model", default="llama-8b-dims-2l")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tiered_ops").setLevel(logging.DEBUG)
    cls, cfg, _ = models(False, args.seq)[args.model]
    torch.manual_seed(0)
    model = cls(cfg).to("cuda", torch.bfloat16).eval()
    print(tiered_ops.patch(model, fuse_residual=args.fuse_residual))
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), device="cuda")
    if args.tune:
        print(tiered_ops.tune(model, dict(input_ids=ids, use_cache=False), context="graphed"))
    fn = step_fn(model, "prefill", ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn()
            print(f"warm-up call {i} done")
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for k, sel in table.current().items():
        if k[-1] in ("eager", "graphed"):
            print("decision", k[0], k[1], k[-2], k[-1], "->", sel.name, "warm:",
                  sorted(w[1] for w in capture._warm if w[0] == k[0]))
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.set_sync_debug_mode("error")
        with torch.cuda.graph(graph):
            out = fn()
        torch.cuda.set_sync_debug_mode(0)
        graph.replay()
        torch.cuda.synchronize()
        print("captured and replayed:", tuple(out.shape), "max |out| =", out.float().abs().max().item())
        return 0
    except Exception:
        torch.cuda.set_sync_debug_mode(0)
        traceback.print_exc(limit=25)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
