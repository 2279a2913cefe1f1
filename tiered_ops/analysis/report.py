"""``tiered-ops report``: a per-GPU report rendered from results (never typed by hand).

From a results CSV (``tiered-ops export`` or a committed ``reports/<gpu>/results.csv``) and, when given, the
cost metadata (``export --meta``), it writes into one folder:
- ``results.csv``: one row per measurement, the store's columns in the store's order (diff-friendly);
- ``README.md``: the one-screen summary first (``summary.py``: the picture ``winners.png``, per op the cases each
  tier wins, the winners' fraction of the copy bandwidth over the large cases, the territories a CUDA kernel
  defends), then the command that measured it, flags (speed-ups over eager above 10x, host-time outliers) and the
  speed targets when asked for;
- ``cases.md``: per op, the winner of each (problem, dtype, mode) with its margin over the runner-up, marked a tie
  when their p20-p80 ranges overlap, and the decision under each policy;
- ``measurements.md``, only while it stays small: one line per implementation (median, us/call, GB/s, % of copy,
  relative error, peak memory where measured, graph breaks, LOC, build seconds); else ``results.csv`` holds them;
- with a second sweep's results (``--repeat``), the share of non-tied cases where both pick the same winner;
- ``<op>-gbps.png``: GB/s of each implementation across the problems, per dtype and mode, with the measured
  copy-bandwidth line; ``winners.png``: the winning tier of every case.
The Markdown names the GPU, the versions and the command that produced the results.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ..store.store import COLUMN_NAMES
from .analysis import decisions, latest, winners
from .check import removed
from .summary import in_territory, margin_label, row_labels, summary
from .targets import not_copy_bound
from .targets import render as render_targets

TIER_COLORS = {"eager": "#4c72b0", "compile": "#55a868", "triton": "#c44e52", "cuda": "#8172b2"}
FLAG_SPEEDUP = 10.0
HOST_FLAG_MIN_US, HOST_FLAG_RATIO = 50.0, 1.3
# the cross view's speed ratios between GPUs: over the cases moving at least LARGE_BYTES, and the launch-bound ones
LARGE_BYTES, SMALL_BYTES = 64 << 20, 1 << 20
# the per-measurement page is written only below this many characters (else results.csv alone holds them)
MEASUREMENTS_MAX = 60_000


def load(results: list[str | Path], meta: str | Path | None = None) -> tuple[pd.DataFrame, dict]:
    df = pd.concat([pd.read_csv(f) for f in results], ignore_index=True)
    metas: dict[tuple[str, str], dict] = {}
    if meta and Path(meta).exists():
        for line in Path(meta).read_text().splitlines():
            if line.strip():
                m = json.loads(line)
                metas[(m["op"], m["impl"])] = m
    return df, metas


def agreement(a: pd.DataFrame, b: pd.DataFrame) -> tuple[int, int, list[str]]:
    """Two sweeps of one GPU: (agreeing, compared, disagreements) over the cases that neither run calls a tie and
    where both timed the same implementations (a second sweep cut short leaves cases half measured)."""
    wa, wb = winners(a), winners(b)
    key = ["op", "problem", "dtype", "mode"]

    def timed(df: pd.DataFrame) -> pd.DataFrame:
        ok = df[(df.ok == 1) & df.caller_us.notna()]
        return ok.groupby(key).impl.agg(lambda s: ",".join(sorted(s))).rename("timed").reset_index()

    both = wa.merge(timed(a), on=key).merge(wb.merge(timed(b), on=key), on=key, suffixes=("_a", "_b"))
    both = both[~both.tie_a & ~both.tie_b & (both.timed_a == both.timed_b)]
    differ = both[both.winner_a != both.winner_b]
    lines = [f"{r.op} {r.problem} {r.dtype} {r.mode}: {r.winner_a} ({r.margin_a:.2f}x) then {r.winner_b} "
             f"({r.margin_b:.2f}x)" for r in differ.itertuples()]
    return len(both) - len(differ), len(both), lines


def _f(v: object, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _said(v: object) -> bool:
    return isinstance(v, str) and bool(v)


def _breaks(meta: dict) -> str:
    d = (meta.get("graph_breaks") or {}).get("registered") or {}
    return "-" if d.get("breaks") is None else str(d["breaks"])


def markdown(df: pd.DataFrame, metas: dict, command: str, rendered_by: str, repeat: pd.DataFrame | None = None,
             total: int | None = None, not_copy: dict[str, str] | None = None) -> dict[str, str]:
    """The report's pages: ``README.md`` (the one-screen summary first, then how it was measured, the flags and
    one plot per op), ``cases.md`` (per op, the winner of each case with its margin and the decision under each
    policy) and, where it stays under ``MEASUREMENTS_MAX`` characters, ``measurements.md`` (every measurement; else
    ``results.csv`` alone holds them). ``df``: each case's newest rows; ``total``: the rows of the results they were
    taken from, when more (a resumed store keeps older rows of a case); ``not_copy``: ops whose limit is not the
    copy bandwidth (``targets.not_copy_bound``), printed without a copy fraction."""
    first = df.iloc[0]
    count = (f"{len(df)} measurements" if total is None or total == len(df) else
             f"{total} measurements in the results, of which the {len(df)} newest of each case and implementation "
             "make the figures below")
    copy = df.copy_gbps.dropna().median()
    w = winners(df)
    d = decisions(df, metas) if len(w) else pd.DataFrame()
    every = _measurements(df, metas)
    pages = {"measurements.md": every} if len(every) <= MEASUREMENTS_MAX else {}
    where = ("[`measurements.md`](measurements.md) and `results.csv`" if pages else
             "`results.csv` (one row per measurement)")
    lines = [
        f"# {first.gpu_name}",
        "",
        f"torch {first.torch_version}, Triton {first.triton_version}, CUDA {first.cuda_version}; "
        f"{count}; copy bandwidth {_f(copy, '.0f')} GB/s (median of the runs' own measurements).",
        "",
        *summary(w, df, not_copy),
        "",
        f"Per case (winner, margin, runner-up, decisions): [`cases.md`](cases.md). Every measurement: {where}.",
        "",
        "## How it was measured",
        "",
        f"Measured by: `{command}`  ",
        f"Rendered by: `{rendered_by}` (every figure here comes from `results.csv`).",
        "",
        "A margin is the runner-up's time over the winner's; **tie** means their p20-p80 ranges as a caller sees "
        "them overlap (the kernel's and, where the launch path sets the time, the host's: fastest batch to p80); a "
        "runner-up marked (not gated) or (pruned) was timed but its gate never ran, as no choice would take it. "
        f"A speed-up over eager above {FLAG_SPEEDUP:.0f}x is flagged: check for an artefact (inputs in L2, zeros, "
        "skipped work) before believing it.",
    ]
    if repeat is not None:
        agree, total, differ = agreement(df, repeat)
        rate = f"{100 * agree / total:.1f} %" if total else "-"
        w2 = winners(repeat)
        lines += ["", f"**Repeatability:** a second sweep on the same GPU picks the same winner in {agree} of {total} "
                  f"non-tied cases ({rate}; the target is at least 95 %). Ties: {int(w.tie.sum())} of {len(w)} cases "
                  f"in this sweep, {int(w2.tie.sum())} of {len(w2)} in the second; a case the second timed with "
                  "other implementations (cut short) is not compared."]
        lines += [f"- differs: {d}" for d in differ]
    host = df[(df.ok == 1) & (df["mode"] == "fwd_nograd") & (df.p50_us >= HOST_FLAG_MIN_US)
              & (df.host_us > HOST_FLAG_RATIO * df.p50_us)]
    if len(host):
        lines += ["", f"**Host-time flags ({len(host)}):** in fwd_nograd a kernel of {HOST_FLAG_MIN_US:.0f} us or "
                  f"more hides its host path, so a host time above {HOST_FLAG_RATIO}x the kernel time suggests "
                  "interference on the host during this run; decisions use max(kernel, host) and may be off "
                  "there: " + "; ".join(
                      f"{r.op} {r.impl} {r.problem.split(',')[0]} {r.dtype}: host {r.host_us:.0f} us, kernel "
                      f"{r.p50_us:.0f} us" for r in host.itertuples())]
    flagged = w[w.vs_eager > FLAG_SPEEDUP] if len(w) else w
    if len(flagged):
        lines += ["", f"**Flagged ({len(flagged)}):** " + "; ".join(
            f"{r.op} {r.problem.split(',')[0]} {r.dtype} {r.mode}: {r.winner} {r.vs_eager:.1f}x eager"
            for r in flagged.itertuples())]
    lines += ["", "## GB/s per implementation", ""]
    lines += [f"- [{op}]({op}-gbps.png) ([cases](cases.md#{op}))" for op in dict.fromkeys(df.op)]
    pages["README.md"] = "\n".join(lines) + "\n"
    pages["cases.md"] = _cases(df, w, d)
    return pages


def _cases(df: pd.DataFrame, w: pd.DataFrame, d: pd.DataFrame) -> str:
    lines = [f"# {df.iloc[0].gpu_name}: the winner of each case", "",
             "Rendered with `README.md` from `results.csv`; a margin is the runner-up's time over the winner's, "
             "**tie** where their p20-p80 ranges overlap. The fastest peer is shown beside ours (never chosen); "
             "(edge) marks one that fails an edge case it does not claim, timed where it is correct."]
    for op in dict.fromkeys(df.op):
        lines += ["", f"## {op}", "", f"![GB/s per implementation]({op}-gbps.png)", "",
                  "| problem | dtype | mode | winner | us/call | margin | runner-up | "
                  "p20-p80 us (winner / runner-up) | fastest | cost-aware | cold-start 1000 | fastest peer us |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (w[w.op == op] if len(w) else w).itertuples():
            dec = d[(d.op == op) & (d.problem == r.problem) & (d.dtype == r.dtype) & (d["mode"] == r.mode)]
            dr = dec.iloc[0] if len(dec) else None
            margin = "tie" if r.tie else _f(r.margin, ".2f") + "x"
            lines.append(f"| {r.problem} | {r.dtype} | {r.mode} | **{r.winner}** | {r.caller_us:.1f} | {margin} | "
                         f"{r.runner_up or '-'}{f' ({r.runner_unchecked})' if _said(r.runner_unchecked) else ''} | "
                         f"{_f(r.p20, '.1f')}-{_f(r.p80, '.1f')} / "
                         f"{_f(r.runner_p20, '.1f')}-{_f(r.runner_p80, '.1f')} | "
                         f"{dr.fastest if dr is not None else '-'} | "
                         f"{dr.cost_aware if dr is not None else '-'} | "
                         f"{dr.cold_start_1000 if dr is not None else '-'} | {_peer(r)} |")
    return "\n".join(lines) + "\n"


def _peer(r: object) -> str:
    peer = getattr(r, "peer", None)
    if not _said(peer):
        return "-"
    edge = " (edge)" if getattr(r, "peer_edge_only", False) else ""
    return f"{peer} {_f(getattr(r, 'peer_us', None), '.1f')}{edge}"


def _measurements(df: pd.DataFrame, metas: dict) -> str:
    lines = [f"# {df.iloc[0].gpu_name}: every measurement", "", "Rendered with `README.md` from `results.csv`."]
    for op, g in df.groupby("op", sort=False):
        # peak memory (bytes one call allocates above its inputs) where the results carry it (GPU rows of schema 6+)
        peak = "peak_bytes" in g and g.peak_bytes.notna().any()
        lines += ["", f"## {op}", "",
                  "| problem | dtype | mode | impl | median us | us/call | GB/s | % copy | rel err | "
                  + ("peak MiB | " if peak else "") + "breaks | LOC | build s | note |",
                  "|---|---|---|---|---|---|---|---|---|" + ("---|" if peak else "") + "---|---|---|---|"]
        for r in g.itertuples():
            m = metas.get((op, r.impl), {})
            note = "" if r.ok == 1 and not pd.isna(r.caller_us) else str(r.reason or "")[:80].replace("|", "/")
            mib = f"{_f(r.peak_bytes / 2**20 if r.peak_bytes == r.peak_bytes else None, '.3g')} | " if peak else ""
            lines.append(
                f"| {r.problem} | {r.dtype} | {r.mode} | {r.impl} | {_f(r.p50_us, '.1f')} | {_f(r.caller_us, '.1f')} | "
                f"{_f(r.gbps, '.0f')} | {_f(100 * r.frac_copy if r.frac_copy == r.frac_copy else None, '.1f')} | "
                f"{_f(r.rel_error, '.1e')} | {mib}{_breaks(m)} | {m.get('loc', '-')} | "
                f"{_f(m.get('build_s_own'), '.1f') if r.tier == 'cuda' else '-'} | {note} |")
    return "\n".join(lines) + "\n"


def plots(df: pd.DataFrame, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    copy = df.copy_gbps.dropna().median()
    ok = df[(df.ok == 1) & df.gbps.notna()]
    for op, g in ok.groupby("op", sort=False):
        cases = list(g.groupby(["dtype", "mode"], sort=False))
        fig, axes = plt.subplots(len(cases), 1, figsize=(11, 2.6 * len(cases)), squeeze=False)
        for ax, ((dtype, mode), c) in zip(axes[:, 0], cases):
            probs = list(dict.fromkeys(c.problem))
            impls = list(dict.fromkeys(c.impl))
            width = 0.8 / max(1, len(impls))
            for k, impl in enumerate(impls):
                s = c[c.impl == impl].set_index("problem").gbps
                tier = c[c.impl == impl].tier.iloc[0]
                ax.bar([i + k * width for i in range(len(probs))], [s.get(p, 0.0) for p in probs], width,
                       label=impl, color=TIER_COLORS.get(tier), alpha=0.55 if impl != tier else 1.0)
            if copy == copy:
                ax.axhline(copy, color="k", ls="--", lw=1, label=f"copy {copy:.0f} GB/s")
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(probs))])
            ax.set_xticklabels([p.split(",")[0] for p in probs], fontsize=8)
            top = max(c.gbps.max(), copy if copy == copy else 0.0)
            ax.set_ylim(0, 1.3 * top)  # room for the legend above the bars
            ax.set_ylabel("GB/s")
            ax.set_title(f"{op} {dtype} {mode}", fontsize=9)
            ax.legend(fontsize=7, ncol=6, loc="upper left")
        fig.tight_layout()
        path = out / f"{op}-gbps.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
    w = winners(df)
    if len(w):
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Rectangle

        tiers = list(TIER_COLORS)
        rows = list(dict.fromkeys(zip(w.op, w.problem)))  # the whole problem: two may share a shape
        cols = list(dict.fromkeys(zip(w.dtype, w["mode"])))
        grid = [[math.nan] * len(cols) for _ in rows]
        fig, ax = plt.subplots(figsize=(1.1 * len(cols) + 3, 0.32 * len(rows) + 1.5))
        for r, held in zip(w.itertuples(), in_territory(w)):
            i, j = rows.index((r.op, r.problem)), cols.index((r.dtype, r.mode))
            grid[i][j] = tiers.index(r.tier)
            if held:  # a CUDA kernel inside a territory it defends (tiered-ops check)
                ax.add_patch(Rectangle((j - 0.46, i - 0.44), 0.92, 0.88, fill=False, ec="black", lw=1.6))
            label = margin_label(r.margin, r.tie)
            ax.text(j, i, f"{r.winner}\n{label}", ha="center", va="center", fontsize=5.5, color="white")
        ax.imshow(grid, cmap=ListedColormap([TIER_COLORS[t] for t in tiers]), vmin=-0.5, vmax=len(tiers) - 0.5,
                  aspect="auto")
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels([f"{d}\n{m}" for d, m in cols], fontsize=7)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(row_labels(rows), fontsize=7)
        ax.set_title("winner per case: colour = tier, text = margin over the runner-up (or tie);\n"
                     "outlined = a CUDA kernel inside a territory it defends", fontsize=9)
        for t in tiers:
            ax.plot([], [], "s", color=TIER_COLORS[t], label=t)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = out / "winners.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made


def render(results: list[str | Path], out: str | Path, meta: str | Path | None, command: str,
           rendered_by: str, write_csv: bool = True, repeat: list[str | Path] | None = None,
           targets: dict[str, pd.DataFrame | None] | None = None,
           targets_spec: dict | None = None, archived: str | None = None) -> list[Path]:
    """Write results.csv, README.md, cases.md (measurements.md where small) and the plots into ``out``; returns
    the files written. ``repeat``: the
    results of a second sweep on the same GPU, for the agreement rate. ``targets_spec`` (``targets.load_spec``)
    asks for the speed targets section; ``targets``: the grid, picks and dispatch tables of ``tiered-ops targets
    --live`` for the targets measured there. ``archived``: the GPU is archived (``gpus.Archived.describe()``): a
    note under the title says so."""
    df, metas = load(results, meta)
    csv = Path(out) / "results.csv"
    write_csv = write_csv and not any(Path(r).resolve() == csv.resolve() for r in results)
    return render_frame(df, out, metas, command, rendered_by, write_csv, load(repeat)[0] if repeat else None,
                        targets, targets_spec, archived)


def render_frame(df: pd.DataFrame, out: str | Path, metas: dict, command: str, rendered_by: str,
                 write_csv: bool = True, again: pd.DataFrame | None = None,
                 targets: dict[str, pd.DataFrame | None] | None = None, targets_spec: dict | None = None,
                 archived: str | None = None) -> list[Path]:
    """``render`` from rows already read (a sweep's own, with its cost metadata ``metas`` by (op, impl)); ``again``:
    the second sweep's rows."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cols = [c for c in ["id", *COLUMN_NAMES] if c in df.columns]
    written = []
    csv = out / "results.csv"
    if write_csv:
        df[cols].to_csv(csv, index=False)
        written.append(csv)
    total = len(df)
    df = latest(df)  # the figures: each case's newest row per implementation (the CSV above keeps every row)
    gone = removed(df)  # a removed kernel's rows stay in the CSV, never in the figures
    left_out = sorted({f"{op} {impl}" for op, impl in zip(df.op[gone], df.impl[gone])})
    df = df[~gone]
    again = latest(again) if again is not None else None
    pages = markdown(df, metas, command, rendered_by, again, total, not_copy_bound(targets_spec))
    if left_out:
        title, rest = pages["README.md"].split("\n", 1)
        pages["README.md"] = (f"{title}\n\nLeft out of the figures: the rows of {', '.join(left_out)}, a kernel "
                              f"no longer in the catalog (its sources were deleted; `results.csv` keeps its rows)."
                              f"\n{rest}")
    if archived:
        title, rest = pages["README.md"].split("\n", 1)
        pages["README.md"] = (f"{title}\n\n**Archived GPU** ({archived}): this evidence is history, read and reported, "
                              f"never gating CI (`reports/gpus.toml`).\n{rest}")
    if targets_spec is not None:
        t = targets or {}
        pages["README.md"] += "\n" + render_targets(df, targets_spec, t.get("grid"), t.get("picks"), t.get("dispatch"))
    if "measurements.md" not in pages:
        (out / "measurements.md").unlink(missing_ok=True)  # an earlier, smaller render's page would be stale
    for name, text in pages.items():
        (out / name).write_text(text)
        written.append(out / name)
    return [*written, *plots(df, out)]


# ---------------------------------------------------------------------------------------------- cross-GPU view
def cross(frames: dict[str, pd.DataFrame], rendered_by: str, archived: dict[str, str] | None = None) -> str:
    """``reports/README.md``: per (op, problem, dtype, mode) the winner on each GPU, where they differ, and the
    speed ratio between GPUs (winner's time on the first GPU over the other's); a "what we learned" section
    computed from the same tables. ``archived``: GPU -> its archive note (``gpus.Archived.describe()``), marked so."""
    archived = archived or {}
    frames = {g: latest(df) for g, df in frames.items()}
    names = list(frames)
    wins = {g: winners(df).set_index(["op", "problem", "dtype", "mode"]) for g, df in frames.items()}
    keys = [k for k in wins[names[0]].index if all(k in w.index for w in wins.values())]
    first = {g: df.iloc[0] for g, df in frames.items()}
    lines = ["# tiered_ops across GPUs", "",
             "Every figure below is computed from the per-GPU results files (" + ", ".join(
                 f"`{g}`: {first[g].gpu_name}, torch {first[g].torch_version}, Triton {first[g].triton_version}, "
                 f"{len(frames[g])} measurements" for g in names) + ").  ",
             f"Rendered by: `{rendered_by}`", ""]
    lines += [f"**Archived GPU** `{g}` ({a}): its evidence is history, shown here, never gating CI "
              "(`reports/gpus.toml`).  " for g, a in archived.items() if g in frames] + ([""] if archived else [])
    rows, differ, ratios = [], [], []
    for k in keys:
        ws = [wins[g].loc[k] for g in names]
        same = len({w.winner for w in ws}) == 1
        ratio = ws[0].caller_us / ws[1].caller_us if len(ws) > 1 else math.nan
        ratios.append((k, ratio))
        if not same:
            differ.append((k, ws))
        rows.append(f"| {k[0]} | {k[1].split(',')[0]} | {k[2]} | {k[3]} | " + " | ".join(
            f"{w.winner}{' (tie)' if w.tie else ''} {w.caller_us:.1f}" for w in ws)
            + f" | {'same' if same else '**differs**'} | {_f(ratio, '.2f')} |")
    learned = ["## What we learned (computed)", ""]
    learned.append(f"- {len(keys)} cases measured on {' and '.join(names)}; the winner is the same in "
                   f"{len(keys) - len(differ)} and differs in {len(differ)}; of those, "
                   f"{sum(any(w.tie for w in ws) for _, ws in differ)} are a tie on at least one GPU.")
    for g in names:
        counts = wins[g].loc[keys].tier.value_counts()
        learned.append(f"- Winning tiers on {g}: " + ", ".join(f"{t} {n}" for t, n in counts.items()) + ".")
    big = [(k, r) for k, r in ratios if r == r]
    if len(names) > 1 and big:
        ref = frames[names[0]]
        moved = ((ref.gbps * ref.p50_us * 1e3).groupby([ref.op, ref.problem, ref.dtype, ref["mode"]]).max()
                 if {"gbps", "p50_us"} <= set(ref.columns) else pd.Series(dtype=float))
        large = [r for k, r in big if moved.get(k, 0) >= LARGE_BYTES]
        small = [r for k, r in big if moved.get(k, math.inf) < SMALL_BYTES]
        # the upper median: for an even count the higher middle value, one case's own ratio (not a mean of two)
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else math.nan  # noqa: E731
        learned.append(f"- Speed ratio {names[0]} time / {names[1]} time of the winners: upper median {med(large):.2f} "
                       f"over the {len(large)} cases moving at least {LARGE_BYTES >> 20} MiB, {med(small):.2f} over "
                       f"the {len(small)} launch-bound ones (under {SMALL_BYTES >> 20} MiB).")
        copies = {g: frames[g].copy_gbps.dropna().median() for g in names}
        learned.append("- Copy bandwidth measured in each run: " + ", ".join(f"{g} {c:.0f} GB/s" for g, c in
                                                                             copies.items())
                       + f" (ratio {copies[names[1]] / copies[names[0]]:.2f}).")
    if differ:
        learned.append("- Where the winner differs: " + "; ".join(
            f"{k[0]} {k[1].split(',')[0]} {k[2]} {k[3]}: " + " vs ".join(f"{w.winner} ({w.margin:.2f}x)" for w in ws)
            for k, ws in differ[:12]) + ("; ..." if len(differ) > 12 else "") + ".")
    lines += learned + ["", "## Winner per GPU", "",
                        "| op | shape | dtype | mode | " + " | ".join(
                            f"{g}{' (archived)' if g in archived else ''} winner us" for g in names)
                        + " | winner | time ratio |", "|---|---|---|---|" + "---|" * len(names) + "---|---|"]
    return "\n".join(lines + rows) + "\n"
