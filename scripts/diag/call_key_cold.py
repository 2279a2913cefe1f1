"""The C++ call key of this tree against an earlier tree's, on a CPU, in one process: what a hit of
``tiered_ops.<op>`` and of a ``select_backend`` callable costs over the implementation it calls, warm (back-to-back
calls) and cold (MB streamed through the CPU caches before each call, as an implementation's own work does: a few ATen
ops evict what the hit path reads).

Each tree's ``call_key.cpp`` (and the headers it includes) is built alone, its CUDA part compiled out
(``cuda_ext.build_call_key_cpu``); the two alternate round by round. The implementation is a stub planted under the
call's key that reads each tensor argument's shape, dtype, requires_grad and device (as an implementation would, so
those lines are not counted to the dispatch). Python 3.12+ for the fast path as a model runs it (before, a call from
Python code runs the generated function's frame); the C-side cache is 3.12+ too.

    python scripts/diag/call_key_cold.py --base REV [--evict 16] [--rounds 30] [--calls 300] [--ops softmax,rms_norm]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TIERED_OPS_TUNE", "0")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import tiered_ops  # noqa: E402
from benchmarks.dispatch_overhead import cold  # noqa: E402  (single calls, the caches evicted before each)
from tiered_ops.runtime import dispatch  # noqa: E402
from tiered_ops.runtime.memo import _hot  # noqa: E402
from tiered_ops.tiers import cuda_ext  # noqa: E402


def tree_sources(rev: str, into: Path) -> Path:
    """``cuda_src/call_key.cpp`` of ``rev`` and the local headers it includes, written under ``into``."""
    todo, done = ["call_key.cpp"], set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        text = subprocess.run(["git", "show", f"{rev}:cuda_src/{name}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        (into / name).write_text(text)
        todo += re.findall(r'^#include "([^"]+)"', text, re.M)
    return into


def cases(n: int = 64) -> dict[str, tuple]:
    x, r, w = (torch.randn(4, n) for _ in range(3))
    w = w[0]
    t = torch.randint(0, n, (4,))
    return {"softmax": (x, -1), "rms_norm": (x, (n,), w, 1e-6), "fused_add_rms_norm": (x, r, (n,), w, 1e-6),
            "layer_norm": (x, (n,), w, w, 1e-5), "cross_entropy": (x, t)}


# select_backend's problem parameters of each case (its defaults differ: a bias or weight, dim -1)
SELECT = {"softmax": dict(dim=-1), "rms_norm": dict(normalized_shape=(64,)),
          "fused_add_rms_norm": dict(normalized_shape=(64,)), "layer_norm": dict(normalized_shape=(64,))}


def given_as_before(fast_path: Any) -> Any:
    """``fast_path`` of a tree that may take a method's table as None (before its class was passed)."""
    def give(func: Any, table: Any, *rest: Any) -> Any:
        try:
            return fast_path(func, table, *rest)
        except TypeError:
            if not isinstance(table, type):
                raise
            return fast_path(func, None, *rest)
    return give


def stub(*args: Any, **kwargs: Any) -> Any:
    for v in args:
        if isinstance(v, torch.Tensor):
            v.shape, v.dtype, v.requires_grad, v.device  # noqa: B018 (what an implementation reads)
    return args[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the earlier tree (a git revision)")
    ap.add_argument("--evict", type=float, default=16.0, help="MB streamed before each cold call")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ops", help="comma-separated (default: every case)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="call_key_cold_"))
    (tmp / "base_src").mkdir()
    base_src = tree_sources(args.base, tmp / "base_src")
    keys = {f"base {args.base}": cuda_ext.build_call_key_cpu(tmp / "base", "tiered_ops_call_key_base", base_src),
            "this tree": cuda_ext.build_call_key_cpu(tmp / "tree", "tiered_ops_call_key_tree")}
    evict = torch.zeros(max(1, int(args.evict * 2**20 / 4)))
    wanted = args.ops.split(",") if args.ops else None
    print(f"python {sys.version.split()[0]}, {args.rounds} rounds of {args.calls} calls, {args.evict:g} MB streamed "
          f"before each cold call; ns over the stub called directly (median over rounds, p20-p80)")
    with torch.no_grad():
        for op, a in cases().items():
            if wanted and op not in wanted:
                continue
            public = getattr(tiered_ops, op)
            x = a[0]
            sel = tiered_ops.select_backend(op, tuple(x.shape), x.dtype, x.device, **SELECT.get(op, {}))
            callers = {"op": public, "select": sel}
            res = {(k, c): {"warm": [], "cold": []} for k in keys for c in callers}
            for rd in range(args.rounds):
                order = list(keys) if rd % 2 == 0 else list(reversed(keys))
                for name in order:
                    m = keys[name]
                    dispatch.use_call_key(m.call_key, m.call_cached, given_as_before(m.fast_path))
                    for c, fn in callers.items():
                        fn(*a)  # the key learned, then the stub planted under it
                        table = _hot if c == "op" else sel._seen
                        for k in list(table):
                            table[k] = stub
                        for kind, ev in (("warm", None), ("cold", evict)):  # (cold() keeps the collector off)
                            diffs = cold(lambda: fn(*a), lambda: stub(*a), args.calls, ev, False)
                            res[name, c][kind].append(1e3 * statistics.median(diffs))
            for (name, c), r in res.items():
                cells = []
                for kind in ("warm", "cold"):
                    q = statistics.quantiles(r[kind], n=10)
                    cells.append(f"{kind} {statistics.median(r[kind]):6.0f} ({q[1]:.0f}-{q[7]:.0f})")
                print(f"{op:<20} {c:<7} {name:<22} " + "   ".join(cells))
    dispatch.use_call_key(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
