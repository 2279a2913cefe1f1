"""Analysis of a sweep's results (reads rows, never measures): the winner of each case with its margin and tie, the
decision under each policy, the per-op table the CLI prints, the rows as shown, and the winner per mode."""

from __future__ import annotations

import math

import pandas as pd

from ..decide.policy import DEFAULT_CALLS, choose
from ..registry import DTYPES, GRAD_MODES
from ..store.rows import EDGE_ONLY, PRUNED, UNGATED, caller_range, contended, overlap
from ..tiers.catalog import get_op

# A measured case: one row per implementation of it in ``latest``.
CASE = ["device_key", "op", "problem", "dtype", "mode", "context"]


def with_context(df: pd.DataFrame) -> pd.DataFrame:
    """Results without a ``context`` column (or with an empty cell) were measured in the eager context."""
    ctx = df["context"].fillna("eager") if "context" in df.columns else "eager"
    return df.assign(context=ctx)


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """The newest row per (device, op, impl, problem, dtype, mode, context): CSV order, then timestamp. A store
    resumed after a source changed holds the stale rows of a case beside the fresh ones; every view reads this."""
    df = with_context(df).reset_index(drop=True).assign(_order=lambda d: range(len(d)))
    order = [c for c in ("timestamp", "_order") if c in df.columns]  # a hand-made frame may have no timestamps
    keys = [c for c in (*CASE, "impl") if c in df.columns]
    return df.sort_values(order).groupby(keys, sort=False, dropna=False).tail(1).drop(columns="_order")


def unchecked(df: pd.DataFrame) -> pd.Series:
    """Per row, "not gated" or "pruned" where the row was timed but its gate never ran (a sweep gates a compiled tier
    only where a choice would take it; successive halving stops a slower one after a short timing), else None: a row
    that passed its gate, or one that failed. Such rows still count as rivals of a winner or of a CUDA kernel."""
    # an all-empty reason column reads from CSV as float64 (NaN): cast before filling with text
    why = (df["reason"] if "reason" in df else pd.Series("", index=df.index)).astype(object).fillna("").astype(str)
    kind = why.map(lambda w: "not gated" if w.startswith(UNGATED) else "pruned" if w.startswith(PRUNED) else None)
    return kind.where(df.ok != 1, None)


WINNER_COLUMNS = ["op", "problem", "dtype", "mode", "winner", "tier", "caller_us", "runner_up", "runner_unchecked",
                  "margin", "tie", "p20", "p80", "runner_p20", "runner_p80", "vs_eager", "peer", "peer_us",
                  "peer_edge_only"]


def winners(df: pd.DataFrame) -> pd.DataFrame:
    """The fastest correct timed implementation of ours per (op, problem, dtype, mode): its time, the runner-up
    and the margin over it (runner-up time / winner time), the p20-p80 range of both as a caller sees them
    (``p20``/``p80``, ``runner_p20``/``runner_p80``), ``tie`` when those ranges overlap, the
    speed-up over the best eager implementation, and the fastest peer (never a winner) with its time
    (``peer_edge_only``: that peer fails an edge case it does not claim, timed where it is correct).

    The runner-up may be a row timed but never gated (a sweep gates a compiled tier only where a choice would take
    it) or pruned after a short timing: ``runner_unchecked`` then says which ("not gated", "pruned"), as the
    report shows it; the winner is always a row that passed its gate."""
    late = unchecked(df)
    why = (df["reason"] if "reason" in df else pd.Series("", index=df.index)).astype(object).fillna("").astype(str)
    edge_only = (df.tier == "peer") & (df.ok != 1) & why.str.startswith(EDGE_ONLY)
    timed = df.assign(unchecked=late, edge_only=edge_only)[df.caller_us.notna() & ((df.ok == 1) | late.notna()
                                                                                  | edge_only)]
    out = []
    for (op, problem, dtype, mode), g in timed.groupby(["op", "problem", "dtype", "mode"], sort=False):
        peers = g[(g.tier == "peer") & ((g.ok == 1) | g.edge_only)].sort_values("caller_us")
        g = g[g.tier != "peer"].sort_values("caller_us")
        correct = g[g.ok == 1]
        if correct.empty:
            continue
        best = correct.iloc[0]
        rest = g.drop(index=best.name)
        second = rest.iloc[0] if len(rest) else None
        eager = correct[correct.tier == "eager"].caller_us.min()
        # the p20-p80 ranges as a caller sees them (timing.caller_range: the kernel's spread, and the host batches'
        # where the launch path sets the time); overlapping ranges are a tie
        spread = [caller_range(best), caller_range(second) if second is not None else (math.nan, math.nan)]
        out.append(dict(op=op, problem=problem, dtype=dtype, mode=mode, winner=best.impl, tier=best.tier,
                        caller_us=best.caller_us, runner_up=None if second is None else second.impl,
                        runner_unchecked=None if second is None or second.ok == 1 else second.unchecked,
                        margin=math.nan if second is None else second.caller_us / best.caller_us,
                        tie=bool(second is not None and overlap(*spread)),
                        p20=spread[0][0], p80=spread[0][1], runner_p20=spread[1][0], runner_p80=spread[1][1],
                        vs_eager=eager / best.caller_us if eager == eager else math.nan,
                        peer=peers.impl.iloc[0] if len(peers) else None,
                        peer_us=peers.caller_us.iloc[0] if len(peers) else math.nan,
                        peer_edge_only=bool(len(peers) and peers.edge_only.iloc[0])))
    return pd.DataFrame(out, columns=WINNER_COLUMNS)  # its columns also where no case has a correct timed row


def decisions(df: pd.DataFrame, metas: dict[tuple[str, str], dict], calls: tuple[int, ...] = (DEFAULT_CALLS, 10**6)
              ) -> pd.DataFrame:
    """The choice under each policy per (op, problem, dtype, mode), from this sweep's rows and cost metadata."""
    ok = df[(df.ok == 1) & df.caller_us.notna() & (df.tier != "peer")]  # a peer is never chosen
    out = []
    for (op, problem, dtype, mode), g in ok.groupby(["op", "problem", "dtype", "mode"], sort=False):
        cands = [dict(impl=r.impl, tier=r.tier, caller_us=r.caller_us, first_call_s=r.first_call_s,
                      build_s=metas.get((op, r.impl), {}).get("build_s_extension") if r.tier == "cuda" else None)
                 | dict(zip(("lo", "hi"), caller_range(r))) for r in g.itertuples()]
        row = dict(op=op, problem=problem, dtype=dtype, mode=mode, fastest=choose(cands, "fastest")[0]["impl"],
                   cost_aware=choose(cands, "cost-aware")[0]["impl"])
        for n in calls:
            row[f"cold_start_{n:g}"] = choose(cands, "cold-start", n)[0]["impl"]
        out.append(row)
    cols = ["op", "problem", "dtype", "mode", "fastest", "cost_aware", *(f"cold_start_{n:g}" for n in calls)]
    return pd.DataFrame(out, columns=cols)  # its columns also where no case has a correct timed row


def _fmt(v: object, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def table(df: pd.DataFrame, op: str) -> str:
    """Text table of one op's results: a line per (problem, dtype, implementation), winner marked."""
    win = winners(df)
    win_set = {(r.problem, r.dtype, r.mode, r.winner) for r in win.itertuples()}
    head = f"{'problem':<26} {'dtype':<5} {'mode':<10} {'impl':<14} {'tier':<8} {'median us':>10} {'us/call':>9} " \
           f"{'GB/s':>7} {'% copy':>7} {'rel err':>8} {'breaks':>6} {'LOC':>4}  note"
    lines = [f"== {op} ==", head]
    for r in df[df.op == op].itertuples():
        mark = "  <- winner" if (r.problem, r.dtype, r.mode, r.impl) in win_set else ""
        note = (r.reason or "") if not r.ok or r.caller_us is None or r.caller_us != r.caller_us or (
            isinstance(r.reason, str) and r.reason.startswith("pruned")) else ""
        lines.append(
            f"{r.problem:<26} {r.dtype:<5} {r.mode:<10} {r.impl:<14} {r.tier:<8} {_fmt(r.p50_us, '10.1f')} "
            f"{_fmt(r.caller_us, '9.1f')} {_fmt(r.gbps, '7.0f')} "
            f"{_fmt(None if r.frac_copy is None else 100 * r.frac_copy, '6.1f')}% {_fmt(r.rel_error, '8.1e')} "
            f"{getattr(r, 'graph_breaks', '-'):>6} {_fmt(getattr(r, 'loc', None), '4.0f')}"
            f"{mark}{('  ' + note[:90]) if note else ''}"
        )
    return "\n".join(lines)


def shown(df: pd.DataFrame, note: list[str]) -> pd.DataFrame:
    """The sweep's rows as printed. Eager's gradients set the other tiers' bounds and are not gated themselves, so
    an eager figure above its dtype's output bound on a row that passed is an ungated gradient: in practice one
    that is 0 in exact arithmetic (a normalized dim of 1), its roundoff measured against the zero floor. It is no
    relative error and is not shown as one; ``note`` gets a line that says so."""
    err = pd.to_numeric(df.rel_error)
    bound = [get_op(o).rtol[DTYPES[d]] for o, d in zip(df.op, df.dtype)]
    ungated = (df.impl == "eager") & df["mode"].isin(GRAD_MODES) & (df.ok == 1) & (err > bound)
    if ungated.any():
        note.append(f"rel err '-' on {int(ungated.sum())} eager row(s) with a backward: eager's gradients are not "
                    "gated (they set the other tiers' bounds) and its worst is a gradient that is 0 in exact "
                    "arithmetic (a normalized dim of 1), whose roundoff is no relative error")
    return df.assign(rel_error=err.mask(ungated))


def no_winner(rows: pd.DataFrame) -> str:
    """Why a case of these rows has no winner: not measured, every timing contended, none correct, or none timed."""
    if rows.empty:
        return "(not measured)"
    busy = sum(contended(r) for r in rows.itertuples())
    if busy:
        return f"(contended: {busy} of {len(rows)} timed on a busy machine)"
    if not (rows.ok == 1).any():
        return f"(none correct of {len(rows)})"
    return "(none timed)"


def winner_per_mode(w: pd.DataFrame, df: pd.DataFrame | None = None) -> tuple[pd.DataFrame, int]:
    """The winner of each (op, problem, dtype) per mode, and in how many cases it differs across modes. With the
    rows ``df``, a case without a winner says why (``no_winner``) instead of leaving its cell empty."""
    modes = w.pivot_table(index=["op", "problem", "dtype"], columns="mode", values="winner", aggfunc="first")
    flips = int((modes.nunique(axis=1) > 1).sum()) if modes.shape[1] > 1 else 0
    if df is not None and len(df):
        keys = ["op", "problem", "dtype", "mode"]
        cases = df.groupby(keys, sort=False)
        full = pd.MultiIndex.from_tuples(list(dict.fromkeys(k[:3] for k in cases.groups)), names=keys[:3])
        modes = modes.reindex(index=full, columns=list(dict.fromkeys(df["mode"]))).astype(object)
        for (op, problem, dtype), row in modes.iterrows():
            for mode, v in row.items():
                if not isinstance(v, str):
                    got = cases.groups.get((op, problem, dtype, mode))
                    modes.loc[(op, problem, dtype), mode] = no_winner(df.loc[got] if got is not None else df[:0])
        modes.columns.name = "mode"
    return modes, flips


def policy_disagreements(d: pd.DataFrame) -> int:
    """Cases whose decision differs between the policies (``decisions``' columns)."""
    return len(d[(d.fastest != d.cost_aware) | d.filter(like="cold_start").ne(d.fastest, axis=0).any(axis=1)])
