"""Who should choose an op's tier inside torch.compile: the stored table or Inductor's custom-op autotuning
(``TIERED_OPS_COMPILE_CHOICE``)? For each case, a small function calling the op between pointwise neighbours is
compiled in each mode, each in a process of its own with an empty store of its own, and the script prints per mode:
the seconds to decide (``table``: ``select_backend(..., context="compiled")`` measuring the bucket in a compiled
caller, then the compile; ``table-cold``: the compile with nothing stored, which traces the eager tier and measures
nothing; ``inductor``: the compile, Inductor's timing of the tiers included), the steady-state time of the compiled
function (``triton.testing.do_bench``, median, ms) and the implementation that ran. A short table comes last.
Training steps (``fwd+bwd``) are not Inductor's to choose (``decide/inductor_choice.py``): there the mode is the
table's. The CUDA extension is built first (once, outside the timings). Usage (GPU machine, about 3 minutes):
    python3 scripts/diag/compile_choice.py [--cases rms_norm,softmax,cross_entropy,cross_entropy_train]
        [--modes table-cold,table,inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# case: (op, shape, dtype, training step)
CASES = {
    "rms_norm": ("rms_norm", (8192, 4096), "bf16", False),
    "softmax": ("softmax", (8192, 4096), "bf16", False),
    "cross_entropy": ("cross_entropy", (8192, 128256), "bf16", False),
    "cross_entropy_train": ("cross_entropy", (8192, 128256), "bf16", True),
}
MODES = ("table-cold", "table", "inductor")


def _child(case: str, mode: str) -> dict:
    import torch
    import triton

    import tiered_ops
    from tiered_ops.decide import inductor_choice
    from tiered_ops.registry import DTYPES

    op, shape, dname, train = CASES[case]
    dev, dtype = torch.device("cuda"), DTYPES[dname]
    torch.manual_seed(0)
    x = torch.randn(shape, device=dev, dtype=dtype)
    if op == "rms_norm":
        w = torch.randn(shape[-1], device=dev, dtype=dtype)
        params, args = dict(normalized_shape=(shape[-1],), weight=True), (x, w)

        def fn(x, w):
            return tiered_ops.rms_norm(x * 2.0, (x.shape[-1],), w) + 1.0
    elif op == "softmax":
        params, args = dict(dim=-1), (x,)

        def fn(x):
            return tiered_ops.softmax(x * 0.5, -1) * 2.0
    else:
        t = torch.randint(0, shape[-1], (shape[0],), device=dev)
        params, args = {}, (x.requires_grad_(train), t)

        def fn(x, t):
            return tiered_ops.cross_entropy(x * 1.0, t) * 2.0
    mode_name = "fwd+bwd" if train else "fwd_nograd"
    t0 = time.perf_counter()
    if mode == "table":  # the bucket measured as a compiled caller runs it, before the compile
        tiered_ops.select_backend(op, shape, dtype, dev, tune=True, mode=mode_name, context="compiled", **params)
    compiled = torch.compile(fn, fullgraph=True)

    def step():
        if train:
            compiled(*args).backward()
            return None
        with torch.no_grad():
            return compiled(*args)
    step()
    torch.cuda.synchronize()
    decide_s = time.perf_counter() - t0
    ms = triton.testing.do_bench(step, return_mode="median")
    picked = [v for k, v in inductor_choice.chosen().items() if k[0] == op]
    if picked:
        ran, how = picked[-1], "Inductor's choice"
    else:
        sel = tiered_ops.select_backend(op, shape, dtype, dev, tune=False, mode=mode_name, context="compiled",
                                        **params)
        ran, how = sel.name, sel.record.get("reason", "")
        if mode == "table-cold":
            ran, how = "eager", "nothing stored when traced: the eager tier"
        elif mode == "inductor":
            why = inductor_choice.unavailable() or ("training: the table's" if train else "not routed")
            how = f"not Inductor's choice ({why}): {how}"
    return dict(case=case, mode=mode, decide_s=round(decide_s, 2), steady_ms=round(ms, 4), ran=ran, how=how[:160])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--child", nargs=2, metavar=("CASE", "MODE"))
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(_child(*a.child)), flush=True)
        return
    import torch

    from tiered_ops.tiers import cuda_ext

    t0 = time.perf_counter()
    why = cuda_ext.load(torch.device("cuda"))
    print(f"CUDA extension: {why or 'loaded'} ({time.perf_counter() - t0:.1f} s)", flush=True)
    results = []
    for case in a.cases.split(","):
        for mode in a.modes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, TIERED_OPS_DB=str(Path(tmp) / "store.sqlite"), TIERED_OPS_TUNE="0",
                           TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                           TIERED_OPS_COMPILE_CHOICE="inductor" if mode == "inductor" else "table")
                p = subprocess.run([sys.executable, __file__, "--child", case, mode], env=env, capture_output=True,
                                   text=True)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not lines:
                print(f"{case} {mode}: failed (rc {p.returncode})\n{p.stderr[-3000:]}", flush=True)
                continue
            r = json.loads(lines[-1][len("RESULT "):])
            results.append(r)
            print(f"{case:>20} {mode:>10}: decide {r['decide_s']:7.2f} s, steady {r['steady_ms']:8.4f} ms, ran "
                  f"{r['ran']} ({r['how']})", flush=True)
    print("\n| case | mode | decide (s) | steady (ms) | ran |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {r['mode']} | {r['decide_s']:.2f} | {r['steady_ms']:.4f} | {r['ran']} |")


if __name__ == "__main__":
    main()
