"""Where a training step's memory goes, stock against patched: each variant built, tuned and compiled as
``benchmarks/models.py`` does, then one step with a pack hook on the tensors autograd saves for the backward. Prints,
per variant, the decisions tuning took, the saved tensors (count, bytes of their storages), the step's peak above the
memory held before it (on a GPU), and the saved tensors that differ from stock's (shape, dtype: count). On a GPU,
``--held-grads`` measures the peak as ``benchmarks/models.py`` does (the gradients of the steps before held, the step
adding to them), and ``--at-peak`` lists the blocks the step had allocated and not yet freed at its peak, by size, where
their count differs from stock's (each with the line that allocated one), from the allocator's recorded history.

    TIERED_OPS_DB=/tmp/mem.sqlite python benchmarks/train_memory.py --model qwen3-tiny --context compile
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.models import TUNE_CONTEXT, Variant, base_model, own_compile  # noqa: E402
from benchmarks.step_memory import Peak, differences, recorded_peak  # noqa: E402

Saved = collections.Counter  # (shape, dtype) -> count


def step(fn: Callable[..., Any], kw: dict) -> tuple[Saved, int]:
    """One training step of ``fn`` with every tensor saved for its backward counted (and its storage's bytes)."""
    saved: Saved = collections.Counter()
    nbytes = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[(tuple(t.shape), str(t.dtype).removeprefix("torch."))] += 1
        nbytes[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(**kw)
    out.loss.backward()
    return saved, nbytes[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-tiny", help="a name of benchmarks/models.py's models() (quick or not)")
    ap.add_argument("--context", default="compile", choices=("eager", "compile"))
    ap.add_argument("--variants", default="stock,tiered,tiered-fused")
    ap.add_argument("--seq", type=int, default=2048, help="tokens (64 for the tiny configs)")
    ap.add_argument("--held-grads", action="store_true", help="the peak of a step that adds to held gradients (GPU)")
    ap.add_argument("--at-peak", action="store_true", help="the blocks alive at the peak, against stock's (GPU)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.recompile_limit = 64
    base, config, arch = base_model(args.model, args.seq, dev)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), device=dev)
    kw = dict(input_ids=ids, labels=ids, use_cache=False)
    print(f"{args.model} train {args.context} bf16 {args.seq} tokens on {dev}; torch {torch.__version__}")
    seen: dict[str, Saved] = {}
    peaks: dict[str, Peak] = {}
    for name in args.variants.split(","):
        v = Variant(name, base, arch)
        v.model.train()
        v.tune(kw, True, TUNE_CONTEXT[args.context])
        fn = own_compile(v.model, name) if args.context == "compile" else v.model
        step(fn, kw)  # compiles; the second step is the one counted
        v.model.zero_grad(set_to_none=True)
        seen[name], nbytes = step(fn, kw)
        v.model.zero_grad(set_to_none=True)

        def once(fn: Callable[..., Any] = fn) -> None:
            fn(**kw).loss.backward()

        if args.held_grads:  # the state a counted step starts from: the gradients of one step held
            once()
        p = recorded_peak(once) if dev.type == "cuda" else None
        print(f"  {name:13s} {sum(seen[name].values())} saved tensors, {nbytes / 2**20:.2f} MiB of storages; "
              f"peak {p.requested_mib if p else '-'} MiB" + (" (gradients held)" if args.held_grads else ""))
        if args.at_peak and p:
            peaks[name] = p
            print(f"    recorded: the allocator's statistics {p.stats / 2**20:.1f} MiB, {len(p.live)} of the step's "
                  f"blocks alive at the peak, {sum(p.allocated().values())} blocks allocated in the step")
            if name != "stock" and "stock" in peaks:
                for line in differences(peaks["stock"], p, ("stock", name)):
                    print(f"      {line}")
        v.model.zero_grad(set_to_none=True)
        if name != "stock" and "stock" in seen:
            more, fewer = seen[name] - seen["stock"], seen["stock"] - seen[name]
            print(f"    saved beyond stock's: {dict(more) or 'none'}; stock's not saved: {dict(fewer) or 'none'}")
        del v, fn
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
