"""One page per GPU from the per-model results of benchmarks/models.py: every (model, workload, context) row of the
tiered variants with its verdict against stock, the rows slower than stock, Liger beside it, and training memory
(every variant's peak, the tiered variants' peaks above stock's, and with the fused LM head + loss on, tiered-lce's
peaks above liger-lce's).

    python benchmarks/models_summary.py reports/nvidia-h100     # reads models/*.csv there, writes models.md there
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

_PEAKS = ("stock", "tiered", "tiered-fused", "liger", "tiered-lce", "liger-lce")  # the training peaks shown


def _trees(folder: Path) -> list[str]:
    """The commit and time each model's run names in its own header (runs of several trees are told apart)."""
    out = []
    for md in sorted((folder / "models").glob("*.md")):
        m = re.search(r"at commit (\w+)(?: \(.*?\))? on .*?, (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", md.read_text())
        out.append(f"- {md.stem}: " + (f"commit {m.group(1)}, {m.group(2)} UTC" if m else "header without a commit"))
    return ["Runs:", *out]


def summary(folder: Path) -> str:
    frames = [pd.read_csv(p) for p in sorted((folder / "models").glob("*.csv"))]
    df = pd.concat(frames, ignore_index=True)
    ran = df[df["ms_p50"].notna()]
    out = [f"# Models: stock vs tiered_ops vs Liger ({', '.join(sorted(ran['device'].dropna().unique()))})", "",
           "Each model's table, command, commit and date: `models/<model>.md` (rows as the benchmark wrote them). "
           "Median ms of 5 interleaved rounds of at least 10 calls (the calls per row: `models/<model>.md`); "
           "verdict: faster/slower where each median lies outside the other's p20-p80 and every round agrees (in "
           "brackets: the rounds whose median was above stock's, where the run recorded them), and, where the run "
           "timed the control stock-copy (an unpatched copy of stock), the same against it, else tie.", "",
           *_trees(folder), "",
           "| model | workload | context | stock ms | tiered ms | vs stock | verdict | tiered-fused | verdict | liger |"
           " tiered-lce | verdict | liger-lce | train peak MiB " + " / ".join(_PEAKS) + " |",
           "|---|---|---|---:|---:|---:|---|---:|---|---:|---:|---|---:|---|"]
    slower, missing, heavier, noise, over_liger = [], [], [], [], []
    for (model, wl, ctx), g in ran.groupby(["model", "workload", "context"], sort=False):
        v = {r["variant"]: r for _, r in g.iterrows()}
        if "stock" not in v:
            continue
        s = v["stock"]["ms_p50"]

        def cell(name: str) -> tuple[str, str]:
            if name not in v:
                return "", ""
            r = v[name]
            if r["verdict"] == "slower":
                slower.append(f"{model} {wl} {ctx} {name}: {s / r['ms_p50']:.2f}x")
            rounds = r.get("rounds_slower")
            return f"{r['ms_p50']:.3f}", str(r["verdict"]) + (f" ({rounds})" if isinstance(rounds, str) else "")

        if "stock-copy" in v and v["stock-copy"]["verdict"] in ("faster", "slower"):
            c = v["stock-copy"]
            rounds = c.get("rounds_slower")
            noise.append(f"{model} {wl} {ctx}: {c['verdict']} ({c['ms_p50']:.3f} against {s:.3f} ms"
                         + (f", {rounds} rounds slower)" if isinstance(rounds, str) else ")"))
        t, tv = cell("tiered")
        f, fv = cell("tiered-fused")
        lt, ltv = cell("tiered-lce")
        lig, lig_lce = (f"{v[n]['ms_p50']:.3f} ({s / v[n]['ms_p50']:.2f}x)" if n in v else "" for n in ("liger",
                                                                                                     "liger-lce"))
        peaks = {n: v[n]["peak_mib"] for n in _PEAKS if n in v and pd.notna(v[n]["peak_mib"])}
        mem = " / ".join(f"{peaks[n]:.1f}" if n in peaks else "-" for n in _PEAKS) if wl == "train" else ""
        if "tiered-lce" in peaks and peaks["tiered-lce"] > peaks.get("liger-lce", peaks["tiered-lce"]):
            over_liger.append(f"{model} {wl} {ctx}: {peaks['tiered-lce']:.1f} MiB against liger-lce's "
                              f"{peaks['liger-lce']:.1f}")
        control = v.get("stock-copy", {}).get("peak_mib")  # the same model's peak read again: what the figure moves
        also = f" (the control's: {control:.1f})" if control is not None and pd.notna(control) else ""
        heavier += [f"{model} {wl} {ctx} {n}: {peaks[n]:.1f} MiB against stock's {peaks['stock']:.1f}{also}"
                    for n in ("tiered", "tiered-fused", "tiered-lce") if n in peaks
                    and peaks[n] > peaks.get("stock", peaks[n])]
        ratio = f"{s / v['tiered']['ms_p50']:.2f}x" if "tiered" in v else ""
        out.append(f"| {model} | {wl} | {ctx} | {s:.3f} | {t} | {ratio} | {tv} | {f} | {fv} | {lig} | {lt} | {ltv} "
                   f"| {lig_lce} | {mem} |")
    training_only = (df["variant"] == "tiered-lce") & (df["workload"] != "train")  # skipped by design, with a note
    for _, r in df[df["ms_p50"].isna() & df["variant"].str.startswith("tiered") & ~training_only].iterrows():
        missing.append(f"{r['model']} {r['workload']} {r['context']} {r['variant']}: {r['note']}")
    out += ["", f"Rows of a tiered variant slower than stock: {len(slower)}" + (":" if slower else "."),
            *[f"- {x}" for x in slower],
            "", f"Training peaks of a tiered variant above stock's: {len(heavier)}" + (":" if heavier else "."),
            *[f"- {x}" for x in heavier]]
    if "tiered-lce" in set(ran["variant"]):
        out += ["", f"Training peaks of tiered-lce above liger-lce's (both with the fused LM head + loss): "
                f"{len(over_liger)}" + (":" if over_liger else "."), *[f"- {x}" for x in over_liger]]
    if (ran["variant"] == "stock-copy").any():
        out += ["", "Rows where the control (stock-copy, the same model as stock) reads faster or slower than stock: "
                f"{len(noise)}" + (":" if noise else "."), *[f"- {x}" for x in noise]]
    if missing:
        out += ["", "Rows without a figure:", *[f"- {x}" for x in missing]]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    (folder / "models.md").write_text(summary(folder))
    print(f"wrote {folder / 'models.md'}")
