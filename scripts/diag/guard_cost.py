"""What dynamo's guards cost a compiled model per call, stock against patched: each variant compiled (fullgraph,
through its own code object) with a backend that runs nothing new (its graph's outputs of the first call are
returned), then its cache entry's guards checked on the call's own arguments in batches; median microseconds per
check, and the number of guard nodes. A compiled call checks them before it runs its graph, so on a host-bound
model (a decode step) their difference is host time per call.

Variants: stock and patched (``tiered_ops.patch``).

    python scripts/diag/guard_cost.py [--model gpt2-small] [--workload decode] [--reps 200]

CPU or GPU: the model runs in float32 on the CPU, bf16 on a GPU; decisions are not measured (TIERED_OPS_TUNE=0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TIERED_OPS_TUNE", "0")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tiered_ops  # noqa: E402
from benchmarks.models import models, own_compile  # noqa: E402


def replay_backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Any:
    out = gm(*example)
    return lambda *args: out


def guard_nodes(manager: Any) -> int | str:
    """Guard nodes under a guard manager (its leaf guards and its child managers, recursively); "n/a" where this
    torch's guard manager does not list them."""
    root = getattr(manager, "root", manager)
    if not hasattr(root, "get_leaf_guards"):
        return "n/a"

    def count(m: Any) -> int:
        return len(m.get_leaf_guards()) + sum(1 + count(c) for c in m.get_child_managers())

    return count(root)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--workload", default="decode", choices=("decode", "prefill"))
    p.add_argument("--seq", type=int, default=128, help="prefill tokens")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cls, cfg, _ = (models(True, args.seq) | models(False, args.seq))[args.model]
    ids = torch.randint(0, 100, (1, 1 if args.workload == "decode" else args.seq), device=dev)
    variants = ["stock", "patched"]
    print(f"{args.model} {args.workload} on {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}")
    with torch.no_grad():
        for v in variants:
            torch.manual_seed(0)
            m = cls(cfg).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
            if v != "stock":
                tiered_ops.patch(m)
            m(input_ids=ids, use_cache=False)  # decided in eager first, as a user's warm-up
            fn = own_compile(m, v, replay_backend)
            fn(input_ids=ids, use_cache=False)
            entries = _debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__)
            manager = entries[0].guard_manager
            frame = {"args": (), "kwargs": {"input_ids": ids, "use_cache": False}, "model": m}
            if not manager.check(frame):
                print(f"{v}: the guards fail on the call's own arguments (frame locals not as compiled)")
                return 1
            times = []
            for _ in range(9):
                t = time.perf_counter()
                for _ in range(args.reps):
                    manager.check(frame)
                times.append((time.perf_counter() - t) / args.reps * 1e6)
            q = statistics.quantiles(times, n=10, method="inclusive")
            print(f"{v:<11} guard check {statistics.median(times):8.1f} us (p20-p80 {q[1]:.1f}-{q[7]:.1f}), "
                  f"{guard_nodes(manager)} guard nodes, {len(entries)} cache entr{'y' if len(entries) == 1 else 'ies'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
