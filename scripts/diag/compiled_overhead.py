"""Where a compiled model's per-call host time goes, stock against tiered_ops.patch, one variant per process: dynamo's
guards (counted from the guards log), CUDA-graph skips, and the profiler's CPU ops per call.

    PYTHONPATH=$PWD python3 scripts/diag/compiled_overhead.py --variant tiered --mode reduce-overhead --out DIR
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from benchmarks.compiled_models import configs  # noqa: E402
from benchmarks.compiled_worker import build, step  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="qwen2-1.5b-dims-2l")
    p.add_argument("--variant", choices=("stock", "tiered"), required=True)
    p.add_argument("--mode", default="reduce-overhead")
    p.add_argument("--workload", default="decode")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=".")
    a = p.parse_args()
    from torch._dynamo.utils import counters

    import tiered_ops
    from tiered_ops.decide import background

    guards = _Lines()
    torch._logging.set_logs(guards=True)
    logging.getLogger("torch._dynamo.guards").addHandler(guards)
    cfg, dev = configs(False)[a.config], torch.device("cuda")
    model = build(dict(config=cfg, dtype=cfg["dtype"], workload=a.workload), dev)
    shape = (cfg["batch"], 1) if a.workload == "decode" else (1, cfg["seq"])
    ids = torch.randint(0, model.config.vocab_size, shape, device=dev)
    if a.variant == "tiered":
        tiered_ops.patch(model)
    compiled = torch.compile(model, **({} if a.mode == "default" else {"mode": a.mode}))
    fn = step(compiled, a.workload, ids)
    for _ in range(3):
        fn()
    background.wait_for_tuning(60)
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.calls):
        fn()
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / a.calls * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    text = "\n".join(guards.lines)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"guards-{a.variant}-{a.mode}.txt").write_text(text)
    print(f"{a.variant} {a.mode} {a.workload}: {per_call:.4f} ms per call (host, synchronized after {a.calls}); "
          f"guard log {len(text.splitlines())} lines; graph breaks {sum(counters['graph_break'].values())}; "
          f"inductor counters {dict(counters['inductor'])}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
