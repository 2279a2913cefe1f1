"""Kernels that lost honestly and are kept: measured, reported, reported (not failed) by ``tiered-ops check``.

Kept out of every implementation's source files on purpose: retiring a kernel must not change its source
hash, or the evidence that justified retiring it would turn stale. Each entry names the evidence (the
results file) and the figures, as ``tiered-ops check`` printed them; a retired kernel that starts winning
again is flagged by the check.
"""

from __future__ import annotations

from .registry import OPS

# (op, implementation) -> why it is retired, with the evidence. Figures: `tiered-ops check --results` on the
# committed results of both GPUs; "loses at a of b" counts the target cases (default problems x dtype x mode) where
# it does not beat the best compiler tier by its 10 % margin plus the noise.
_EVIDENCE = "reports/nvidia-h100/results.csv and reports/nvidia-h200/results.csv (2026-11-23)"
RETIRED: dict[tuple[str, str], str] = {
    ("softmax", "cuda"): "v2 (row in registers) loses at 24 of 24 target cases on the H100 and 23 of 24 on the H200; "
    "16384x4096 bf16 fwd: 0.95x / 0.70x Triton, 4096x32768 bf16: 0.65x / 0.65x Triton (Nsight Compute on the H100: "
    "same occupancy and registers as Triton, 1.54x its cycles, DRAM 54 % vs 83 % of peak). Retire to triton (eager "
    "at 1x4096). Evidence: " + _EVIDENCE,
    ("rms_norm", "cuda"): "v2 loses at 18 of 20 (H100) and 20 of 20 (H200) target cases; 16384x4096 bf16 fwd: 0.92x / "
    "0.83x Triton; 4096x32768 bf16: 0.79x Triton (H100) / 0.66x compile (H200). Retire to triton/compile. "
    "Evidence: " + _EVIDENCE,
    ("layer_norm", "cuda"): "v2 loses at 22 of 24 (H100) and 24 of 24 (H200) target cases; 4096x32768 bf16 fwd: "
    "0.71x Triton / 0.71x compile; 16384x4096 bf16: 0.94x compile / 0.71x Triton. Retire to triton/compile. "
    "Evidence: " + _EVIDENCE,
    ("gelu", "cuda"): "v1 loses at 16 of 16 (H100) and 14 of 16 (H200) target cases; 16384x4096 bf16 fwd: "
    "0.73x Triton / 0.70x compile. Retire to triton/compile (eager at 1x4096). Evidence: " + _EVIDENCE,
    ("muladd", "cuda"): "v1 ties the compiler tiers at copy bandwidth (16384x4096 bf16: 1.00x Triton on the H100, "
    "1.00x compile on the H200), loses at 1x4096 bf16 (0.61x / 0.63x eager addcmul) and with broadcast operands "
    "(16384x4096 by a 4096 row, bf16: 0.24x / 0.20x compile, which does not expand them); 20 of 20 / 19 of 20 target "
    "cases lost. Retire to compile (eager_addcmul at small shapes). Evidence: " + _EVIDENCE,
}


def apply(table: dict[tuple[str, str], str] | None = None) -> None:
    """Mark the implementations in ``table`` (default RETIRED) retired; an unknown name is an error."""
    for (op, impl), why in (RETIRED if table is None else table).items():
        spec = OPS.get(op)
        if spec is None or impl not in spec.impls:
            raise KeyError(f"tiered_ops/retired.py: {op} has no implementation {impl!r}")
        spec.impls[impl].retired = why
