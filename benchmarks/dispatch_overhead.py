"""Micro-benchmark of the selection path on the CPU (not a test: performance claims come from here).

Targets (issue 2): a cached select_backend under 2 us; tiered_ops.<op> within 3 us of calling the
chosen implementation directly. Run: python benchmarks/dispatch_overhead.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.utils.benchmark as tb

os.environ.setdefault("TIERED_OPS_DB", os.path.join(tempfile.mkdtemp(), "dispatch.sqlite"))
os.environ["TIERED_OPS_TUNE"] = "0"  # eager decisions: the overhead is timed here, not a measurement

import tiered_ops  # noqa: E402


def us(fn) -> float:
    return tb.Timer("fn()", globals={"fn": fn}, num_threads=1).blocked_autorange(min_run_time=1.0).median * 1e6


def main() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    sm = tiered_ops.select_backend("softmax", (4, 8))
    rn = tiered_ops.select_backend("rms_norm", (4, 8), normalized_shape=(8,))
    ma = tiered_ops.select_backend("muladd", (4, 8))
    rows = [("select_backend, cached", us(lambda: tiered_ops.select_backend("softmax", (4, 8))), 2.0)]
    for name, op, direct in (
        ("softmax", lambda: tiered_ops.softmax(x, -1), lambda: sm.fn(x, -1)),
        ("rms_norm", lambda: tiered_ops.rms_norm(x, (8,), w), lambda: rn.fn(x, (8,), w)),
        ("muladd", lambda: tiered_ops.muladd(x, x, x), lambda: ma.fn(x, x, x)),
    ):
        op()
        rows.append((f"tiered_ops.{name} minus direct", us(op) - us(direct), 3.0))
    print(f"{'path':<32} {'us':>7} {'target':>7}  met")
    for name, v, target in rows:
        print(f"{name:<32} {v:7.2f} {target:7.1f}  {'yes' if v <= target else 'NO'}")


if __name__ == "__main__":
    main()
