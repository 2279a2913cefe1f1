"""``tiered-ops check``: does each custom CUDA kernel still pay for itself?

For every CUDA implementation, on each of its op's target problems (the op's default GPU problems) and each
(dtype, mode) in the evidence, the kernel must beat the best correct compiler-tier implementation (eager,
compile, Triton) by more than its cost-aware margin (``policy.margins``, CUDA 10 % by default) plus the
noise: the larger relative p20-p80 spread of the two, each compared only with rows of its own device fingerprint
(several GPUs' results checked together are never mixed). A kernel that fails anywhere fails the check (exit 1),
listed with its figures and the tier to retire it to (the best compiler tier there). The check also fails
when the evidence is stale: a CUDA or Triton row whose source hash differs from the source in the tree.
A kernel marked retired (``Impl.retired``: the reason) is reported, not failed, and is flagged when it
starts winning again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from .catalog import get_op
from .policy import margins
from .registry import OpSpec, Tier
from .timing import caller_range


@dataclass
class Finding:
    kind: str  # "loses", "stale", "retired", "retired-wins", "beats", "no-evidence"
    op: str
    impl: str
    text: str

    @property
    def fails(self) -> bool:
        return self.kind in ("loses", "stale", "no-evidence")


def _spread(r: Any) -> float:
    """The p20-p80 width of a caller's time relative to it (``timing.caller_range``: host spread included)."""
    lo, hi = caller_range(r)
    return max(0.0, (hi - lo) / r.caller_us) if r.caller_us else 0.0


def _latest(df: pd.DataFrame) -> pd.DataFrame:
    """The newest row per (device, op, impl, problem, dtype, mode): CSV order, then timestamp."""
    df = df.reset_index(drop=True).assign(_order=lambda d: range(len(d)))
    keys = ["device_key", "op", "impl", "problem", "dtype", "mode"]
    return df.sort_values(["timestamp", "_order"]).groupby(keys, sort=False).tail(1)


def check(df: pd.DataFrame, specs: list[OpSpec] | None = None) -> list[Finding]:
    """Findings for every CUDA implementation of ``specs`` (default: every op that appears in ``df``)."""
    specs = specs if specs is not None else [get_op(o) for o in dict.fromkeys(df.op)]
    m = margins()["cuda"]
    rows = _latest(df)
    out: list[Finding] = []
    for spec in specs:
        mine = rows[rows.op == spec.name]
        for impl in (i for i in spec.impls.values() if i.tier in (Tier.CUDA, Tier.TRITON)):
            old = mine[(mine.impl == impl.name) & (mine.source_hash != impl.source_hash)]
            if len(old):
                out.append(Finding("stale", spec.name, impl.name,
                                   f"{len(old)} rows measured source {sorted(set(old.source_hash))[0]}, the tree has "
                                   f"{impl.source_hash}: measure again on the GPU (scripts/gpu.sh)"))
        targets = {str(p) for p in spec.default_problems("cuda")}
        for impl in (i for i in spec.impls.values() if i.tier == Tier.CUDA):
            retired = impl.retired
            cuda = mine[(mine.impl == impl.name) & (mine.source_hash == impl.source_hash) & (mine.ok == 1)
                        & mine.caller_us.notna() & mine.problem.isin(targets)]
            if cuda.empty:
                out.append(Finding("retired" if retired else "no-evidence", spec.name, impl.name,
                                   f"no fresh timed result at its target problems ({', '.join(sorted(targets))})"))
                continue
            losses, wins = [], []
            for r in cuda.itertuples():
                same = mine[(mine.device_key == r.device_key) & (mine.problem == r.problem) & (mine.dtype == r.dtype)
                            & (mine["mode"] == r.mode) & (mine.ok == 1) & mine.caller_us.notna()
                            & mine.tier.isin(["eager", "compile", "triton"])]
                same = same[same.impl.isin(list(spec.impls))]
                if same.empty:
                    continue
                best = same.loc[same.caller_us.idxmin()]
                need = 1 + m + max(_spread(r), _spread(best))
                ratio = best.caller_us / r.caller_us
                line = (f"{r.problem} {r.dtype} {r.mode}: cuda {r.caller_us:.1f} us vs {best.impl} "
                        f"{best.caller_us:.1f} us = {ratio:.2f}x, needs > {need:.2f}x")
                (wins if ratio > need else losses).append((line, best.tier))
            if retired:
                kind = "retired-wins" if wins else "retired"
                detail = f"retired ({retired})" + (f"; now wins at: {'; '.join(w for w, _ in wins)}" if wins else "")
                out.append(Finding(kind, spec.name, impl.name, detail))
            elif losses:
                to = pd.Series([t for _, t in losses]).mode()[0]
                out.append(Finding("loses", spec.name, impl.name,
                                   f"does not beat the compiler tiers at {len(losses)} of {len(losses) + len(wins)} "
                                   f"target cases; retire it to {to} or make it faster:\n    "
                                   + "\n    ".join(x for x, _ in losses)))
            else:
                out.append(Finding("beats", spec.name, impl.name, f"beats the compiler tiers at all {len(wins)} "
                                   "target cases") if wins else Finding(
                    "no-evidence", spec.name, impl.name, "no compiler-tier result to compare with at its targets"))
    return out


def report(findings: list[Finding]) -> str:
    lines = [f"{'FAIL' if f.fails else 'ok  '} {f.op} {f.impl} [{f.kind}]: {f.text}" for f in findings]
    n = sum(f.fails for f in findings)
    lines.append(f"{n} failing of {len(findings)} findings" if n else f"check passed ({len(findings)} findings)")
    return "\n".join(lines)
