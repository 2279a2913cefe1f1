"""The % of copy bandwidth per kernel version, from committed H100 results (the PERF_LOG table).

Run: python benchmarks/perf_log_table.py (from the repository root). Each column is one run; compare versions
through their ratio to the Triton tier measured in the same run, not across runs. A run whose file has since been
replaced by a later sweep is read at the commit that holds it ("commit:path", through git show).
"""

from __future__ import annotations

import io
import subprocess

import pandas as pd

RUNS = {"v1 (training run)": "11799ea:reports/nvidia-h100/training/results.csv",
        "v2a (call 2)": "11799ea:reports/nvidia-h100/v2a-call2/results.csv",
        "v2b (calls 3+4)": "7d92ff7:reports/nvidia-h100/results.csv"}


def read_results(where: str) -> pd.DataFrame:
    """A results CSV from the working tree, or from a commit when ``where`` is "commit:path"."""
    if ":" not in where:
        return pd.read_csv(where)
    text = subprocess.run(["git", "show", where], capture_output=True, text=True, check=True).stdout
    return pd.read_csv(io.StringIO(text))


def main() -> None:
    rows = []
    for run, f in RUNS.items():
        df = read_results(f)
        df = df[(df.ok == 1) & (df["mode"] == "fwd_nograd")].assign(shape=lambda d: d.problem.str.split(",").str[0])
        for (op, shape, dtype), g in df[df.op.isin(["softmax", "rms_norm", "layer_norm"])].groupby(
                ["op", "shape", "dtype"]):
            g = g.set_index("impl")
            if "cuda" in g.index and "triton" in g.index and shape in ("16384x4096", "4096x32768", "65536x256"):
                c, t = g.frac_copy["cuda"], g.frac_copy["triton"]
                rows.append(dict(op=op, shape=shape, dtype=dtype, run=run, v=f"{100 * c:.1f} ({c / t:.2f})"))
    t = pd.DataFrame(rows).pivot_table(index=["op", "shape", "dtype"], columns="run", values="v", aggfunc="first")
    print("| op | shape | dtype | " + " | ".join(t.columns) + " |")
    print("|---|---|---|" + "---|" * len(t.columns))
    for idx, r in t.iterrows():
        print("| " + " | ".join(idx) + " | " + " | ".join(str(x) for x in r.values) + " |")


if __name__ == "__main__":
    main()
