"""A small decoder in plain torch, run with tiered_ops ops and with plain torch ops, in the three call contexts.

Two layers at a Llama-8B's dimensions (hidden 4096, 32 heads of 128, 8 key/value heads, MLP 14336 with GELU),
RMSNorm before attention and MLP and at the end, attention through scaled_dot_product_attention, random init, bf16;
no weights are loaded. Each configuration runs: a forward of 1 token, a forward of 2048 tokens (prefill) and a
training step (forward + backward of 2048 tokens), as

    eager     the model called from Python
    compiled  torch.compile(model, fullgraph=True)
    graphed   the eager model captured once in a CUDA graph and replayed (forward only: a training step's
              backward is not captured here)

with the norms and the activation either torch's (``plain``: F.rms_norm, F.gelu) or tiered_ops' (``tiered``:
tiered_ops.rms_norm, tiered_ops.gelu, each deciding per call). Times are CUDA-event medians over repeated runs in one
process (ms); the decision every tiered_ops call made in each context is listed from the selection records.

    python benchmarks/decoder.py --out-dir DIR            # GPU: decoder.csv, decoder.md
    python benchmarks/decoder.py --tiny --device cpu      # a smoke run (hidden 64, 8 tokens), eager and compiled
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from models import timed  # the sibling benchmark's timer (this script runs from benchmarks/)
from torch import nn

import tiered_ops
from tiered_ops.registry import CONTEXTS
from tiered_ops.runtime import memo


@dataclass
class Dims:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    mlp: int = 14336
    layers: int = 2
    prefill: int = 2048


TINY = Dims(hidden=64, heads=4, kv_heads=2, mlp=128, layers=2, prefill=8)


class Block(nn.Module):
    def __init__(self, d: Dims, tiered: bool) -> None:
        super().__init__()
        self.d, self.tiered = d, tiered
        self.n1, self.n2 = nn.Parameter(torch.ones(d.hidden)), nn.Parameter(torch.ones(d.hidden))
        hd = d.hidden // d.heads
        self.qkv = nn.Linear(d.hidden, (d.heads + 2 * d.kv_heads) * hd, bias=False)
        self.o = nn.Linear(d.hidden, d.hidden, bias=False)
        self.up = nn.Linear(d.hidden, d.mlp, bias=True)
        self.down = nn.Linear(d.mlp, d.hidden, bias=False)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tiered_ops.rms_norm(x, (x.shape[-1],), w) if self.tiered else F.rms_norm(x, (x.shape[-1],), w)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return tiered_ops.gelu(x) if self.tiered else F.gelu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, (b, t, _) = self.d, x.shape
        hd = d.hidden // d.heads
        q, k, v = self.qkv(self.norm(x, self.n1)).split([d.heads * hd, d.kv_heads * hd, d.kv_heads * hd], -1)
        q = q.view(b, t, d.heads, hd).transpose(1, 2)
        k = k.view(b, t, d.kv_heads, hd).transpose(1, 2)
        v = v.view(b, t, d.kv_heads, hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d.hidden))
        return x + self.down(self.act(self.up(self.norm(x, self.n2))))


class Decoder(nn.Module):
    def __init__(self, d: Dims, tiered: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, tiered) for _ in range(d.layers))
        self.final = nn.Parameter(torch.ones(d.hidden))
        self.tiered = tiered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return blk.norm(x, self.final)


def _median_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``reps`` calls after 3 warm-up calls (``models.timed``: CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(timed(fn, reps, device.type == "cuda"))


def _graphed(fn, example: torch.Tensor):
    """fn captured once in a CUDA graph: replay runs it on the example's (static) buffer."""
    static_in = example.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            fn(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        fn(static_in)
    return g.replay


def _decisions(since: int) -> list[str]:
    """The decision each tiered_ops call signature made (the selection records), from index ``since`` on."""
    out = []
    for key, sel in list(memo._calls.items())[since:]:
        r = dict(sel.record, context=CONTEXTS[key[-1]])
        out.append(f"{r.get('op')} {r.get('problem')} {r.get('dtype')} {r.get('mode')} {r.get('context', 'eager')}: "
                   f"{sel.name}")
    return out


def run(d: Dims, device: torch.device, dtype: torch.dtype, contexts: list[str], reps: int) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    for tiered in (False, True):
        model = Decoder(d, tiered).to(device, dtype)
        for ctx in contexts:
            if ctx == "graphed" and device.type != "cuda":
                continue
            fwd = torch.compile(model, fullgraph=True, dynamic=False) if ctx == "compiled" else model
            for case, tokens, train in (("decode 1 token", 1, False), (f"prefill {d.prefill}", d.prefill, False),
                                        (f"train step {d.prefill}", d.prefill, True)):
                if ctx == "graphed" and train:
                    continue
                x = torch.randn(1, tokens, d.hidden, device=device, dtype=dtype)
                mark = len(memo._calls)
                if tiered:
                    with torch.no_grad() if not train else torch.enable_grad():
                        model(x.requires_grad_(train))  # decide outside any trace or capture first
                if train:
                    def step(x=x, fwd=fwd):
                        fwd(x.requires_grad_(True)).float().square().mean().backward()
                    fn = step
                elif ctx == "graphed":
                    fn = _graphed(fwd, x)
                else:
                    def infer(x=x, fwd=fwd):
                        with torch.no_grad():
                            fwd(x)
                    fn = infer
                ms = _median_ms(fn, device, reps)
                rows.append(dict(ops="tiered" if tiered else "plain", context=ctx, case=case, ms=ms,
                                 decisions="; ".join(_decisions(mark)) if tiered else ""))
                print(f"{rows[-1]['ops']:<7} {ctx:<9} {case:<18} {ms:9.3f} ms  {rows[-1]['decisions']}", flush=True)
    return rows


def markdown(rows: list[dict], header: str) -> str:
    import pandas as pd

    df = pd.DataFrame(rows)
    piv = df.pivot_table(index=["context", "case"], columns="ops", values="ms", aggfunc="first")
    out = [header, "", "| context | case | plain ms | tiered ms | tiered / plain |", "|---|---|---|---|---|"]
    for (ctx, case), r in piv.iterrows():
        out.append(f"| {ctx} | {case} | {r.get('plain', float('nan')):.3f} | {r.get('tiered', float('nan')):.3f} | "
                   f"{r.get('tiered', float('nan')) / r.get('plain', float('nan')):.3f} |")
    out += ["", "Decisions of the tiered_ops calls (op, problem, dtype, mode, context: implementation):", ""]
    for r in df[df.ops == "tiered"].itertuples():
        out.append(f"- {r.context} / {r.case}: {r.decisions or '(none new: decided before)'}")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="hidden 64, 8 tokens (a smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", default="eager,compiled,graphed")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out-dir", help="write decoder.csv and decoder.md there")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    d = TINY if args.tiny else Dims()
    rows = run(d, device, dtype, args.contexts.split(","), args.reps)
    if args.out_dir:
        import pandas as pd

        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(out / "decoder.csv", index=False)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        (out / "decoder.md").write_text(markdown(rows, f"# Decoder (2 layers, hidden {d.hidden}, {dtype}) on {name}"))


if __name__ == "__main__":
    main()
