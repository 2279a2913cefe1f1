"""Where each custom CUDA kernel earns its keep: its territories, and the ones given up with their figures.

A territory is a region of problems: (op, implementation, rows, row length, dtypes, modes, contexts). Inside it
the kernel must beat the best compiler tier (torch.compile, Triton) by its cost-aware margin beyond the noise;
``tiered-ops check`` fails when it does not, or when the evidence has no CUDA result inside it. A retired
territory is given up: its reason (with the figures that decided it) is reported, never failed, and the check
says where the kernel wins there again.

Rows and row length (``rows_and_len``): for softmax the row is ``dim``, for rms_norm and layer_norm the
normalized shape (its product), for the elementwise ops (gelu, muladd) the last dim; rows = numel / row length.
Contexts: how a model calls the op; results without a ``context`` column were measured in ``eager``.

Kept out of every implementation's source files on purpose: declaring or retiring a territory must not change
a kernel's source hash, or the evidence that justified it would turn stale. The territories below are chosen
from the committed H100 and H200 results; ``python benchmarks/territories_from_results.py`` prints, per kernel
and case, the figures they rest on, so they can be derived again after the next sweep.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .catalog import get_op
from .policy import DEFAULT_MARGINS
from .registry import DTYPES, MODES, Tier

CONTEXTS = ("eager", "compiled", "graphed")


@dataclass(frozen=True)
class Territory:
    """A region a CUDA kernel exists for. Ranges are inclusive; an upper bound of None is unbounded."""

    name: str
    op: str
    impl: str
    rows: tuple[int, int | None]
    row_len: tuple[int, int | None]
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    contexts: tuple[str, ...] = ("eager",)
    why: str = ""

    def contains(self, rows: int, row_len: int, dtype: str, mode: str, context: str) -> bool:
        """The case (rows, row length, dtype, mode, context) of this territory's op lies inside it."""
        return (_inside(rows, self.rows) and _inside(row_len, self.row_len) and dtype in self.dtypes
                and mode in self.modes and context in self.contexts)

    def region(self) -> str:
        """Its region in words: "rows 1-32, row length 4096, bf16/fp32, fwd_nograd, eager"."""
        return (f"rows {_span(self.rows)}, row length {_span(self.row_len)}, {'/'.join(self.dtypes)}, "
                f"{'/'.join(self.modes)}, {'/'.join(self.contexts)}")


def _inside(v: int, span: tuple[int, int | None]) -> bool:
    return span[0] <= v and (span[1] is None or v <= span[1])


def _span(span: tuple[int, int | None]) -> str:
    lo, hi = span
    return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"


# ------------------------------------------------------------------------------------------- rows and length
_SHAPE = re.compile(r"^(scalar|\d+(?:x\d+)*)(?:,|$)")
_DIM = re.compile(r"(?:^|,)dim=(-?\d+)")
_NORMALIZED = re.compile(r"(?:^|,)normalized_shape=(?:\(([\d, ]*)\)|(\d+))")


def _parse(problem: str) -> tuple[tuple[int, ...], dict[str, Any]]:
    m = _SHAPE.match(problem)
    if not m:
        raise ValueError(f"rows_and_len: problem {problem!r} does not start with a shape like 16384x4096")
    shape = () if m.group(1) == "scalar" else tuple(int(d) for d in m.group(1).split("x"))
    kw: dict[str, Any] = {}
    if d := _DIM.search(problem):
        kw["dim"] = int(d.group(1))
    if n := _NORMALIZED.search(problem):
        kw["normalized_shape"] = tuple(int(x) for x in (n.group(1) or n.group(2)).replace(" ", "").split(",") if x)
    return shape, kw


def rows_and_len(op: str, problem: Any) -> tuple[int, int]:
    """(rows, row length) of ``problem`` (a ``Problem`` or its string, as results files hold it) of ``op``.

    The row is what the op reduces over, read from the problem's own parameters, so no op is named here: a
    ``normalized_shape`` (rms_norm, layer_norm: its product), else a ``dim`` (softmax), else the last dim
    (elementwise ops: gelu, muladd). Rows = numel / row length."""
    if isinstance(problem, str):
        shape, kw = _parse(problem)
    elif hasattr(problem, "shape") and hasattr(problem, "kw"):
        shape, kw = tuple(problem.shape), dict(problem.kw)
    else:
        raise ValueError(f"rows_and_len: problem: expected a Problem or its string like '16384x4096,dim=-1', got "
                         f"{problem!r}")
    if not shape:
        return 1, 1
    if kw.get("normalized_shape") is not None:
        ns = kw["normalized_shape"]
        ns = tuple(int(d) for d in ns) if isinstance(ns, (tuple, list)) else (int(ns),)
        if not ns or tuple(shape[len(shape) - len(ns):]) != ns:
            raise ValueError(f"rows_and_len: {op} normalized_shape {ns} is not the trailing dims of shape {shape}")
        return math.prod(shape[:len(shape) - len(ns)]), math.prod(ns)
    dim = int(kw.get("dim", -1))
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"rows_and_len: {op} dim {dim} is out of range for shape {shape}")
    return math.prod(s for i, s in enumerate(shape) if i != dim % len(shape)), shape[dim]


# ----------------------------------------------------------------------------------------------- the table
_SMALL, _ROW = (1, 32), (4096, 4096)  # the launch-bound default problems: 1x4096 and 32x4096
_BULK, _ANY = (512, None), (1, None)  # every default problem with 512 rows or more
_BOTH, _MODES = ("bf16", "fp32"), ("fwd_nograd", "fwd+bwd")
_LAUNCH = ("launch-bound: a few microseconds of GPU work in every tier; its host path (one torch.library op) costs "
           "less than torch.compile's guards and Triton's launcher")

TERRITORIES: tuple[Territory, ...] = (
    Territory("softmax.small-rows", "softmax", "cuda", _SMALL, _ROW, _BOTH, ("fwd_nograd",), why=_LAUNCH),
    Territory("rms_norm.small-rows", "rms_norm", "cuda", _SMALL, _ROW, ("bf16",), ("fwd_nograd",), why=_LAUNCH),
    Territory("layer_norm.small-rows", "layer_norm", "cuda", _SMALL, _ROW, ("bf16",), ("fwd_nograd",), why=_LAUNCH),
    Territory("gelu.small-rows", "gelu", "cuda", _SMALL, _ROW, _BOTH, ("fwd_nograd",), why=_LAUNCH),
    Territory("muladd.small-rows", "muladd", "cuda", _SMALL, _ROW, _BOTH, ("fwd_nograd",), why=_LAUNCH),
    # given up (RETIRED below)
    Territory("softmax.bulk", "softmax", "cuda", _BULK, _ANY, _BOTH, _MODES),
    Territory("softmax.small-rows-training", "softmax", "cuda", _SMALL, _ROW, _BOTH, ("fwd+bwd",)),
    Territory("rms_norm.bulk", "rms_norm", "cuda", _BULK, _ANY, _BOTH, _MODES),
    Territory("rms_norm.small-rows-fp32", "rms_norm", "cuda", _SMALL, _ROW, ("fp32",), ("fwd_nograd",)),
    Territory("rms_norm.small-rows-training", "rms_norm", "cuda", _SMALL, _ROW, _BOTH, ("fwd+bwd",)),
    Territory("layer_norm.bulk", "layer_norm", "cuda", _BULK, _ANY, _BOTH, _MODES),
    Territory("layer_norm.long-rows", "layer_norm", "cuda", (1, 511), (8192, None), _BOTH, _MODES),
    Territory("layer_norm.small-rows-fp32", "layer_norm", "cuda", _SMALL, _ROW, ("fp32",), ("fwd_nograd",)),
    Territory("layer_norm.small-rows-training", "layer_norm", "cuda", _SMALL, _ROW, _BOTH, ("fwd+bwd",)),
    Territory("gelu.bulk", "gelu", "cuda", _BULK, _ANY, _BOTH, _MODES),
    Territory("gelu.small-rows-training", "gelu", "cuda", _SMALL, _ROW, _BOTH, ("fwd+bwd",)),
    Territory("muladd.bulk", "muladd", "cuda", _BULK, _ANY, _BOTH, _MODES),
    Territory("muladd.small-rows-training", "muladd", "cuda", _SMALL, _ROW, _BOTH, ("fwd+bwd",)),
)

# territory name -> why it is given up, with the figures (`python benchmarks/territories_from_results.py` on the
# committed results: the best compiler tier's time over the kernel's, and the bar 1 + margin + noise it must clear).
_EVIDENCE = ("Evidence (tree 8bc592a): reports/nvidia-h100/results.csv at commit ac3fbc1 and "
             "reports/nvidia-h200/tree-8bc592a/results.csv.")
# The small-rows territories were held on that evidence; measured again with the eager fast path (which brings the
# Triton tier's launch path to about eager's), none holds.
_FAST = "Evidence: reports/nvidia-h100/results.csv (the eager fast path's tree, 2026-11-23; no H200 sweep of it)."
RETIRED: dict[str, str] = {
    "softmax.small-rows": "with the Triton tier launched directly, a tie at every case: 1x4096 bf16 1.19x Triton "
    "against a bar of 1.61x, 32x4096 bf16 1.20x against 1.31x, fp32 1.26x against 1.30x and 0.89x. " + _FAST,
    "rms_norm.small-rows": "ties Triton launched directly: 1x4096 bf16 1.28x against a bar of 1.71x, 32x4096 1.27x "
    "against 1.65x. " + _FAST,
    "layer_norm.small-rows": "ties Triton launched directly: 1x4096 bf16 1.02x against a bar of 1.26x, 32x4096 "
    "0.96x against 1.87x. " + _FAST,
    "gelu.small-rows": "ties Triton launched directly at every case: bf16 1.25x / 1.26x against bars of 1.28x, fp32 "
    "1.29x against 1.57x and 0.97x against 2.38x. " + _FAST,
    "muladd.small-rows": "wins at 3 of 4 cases by 1.02-1.03x its bar (32x4096 bf16 1.34x against 1.31x, 1x4096 bf16 "
    "1.36x against 1.32x, 32x4096 fp32 1.58x against 1.55x) and ties at 1x4096 fp32 (1.31x against 1.59x): too close "
    "to hold after the next sweep, on one GPU's evidence. " + _FAST,
    "softmax.bulk": "bandwidth-bound, won at 0 of 16 cases on the H100 and 1 of 16 on the H200 (512x393216 bf16 "
    "fwd_nograd: 1.14x Triton, bar 1.11x); 4096x32768 bf16 fwd_nograd: 0.65x Triton on both, 16384x4096 bf16: 0.95x / "
    "0.70x Triton (Nsight Compute on the H100, ncu.txt: Triton's occupancy and registers, 1.54x its cycles). At "
    "65536x256 it is 0.90-1.87x compile: ties, inside the host-time noise. " + _EVIDENCE,
    "softmax.small-rows-training": "1.4-2.2x faster than compile (host-bound on both sides), but their host p20-p80 "
    "spreads reach 50-300 %: won at 3 of 4 cases on the H100, 1 of 4 on the H200 (1x4096 fp32: 1.44x against a bar "
    "of 4.30x / 1.66x against 2.53x). " + _EVIDENCE,
    "rms_norm.bulk": "won at 3 of 12 cases on the H100, 0 of 12 on the H200; 16384x4096 bf16 fwd_nograd: 0.92x / "
    "0.83x Triton, 4096x32768 bf16: 0.79x Triton / 0.66x compile. Its H100 wins (65536x256 bf16 both modes, fp32 "
    "fwd+bwd: 1.8-2.1x compile) are ties on the H200 (1.28-1.54x against bars of 1.37-3.23x). " + _EVIDENCE,
    "rms_norm.small-rows-fp32": "wins on both GPUs, but 32x4096 on the H100 by 2.18x against a bar of 2.15x: too close "
    "to hold after the next sweep (1x4096: 2.35x / 2.52x against 1.29x / 1.32x). Declare it again if the next "
    "sweep clears it with room. " + _EVIDENCE,
    "rms_norm.small-rows-training": "1.3-3.3x faster than compile, inside the host-time noise at 3 of 4 cases on "
    "each GPU (32x4096 bf16: 1.29x against a bar of 1.63x / 1.57x against 1.87x). " + _EVIDENCE,
    "layer_norm.bulk": "won at 2 of 12 cases on each GPU; 4096x32768 bf16 fwd_nograd: 0.71x Triton / compile, "
    "16384x4096 bf16: 0.94x compile / 0.71x Triton. The wins hold on one GPU only (65536x256 bf16 fwd_nograd "
    "1.91x on the H100; 16384x4096 bf16 fwd+bwd 1.56x against 1.55x on the H200) or beat Triton alone: at 65536x256 "
    "fp32 fwd+bwd (3.82x / 3.18x) compile is out, failing its gate (grad at normalized_shape=(1,), rel error 17). "
    + _EVIDENCE,
    "layer_norm.long-rows": "16x64x256x256 (64x256x256 normalized): 0.18-0.31x compile in the forward and in bf16 "
    "training, 0.58-0.67x Triton in fp32 training, on both GPUs; a row per thread block leaves 16 blocks for the "
    "whole GPU. " + _EVIDENCE,
    "layer_norm.small-rows-fp32": "on the H200 32x4096 is 1.93x compile against a bar of 2.02x (compile's host "
    "spread 96 %): a tie, and 1x4096 1.99x against 1.91x; on the H100 both win (1.93x against 1.26x / 1.28x). "
    + _EVIDENCE,
    "layer_norm.small-rows-training": "bf16: 0.75-1.54x compile against bars of 2.1-2.6x (ties); fp32 wins 2.4-3.7x "
    "but against Triton alone, compile failing its gate there (grad at normalized_shape=(1,), rel error 17): a "
    "verdict that changes when that is fixed. " + _EVIDENCE,
    "gelu.bulk": "bandwidth-bound: 16384x4096 at 0.69-0.95x compile/Triton on both GPUs (bf16 fwd_nograd 0.73x / "
    "0.70x), 65536x256 fwd_nograd ties (0.99x / 1.02x); won at 1 of 8 cases on the H100 and 2 of 8 on the H200 "
    "(65536x256 bf16 fwd+bwd, 2.12x / 2.41x against 1.58x / 2.12x, too close on the H200). " + _EVIDENCE,
    "gelu.small-rows-training": "1.3-2.5x faster than compile, inside the host-time noise at 3 of 4 cases on the "
    "H100 and 2 of 4 on the H200 (32x4096 bf16: 1.72x against a bar of 1.94x / 1.33x against 3.18x). " + _EVIDENCE,
    "muladd.bulk": "ties the compiler tiers at copy bandwidth (16384x4096: 1.00x on both GPUs, every dtype and mode) "
    "and loses with broadcast operands (16384x4096 by a 4096 row: 0.20-0.75x compile); won at 2 of 12 cases on the "
    "H100 (65536x256 bf16: 1.46x, 1.88x), 0 of 12 on the H200 (1.08x, 1.60x: ties). " + _EVIDENCE,
    "muladd.small-rows-training": "1.4-2.5x faster than compile, inside the host-time noise at 3 of 4 cases on the "
    "H100 and 2 of 4 on the H200 (32x4096 bf16: 1.72x against a bar of 2.31x / 1.92x against 2.47x). " + _EVIDENCE,
}


def validate(territories: tuple[Territory, ...] | list[Territory] = TERRITORIES,
             retired: dict[str, str] | None = None) -> None:
    """Raise ValueError naming the entry when a territory names an unknown op, a non-CUDA implementation, an unknown
    dtype, mode or context, an empty range, a name used twice or retired without being declared, or overlaps
    another territory of its kernel (a case must belong to one territory)."""
    retired = RETIRED if retired is None else retired
    names = [t.name for t in territories]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"territories: names used twice: {', '.join(dup)}")
    if unknown := sorted(set(retired) - set(names)):
        raise ValueError(f"territories: retired but not declared: {', '.join(unknown)}")
    for t in territories:
        impl = get_op(t.op).impls.get(t.impl)
        if impl is None or impl.tier != Tier.CUDA:
            raise ValueError(f"territory {t.name}: {t.op} has no CUDA implementation {t.impl!r}")
        for what, values, known in (("dtype", t.dtypes, DTYPES), ("mode", t.modes, MODES),
                                    ("context", t.contexts, CONTEXTS)):
            if not values or set(values) - set(known):
                raise ValueError(f"territory {t.name}: {what}s {values}: expected some of {', '.join(known)}")
        for what, (lo, hi) in (("rows", t.rows), ("row_len", t.row_len)):
            if lo < 0 or (hi is not None and hi < lo):
                raise ValueError(f"territory {t.name}: {what} ({lo}, {hi}) is no range (0 <= low <= high)")
    for i, a in enumerate(territories):
        for b in territories[i + 1:]:
            if (a.op, a.impl) == (b.op, b.impl) and _meet(a.rows, b.rows) and _meet(a.row_len, b.row_len) and \
                    set(a.dtypes) & set(b.dtypes) and set(a.modes) & set(b.modes) and set(a.contexts) & set(b.contexts):
                raise ValueError(f"territories {a.name} and {b.name} overlap: a case must belong to one territory")


def _meet(a: tuple[int, int | None], b: tuple[int, int | None]) -> bool:
    return (b[1] is None or a[0] <= b[1]) and (a[1] is None or b[0] <= a[1])


def markdown(territories: tuple[Territory, ...] | list[Territory] = TERRITORIES,
             retired: dict[str, str] | None = None) -> str:
    """The README's section on which CUDA kernel defends what (tests/test_check.py holds the README to it)."""
    retired = RETIRED if retired is None else retired
    held = [t for t in territories if t.name not in retired]
    lines = ["## Which CUDA kernels defend what", "",
             "A custom CUDA kernel is kept for the territories it exists for (`tiered_ops/territories.py`): inside "
             "one it must beat the best compiler tier (torch.compile, Triton) by its "
             f"{100 * DEFAULT_MARGINS['cuda']:.0f} % margin beyond the noise, or `tiered-ops check` fails (CI checks "
             "every committed `reports/<gpu>/results.csv`). Everywhere else the compiler tiers are the answer. The "
             "check compares with the compiler tiers only: where plain eager is faster still, selection picks eager.",
             ""]
    if held:
        lines += ["| kernel | territory | region |", "|---|---|---|"]
        lines += [f"| {t.op} {t.impl} | {t.name} | {t.region()} |" for t in held]
    else:
        lines += ["**No CUDA kernel defends a territory on the committed evidence**: everywhere it was measured, a "
                  "compiler tier (or Triton launched as cheaply as eager) is as fast within the noise, or faster. The "
                  "kernels stay, measured and reported, for the check to flag where one wins again."]
    whys = {t.why: [u.name for u in held if u.why == t.why] for t in held if t.why}
    lines += [""] + [f"Why {', '.join(names)}: {why}." for why, names in whys.items()]
    gone = [t.name for t in territories if t.name in retired]
    lines += ["", f"Given up ({len(gone)}; reported by the check, never failed, each with its figures in "
              "`tiered_ops/territories.py`): " + ", ".join(gone) + "."]
    return "\n".join(lines) + "\n"
