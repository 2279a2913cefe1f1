"""``tiered-ops check``: does each custom CUDA kernel still hold the territories it exists for?

A territory (``tiered_ops/analysis/territories.py``) is a region of problems: op, implementation, rows, row length,
dtypes, modes, contexts. In every case of the evidence inside it, the kernel must beat the best correct
compiler-tier implementation (torch.compile, Triton; never eager) of the same device, problem, dtype, mode and
context by more than its cost-aware margin (``policy.margins()["cuda"]``, 10 % by default) plus the noise: the
larger relative p20-p80 spread of the two rows' kernel time, and of their host time where the row is host-bound
(host time above kernel time) in the eager context, where the launch path is what a caller pays.

A case is won when best compiler time / kernel time > 1 + margin + noise, lost when it falls short of 1 + margin
by more than the noise, and tied in between. A tie fails like a loss: the kernel has not shown that it pays for
itself there, and the cost-aware policy gives a tie to the cheaper tier, so it would not be picked in its own
territory. The check also fails when a held territory has no fresh, correct CUDA result on a device of the
evidence, and when the evidence is stale (a CUDA or Triton row measured another source than the tree's); a held
territory whose op has no row at all in the evidence (declared before a sweep measured it) is reported as not yet
measured and never fails. A territory may carry its own margin. A retired territory is reported with its reason
and its figures on this evidence (cases won, the best ratio against its bar, each case) and never fails; the
check says where the kernel wins there again. A row the sweep pruned (``pruned: ...``: a short timing, clearly
slower than the fastest of its case) is judged on that short timing. Cases of a kernel that fall in none of its
territories are reported. Rows of a CUDA or Triton implementation no longer in the catalog (its sources deleted; the
committed evidence keeps them) are ignored, neither judged nor rivals, and reported once per implementation as removed.

Each CUDA kernel of the catalog then gets one statement: the territories it defends (territories / cases won), or,
where it holds none, why it stays (``kernels`` in ``territories.json``: a reason and its evidence, with its figures
computed here: in how many cases of the evidence the fastest correct tier, the default policy's pick, is this
kernel beyond the noise). A kernel that holds no territory, states no reason and has rows in the evidence fails;
so does one that stays as ``picked`` where the evidence picks it nowhere. One with no row in the evidence (a new
op's kernel before a sweep measured it) is reported as not yet measured and never fails.

The report ends with one line: ``cuda: N kernels defend M cases in T territories; K territories retired``
(the territories that hold, their kernels and cases; the retired territories checked), followed, where there are
any, by the kernels that stay without a territory (per reason), those not yet measured, those failing for want
of one and the kernels removed from the catalog whose rows were ignored.

Which evidence gates (``check_gpus``): that of the current GPUs (``reports/gpus.toml``, ``gpus.py``), judged together,
each device on its own rows. An archived GPU's evidence is history: checked for information only, one line per
stale or failing finding under a line naming it archived with the tree and the day of its last sweep; it never fails.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pandas as pd

from ..decide.policy import margins
from ..registry import OpSpec, Tier
from ..store.rows import figure, launch_sensitive, seconds_apart
from ..tiers.catalog import all_ops, get_op
from .analysis import CASE, latest, unchecked, winners, with_context
from .gpus import Gpus
from .territories import KERNELS, REASONS, RETIRED, TERRITORIES, Stay, Territory, rows_and_len, validate

COMPILER_TIERS = ("compile", "triton")


@dataclass
class Finding:
    # fail: "stale", "broken" (a CUDA row inside failed its gate), "loses", "ties", "no-evidence", "defends-nothing"
    # (a kernel that holds no territory, states no reason and has rows), "unfounded" (stays as picked, picked nowhere);
    # reported: "defends", "retired", "retired-wins", "outside", "unmeasured" (a held territory whose op has no row
    # at all in the evidence: declared before any sweep measured it; a kernel with no row of its own), "kernel" (what
    # a kernel with held territories defends), "stays" and "remove" (a kernel without one: its stated reason),
    # "removed" (rows of a kernel no longer in the catalog: ignored)
    kind: str
    op: str
    impl: str
    text: str
    territory: str | None = None
    cases: int = 0  # cases judged inside the territory
    won: int = 0
    kernel: bool = False  # the kernel's own statement (one per CUDA kernel), not a territory's
    reason: str | None = None  # a kernel's stated reason to stay without a territory (territories.REASONS)

    @property
    def fails(self) -> bool:
        return self.kind in ("stale", "broken", "loses", "ties", "no-evidence", "defends-nothing", "unfounded")


def noise(r: object, context: str) -> float:
    """A row's relative p20-p80 spread: the kernel time's, and where the row is host-bound in the eager context
    the host time's as well (the larger)."""
    get = functools.partial(figure, r)
    p20, p50, p80 = get("p20_us"), get("p50_us"), get("p80_us")
    kernel = (p80 - p20) / p50 if p20 is not None and p80 is not None and p50 else 0.0
    host, h20, h80 = get("host_us"), get("host_p20_us"), get("host_p80_us")
    if context == "eager" and host and p50 is not None and host > p50 and h20 is not None and h80 is not None:
        return max(kernel, (h80 - h20) / host, 0.0)
    return max(kernel, 0.0)


def cases(df: pd.DataFrame, specs: list[OpSpec] | None = None) -> pd.DataFrame:
    """Every fresh CUDA row of ``specs`` (default: the ops in ``df``) judged against the best compiler tier of its
    case: rows, row length, the kernel's and the best compiler tier's time, ratio (theirs over the kernel's),
    the bar (1 + margin + noise), the noise, a verdict: "wins", "ties", "loses", "failed" (the CUDA row did
    not pass its gate or has no time) or "no-compiler" (no timed compiler-tier row to compare with), the
    compiler-tier implementations it was compared with, and ``apart_h``: the hours between the two rows compared,
    where one is launch-sensitive (``rows.launch_sensitive``: its caller time would follow the host's) and they
    were timed over an hour apart, in different runs and maybe on different hosts (else None)."""
    specs = specs if specs is not None else [get_op(o) for o in dict.fromkeys(df.op)]
    m = margins()["cuda"]
    newest = latest(df)  # (with the eager context where a row names none)
    # The compiler tiers' rivals: each one timed, correct or never gated (a sweep times them before their gate and
    # gates them only where a choice would take them), so a CUDA kernel is measured against them all.
    rival = newest.caller_us.notna() & ((newest.ok == 1) | unchecked(newest).notna())
    comp = newest[rival & newest.tier.isin(COMPILER_TIERS)]
    best = comp.loc[comp.groupby(CASE, sort=False).caller_us.idxmin()].set_index(CASE) if len(comp) else None
    timed = comp.groupby(CASE, sort=False).impl.agg(lambda s: ",".join(sorted(s))) if len(comp) else {}
    out = []
    for spec in specs:
        for impl in (i for i in spec.impls.values() if i.tier == Tier.CUDA):
            mine = newest[(newest.op == spec.name) & (newest.impl == impl.name)
                          & (newest.source_hash == impl.source_hash)]
            for r in mine.itertuples():
                rows, n = rows_and_len(spec.name, r.problem)
                key = tuple(getattr(r, k) for k in CASE)
                row = dict(device_key=r.device_key, op=spec.name, impl=impl.name, problem=r.problem, dtype=r.dtype,
                           mode=r.mode, context=r.context, rows=rows, row_len=n, cuda_us=r.caller_us,
                           best_impl=None, best_us=None, ratio=None, need=None, noise=None, verdict="failed",
                           reason=None if r.ok == 1 else str(r.reason), compared=timed.get(key, ""), apart_h=None)
                if r.ok == 1 and pd.notna(r.caller_us):
                    b = best.loc[key] if best is not None and key in best.index else None
                    if b is None:
                        row["verdict"] = "no-compiler"
                    else:
                        s = max(noise(r, r.context), noise(b, r.context))
                        ratio = b.caller_us / r.caller_us
                        edge = ratio - (1 + m)
                        row.update(best_impl=b.impl, best_us=b.caller_us, ratio=ratio, need=1 + m + s, noise=s,
                                   verdict="wins" if edge > s else "loses" if edge < -s else "ties",
                                   apart_h=_apart_h(r._asdict(), b.to_dict()))
                out.append(row)
    cols = ["device_key", "op", "impl", "problem", "dtype", "mode", "context", "rows", "row_len", "cuda_us",
            "best_impl", "best_us", "ratio", "need", "noise", "verdict", "reason", "compared", "apart_h"]
    return pd.DataFrame(out, columns=cols)


def _apart_h(a: dict, b: dict) -> float | None:
    """Hours between two rows' timings where one is launch-sensitive and they are ``APART_S`` or more apart, else
    None: a launch-bound comparison across runs compares host states as much as implementations."""
    apart = seconds_apart(a, b)
    return None if apart is None or not (launch_sensitive(a) or launch_sensitive(b)) else apart / 3600


def _line(c: object) -> str:
    shape = c.problem.split(",")[0]
    where = f"{shape} {c.dtype} {c.mode}" + ("" if c.context == "eager" else f" {c.context}")
    if c.verdict == "failed":
        return f"{where}: the CUDA row failed ({c.reason})"
    if c.verdict == "no-compiler":
        return f"{where}: no correct compiler-tier result to compare with"
    return (f"{where}: {c.best_impl} {c.best_us:.1f} us / cuda {c.cuda_us:.1f} us = {c.ratio:.2f}x, "
            f"needs > {c.need:.2f}x [{c.verdict}]")


def _gpu(rows: pd.DataFrame) -> pd.Series:
    """Each row's GPU: its ``gpu_name`` where it has one, else its device key."""
    return rows.gpu_name.where(rows.gpu_name.notna(), rows.device_key) if "gpu_name" in rows else rows.device_key


def _stale(rows: pd.DataFrame, spec: OpSpec) -> list[Finding]:
    out = []
    mine = rows[rows.op == spec.name]
    for impl in (i for i in spec.impls.values() if i.tier in (Tier.CUDA, Tier.TRITON)):
        old = mine[(mine.impl == impl.name) & (mine.source_hash != impl.source_hash)]
        for name, rows_of in old.groupby(_gpu(old), sort=True):  # the rows named by their GPU: the one to measure again
            out.append(Finding("stale", spec.name, impl.name,
                               f"{len(rows_of)} rows of {name} measured source {sorted(set(rows_of.source_hash))[0]}"
                               f", the tree has {impl.source_hash}: measure again on the GPU (scripts/gpu.sh)"))
    return out


def removed(df: pd.DataFrame, specs: list[OpSpec] | None = None) -> pd.Series:
    """Which rows are of a kernel tier (CUDA, Triton) of ``specs`` (default: the catalog) whose implementation is no
    longer in the catalog (its sources deleted; the evidence keeps them)."""
    names = {s.name: s for s in (all_ops() if specs is None else specs)}
    return pd.Series([op in names and impl not in names[op].impls and tier in ("cuda", "triton")
                      for op, impl, tier in zip(df.op, df.impl, df.tier)], index=df.index, dtype=bool)


def _removed(df: pd.DataFrame, specs: list[OpSpec]) -> tuple[pd.Series, list[Finding]]:
    """The rows of a removed kernel (``removed``), ignored; and one finding per such implementation, never failing."""
    gone = removed(df, specs)
    out = []
    for (op, impl), rows_of in df[gone].groupby(["op", "impl"], sort=True):
        per = ", ".join(f"{n} of {g}" for g, n in rows_of.groupby(_gpu(rows_of), sort=True).size().items())
        out.append(Finding("removed", op, impl, f"no longer in the catalog (its sources were deleted): its rows in "
                           f"this evidence ({per}) are ignored by the check"))
    return gone, out


def _judge(inside: pd.DataFrame, margin: float) -> pd.DataFrame:
    """The cases again under a territory's own margin: bar and verdict (failed and no-compiler cases as they were)."""
    inside = inside.copy()
    timed = inside.ratio.notna()
    edge = inside.ratio - (1 + margin)
    inside.loc[timed, "need"] = 1 + margin + inside.noise[timed]
    inside.loc[timed, "verdict"] = ["wins" if e > n else "loses" if e < -n else "ties"
                                    for e, n in zip(edge[timed], inside.noise[timed])]
    return inside


def _figures(inside: pd.DataFrame) -> str:
    """A retired territory's figures on this evidence: cases won of judged, the closest and each case."""
    if inside.empty:
        return "no case of it in this evidence"
    timed = inside[inside.ratio.notna()]
    won = int((inside.verdict == "wins").sum())
    text = f"on this evidence it wins {won} of {len(inside)} cases"
    if len(timed):
        r = timed.ratio / timed.need
        best = timed.loc[r.idxmax()]
        text += f" (its best {best.ratio:.2f}x against a bar of {best.need:.2f}x)"
    return text + ":\n    " + "\n    ".join(_line(c) for c in inside.itertuples())


def _held(t: Territory, inside: pd.DataFrame, devices: list[str], stale_inside: int) -> Finding:
    lines = [f"no fresh CUDA result inside it on {dev}" + (f" ({stale_inside} stale CUDA rows)" if stale_inside else "")
             for dev in devices if inside[inside.device_key == dev].empty]
    bad = inside[inside.verdict != "wins"]
    lines += [_line(c) for c in bad.itertuples()]
    v = set(bad.verdict)
    kind = ("broken" if "failed" in v else "loses" if "loses" in v else "ties" if "ties" in v
            else "no-evidence" if lines else None)
    won = int((inside.verdict == "wins").sum())
    if kind is None:
        r, n = inside.ratio / inside.need, len(inside)
        text = (f"defends {t.name} ({t.region()}): wins all {n} cases, the closest at {inside.ratio[r.idxmin()]:.2f}x "
                f"against a bar of {inside.need[r.idxmin()]:.2f}x")
        return Finding("defends", t.op, t.impl, text, t.name, n, won)
    text = (f"does not hold {t.name} ({t.region()}): {won} of {len(inside)} cases won; retire the territory "
            "(tiered_ops/analysis/territories.json, with the reason) or make the kernel faster:\n    "
            + "\n    ".join(lines))
    return Finding(kind, t.op, t.impl, text, t.name, len(inside), won)


def check(df: pd.DataFrame, specs: list[OpSpec] | None = None, territories: list[Territory] | None = None,
          retired: dict[str, str] | None = None, kernels: list[Stay] | None = None) -> list[Finding]:
    """Findings for the CUDA kernels of ``specs`` (default: every op of the catalog, in ``df`` or in ``territories``)
    over ``territories`` (default: ``territories.TERRITORIES``, of the checked ops) with ``retired`` (default RETIRED)
    and the kernels' reasons to stay without a territory, ``kernels`` (default KERNELS)."""
    territories = list(TERRITORIES if territories is None else territories)
    retired = RETIRED if retired is None else retired
    kernels = list(KERNELS if kernels is None else kernels)
    validate(territories, retired, kernels)
    df = with_context(df)
    if specs is None:
        specs = [get_op(o) for o in dict.fromkeys([*(s.name for s in all_ops()), *df.op,
                                                   *(t.op for t in territories)])]
    names = {s.name for s in specs}
    territories = [t for t in territories if t.op in names]
    devices = list(dict.fromkeys(df.device_key))
    gone, out = _removed(df, specs)
    df = df[~gone]
    newest = latest(df)
    judged = cases(df, specs)
    out += [f for spec in specs for f in _stale(newest, spec)]
    placed = pd.Series(False, index=judged.index)
    measured_ops = set(df.op)
    for t in territories:
        mask = (judged.op == t.op) & (judged.impl == t.impl) & pd.Series(
            [t.contains(r.rows, r.row_len, r.dtype, r.mode, r.context, r.problem) for r in judged.itertuples()],
            index=judged.index, dtype=bool)
        placed |= mask
        inside = judged[mask] if t.margin is None else _judge(judged[mask], t.margin)
        if t.name in retired:
            wins = inside[inside.verdict == "wins"]
            text = f"retired {t.name} ({t.region()}): {retired[t.name]}; {_figures(inside)}"
            if len(wins):
                text += f"\n    now wins at {len(wins)} of {len(inside)} cases: declare it again if that holds"
            out.append(Finding("retired-wins" if len(wins) else "retired", t.op, t.impl, text, t.name, len(inside),
                               len(wins)))
            continue
        if t.op not in measured_ops:  # declared before any sweep of its op: nothing to judge, nothing stale
            out.append(Finding("unmeasured", t.op, t.impl, f"not yet measured: {t.name} ({t.region()}) has no row of "
                               f"{t.op} in this evidence" + (f"; declared on: {t.claimed}" if t.claimed else ""),
                               t.name))
            continue
        stale = newest[(newest.op == t.op) & (newest.impl == t.impl)
                       & (newest.source_hash != get_op(t.op).impls[t.impl].source_hash)]
        stale_inside = sum(t.contains(*rows_and_len(t.op, r.problem), r.dtype, r.mode, r.context, r.problem)
                           for r in stale.itertuples())
        out.append(_held(t, inside, devices, stale_inside))
    stays = {(k.op, k.impl): k for k in kernels}
    statements = [_kernel(spec, impl.name, [t for t in territories if (t.op, t.impl) == (spec.name, impl.name)
                                            and t.name not in retired], out, stays.get((spec.name, impl.name)), newest)
                  for spec in specs for impl in spec.impls.values() if impl.tier == Tier.CUDA]
    out += statements
    for spec in specs:
        for impl in (i for i in spec.impls.values() if i.tier == Tier.CUDA):
            mine = judged[(judged.op == spec.name) & (judged.impl == impl.name)]
            if not any((t.op, t.impl) == (spec.name, impl.name) for t in territories):
                continue
            loose = mine[~placed[mine.index]]
            if len(loose):
                out.append(Finding("outside", spec.name, impl.name, f"{len(loose)} cases fall in none of its "
                                   "territories: " + "; ".join(sorted({f"{c.problem.split(',')[0]} {c.dtype} {c.mode}"
                                                                       for c in loose.itertuples()}))))
    return out


def _picks(spec: OpSpec, impl: str, newest: pd.DataFrame) -> tuple[str, int]:
    """In how many cases of the evidence (per device and context) the fastest correct tier of ours, the default
    policy's pick (``analysis.winners``), is ``impl`` beyond the noise (its p20-p80 range clear of the runner-up's),
    and its largest lead there; the stale rows of the kernel tiers left out. (text, cases picked beyond the noise)"""
    rows = newest[newest.op == spec.name]
    kernel_tiers = (Tier.CUDA, Tier.TRITON)
    fresh = [i not in spec.impls or spec.impls[i].tier not in kernel_tiers or h == spec.impls[i].source_hash
             for i, h in zip(rows.impl, rows.source_hash)]
    rows = rows[pd.Series(fresh, index=rows.index, dtype=bool)]
    parts = [winners(g) for _, g in rows.groupby(["device_key", "context"], sort=False)]
    w = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if w.empty:
        return "no case of its op with a correct timed result in this evidence", 0
    mine = w[w.winner == impl]
    clear = mine[~mine.tie.astype(bool)]
    text = (f"on this evidence the fastest correct tier (the default policy's pick) is this kernel in {len(clear)} of "
            f"{len(w)} cases beyond the noise")
    if len(clear):
        top = clear.loc[clear.margin.idxmax()]
        text += (f" (its largest lead {top.margin:.2f}x over {top.runner_up} at {top.problem.split(',')[0]} "
                 f"{top['dtype']} {top['mode']})")
    if len(mine) > len(clear):
        text += f", in {len(mine) - len(clear)} more within it"
    return text, len(clear)


def _kernel(spec: OpSpec, impl: str, held: list[Territory], found: list[Finding], stay: Stay | None,
            newest: pd.DataFrame) -> Finding:
    """One CUDA kernel's statement: the held territories it defends, else why it stays (``stay``) with its figures
    on this evidence, not yet measured where the evidence has no row of it, or a failure where it states no reason."""
    op = spec.name
    defended = [f for f in found if f.kind == "defends" and (f.op, f.impl) == (op, impl)]
    measured = bool(((newest.op == op) & (newest.impl == impl)).any())
    if defended:
        n = len(defended)
        return Finding("kernel", op, impl, f"defends {n} {'territory' if n == 1 else 'territories'} / "
                       f"{sum(f.won for f in defended)} cases: {', '.join(str(f.territory) for f in defended)}",
                       kernel=True)
    if held and measured:  # the held territories' own findings fail and say why
        return Finding("kernel", op, impl, f"defends none of its {len(held)} held territories on this evidence: "
                       + ", ".join(t.name for t in held), kernel=True)
    if not measured and (held or stay is None):
        return Finding("unmeasured", op, impl, f"not yet measured: no row of {op} {impl} in this evidence"
                       + (f" (held territories: {', '.join(t.name for t in held)})" if held else ""), kernel=True)
    figures, picked = _picks(spec, impl, newest) if measured else ("no row of it in this evidence", 0)
    where = "holds no territory"
    if stay is None:
        return Finding("defends-nothing", op, impl, f"{where} and states no reason it stays: declare a territory it "
                       f"holds, or give its reason ({', '.join(r for r in REASONS if r != 'remove')}) or mark it for "
                       "removal (remove) under 'kernels' in tiered_ops/analysis/territories.json; " + figures,
                       kernel=True)
    if stay.reason == "picked" and measured and not picked:
        return Finding("unfounded", op, impl, f"{where}; it stays as picked ({stay.why}), but {figures}: declare "
                       "another reason or mark it for removal", kernel=True, reason=stay.reason)
    if stay.reason == "remove":
        return Finding("remove", op, impl, f"{where}; marked for removal (its sources stay until a change deletes "
                       f"them): {stay.why}; {figures}", kernel=True, reason=stay.reason)
    return Finding("stays", op, impl, f"{where}; stays as {stay.reason} ({REASONS[stay.reason]}): {stay.why}; "
                   f"{figures}", kernel=True, reason=stay.reason)


def live_plan(specs: list[OpSpec], territories: list[Territory] | None = None,
              retired: dict[str, str] | None = None) -> tuple[dict[str, list], list[str], list[str]]:
    """What ``check --live`` measures: per op, its default GPU problems that fall in a held territory; the dtypes
    and modes of the held territories (names, as results hold them)."""
    retired = RETIRED if retired is None else retired
    held = [t for t in (TERRITORIES if territories is None else territories) if t.name not in retired]
    problems = {s.name: [p for p in s.default_problems("cuda") if any(
        t.op == s.name and t.contains(*rows_and_len(s.name, p), t.dtypes[0], t.modes[0], t.contexts[0], str(p))
        for t in held)] for s in specs}
    return ({k: v for k, v in problems.items() if v}, sorted({d for t in held for d in t.dtypes}),
            sorted({m for t in held for m in t.modes}))


def summary(findings: list[Finding]) -> str:
    """``cuda: N kernels defend M cases in T territories; K territories retired``, then where there are any: ``; S
    kernels stay without one (picked 3, remove 1)``, ``; U kernels not yet measured``, ``; F kernels hold none and
    state no reason``, ``; R kernels removed, their rows ignored (muladd cuda)``."""
    held = [f for f in findings if f.kind == "defends"]
    kernels = {(f.op, f.impl) for f in held}
    gone = sum(f.kind in ("retired", "retired-wins") for f in findings)
    text = (f"cuda: {len(kernels)} kernels defend {sum(f.won for f in held)} cases in {len(held)} territories; "
            f"{gone} territories retired")
    mine = [f for f in findings if f.kernel]
    stay = [f.reason for f in mine if f.reason is not None]
    if stay:
        per = ", ".join(f"{r} {stay.count(r)}" for r in REASONS if r in stay)
        text += f"; {len(stay)} kernels stay without one ({per})"
    if n := sum(f.kind == "unmeasured" for f in mine):
        text += f"; {n} kernels not yet measured"
    if n := sum(f.kind == "defends-nothing" for f in mine):
        text += f"; {n} kernels hold none and state no reason"
    if gone := [f"{f.op} {f.impl}" for f in findings if f.kind == "removed"]:
        text += f"; {len(gone)} kernels removed, their rows ignored ({', '.join(gone)})"
    return text


def report(findings: list[Finding]) -> str:
    lines = [f"{'FAIL' if f.fails else 'ok  '} {f.op} {f.impl} [{f.kind}]: {f.text}" for f in findings]
    n = sum(f.fails for f in findings)
    lines.append(f"{n} failing of {len(findings)} findings" if n else f"check passed ({len(findings)} findings)")
    lines.append(summary(findings))
    return "\n".join(lines)


def by_gpu(files: list[tuple[str, pd.DataFrame]], gpus: Gpus) -> dict[str, pd.DataFrame]:
    """The rows of results files grouped by GPU (``files``: each file's GPU and rows): a row's ``gpu_name`` where it
    has one (``Gpus.name``), else its file's GPU."""
    parts = []
    for gpu, df in files:
        names = df.gpu_name.map(gpus.name) if "gpu_name" in df else pd.Series(None, index=df.index, dtype=object)
        parts.append(df.assign(_gpu=names.where(names.notna(), gpu).astype(str)))
    rows = pd.concat(parts, ignore_index=True)
    return {g: d.drop(columns="_gpu").reset_index(drop=True) for g, d in rows.groupby("_gpu", sort=True)}


def check_gpus(rows: dict[str, pd.DataFrame], gpus: Gpus) -> tuple[str, bool]:
    """The report over each GPU's rows and whether it fails: the archived GPUs' findings as information (one line per
    stale or failing finding, never failing), then the current GPUs' check, judged together, ending with its summary
    line; the current GPUs' check alone decides."""
    lines = []
    for g, df in rows.items():
        if (a := gpus.archive(g)) is not None:
            findings = check(df)
            lines.append(f"{g}: archived ({a.describe()}): its evidence is history, checked for information, "
                         "never failing")
            lines += [f"info {f.op} {f.impl} [{f.kind}]: {f.text.splitlines()[0].rstrip(':')}" for f in findings
                      if f.fails]
            lines.append(f"{g} (archived): {summary(findings)}")
    current = [g for g in rows if gpus.is_current(g)]
    if not current:
        listed = ", ".join(gpus.current) or "none listed"
        lines.append(f"no evidence of a current GPU (current: {listed}) in these results: nothing gated")
        return "\n".join(lines), False
    findings = check(pd.concat([rows[g] for g in current], ignore_index=True))
    lines.append(f"gated on the current GPUs' evidence: {', '.join(current)}")
    lines.append(report(findings))
    return "\n".join(lines), any(f.fails for f in findings)
