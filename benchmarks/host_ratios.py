"""Host time per call of each tier over eager's, per op, shape and mode, from a results CSV (the launch-path table).

    python benchmarks/host_ratios.py reports/nvidia-h100/results.csv [--dtype bf16] [--shapes 1x4096,32x4096,...]

host us: the time to issue one call from Python, as the sweep stores it (``host_us``). Targets of the launch path
(benchmarks/targets.json has the speed targets of other kinds): Triton <= 1.2x eager in fwd_nograd and <= 1.3x in
fwd+bwd, CUDA <= 1.0x and <= 1.1x. Then the count of cases of at most 64 MB whose lowest kernel time is a Triton or
CUDA kernel's, and how many of them the eager-context decision gives to Triton or CUDA outside a tie.
"""

from __future__ import annotations

import argparse

import pandas as pd

from tiered_ops.analysis.analysis import winners

TARGETS = {("triton", "fwd_nograd"): 1.2, ("triton", "fwd+bwd"): 1.3, ("cuda", "fwd_nograd"): 1.0,
           ("cuda", "fwd+bwd"): 1.1}


def ratios(df: pd.DataFrame, dtype: str, shapes: list[str]) -> pd.DataFrame:
    d = df[(df.dtype == dtype) & df.ok.eq(1) & df.problem.str.split(",").str[0].isin(shapes)]
    rows = []
    for (op, prob, mode), g in d.groupby(["op", "problem", "mode"]):
        e = g[g.impl == "eager"].host_us
        if e.empty:
            continue
        r = {"op": op, "shape": prob.split(",")[0], "mode": mode, "eager us": round(float(e.iloc[0]), 1)}
        for t in ("compile", "triton", "cuda"):
            x = g[g.impl == t].host_us
            v = round(float(x.iloc[0]) / float(e.iloc[0]), 2) if len(x) else None
            met = "" if v is None or (t, mode) not in TARGETS else (" ok" if v <= TARGETS[(t, mode)] else " MISS")
            r[t] = "-" if v is None else f"{v:.2f}{met}"
        rows.append(r)
    return pd.DataFrame(rows)


def custom_decisions(df: pd.DataFrame, limit_bytes: int = 64 << 20) -> tuple[int, int]:
    """(cases <= limit whose lowest kernel time is Triton's or CUDA's, those decided for Triton/CUDA, not tied)."""
    ok = df[df.ok.eq(1) & df.p50_us.notna() & (df.tier != "peer")]
    w = winners(df)
    cases = custom = 0
    for (op, prob, dt, mode), g in ok.groupby(["op", "problem", "dtype", "mode"]):
        best = g.loc[g.p50_us.idxmin()]
        moved = best.gbps * 1e3 * best.p50_us if pd.notna(best.gbps) else 0.0
        if best.tier not in ("triton", "cuda") or moved > limit_bytes:
            continue
        ww = w[(w.op == op) & (w.problem == prob) & (w.dtype == dt) & (w["mode"] == mode)]
        if ww.empty:
            continue
        cases += 1
        custom += int(ww.iloc[0].tier in ("triton", "cuda") and not ww.iloc[0].tie)
    return cases, custom


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--shapes", default="1x4096,32x4096,16384x4096,65536x256")
    args = ap.parse_args()
    df = pd.read_csv(args.results)
    print(ratios(df, args.dtype, args.shapes.split(",")).to_string(index=False))
    cases, custom = custom_decisions(df)
    print(f"\ncases of at most 64 MB whose lowest kernel time is Triton's or CUDA's: {cases}; decided for Triton or "
          f"CUDA in the eager context, not tied: {custom}")


if __name__ == "__main__":
    main()
