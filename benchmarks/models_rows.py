"""One row of benchmarks/models.py: its calls timed, their spread, the verdicts against stock and the control; and the
per-model page (models.csv, models.md) those rows make."""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

COLUMNS = ("model", "variant", "workload", "context", "tokens", "dtype", "ms_p50", "ms_p20", "ms_p80", "calls",
           "verdict", "rounds_slower", "verdict_vs_copy", "rounds_slower_vs_copy",
           "rel_err_vs_stock", "loss_rel_err_vs_stock", "grad_norm_rel_err_vs_stock", "tune_s", "peak_mib", "note",
           "device", "torch", "transformers", "liger")


def timed(fn: Callable[[], Any], reps: int, cuda: bool) -> list[float]:
    """Milliseconds of each of ``reps`` calls (CUDA events on a GPU, else the wall clock)."""
    ms = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
    return ms


def spread(ms: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80)."""
    q = statistics.quantiles(ms, n=5, method="inclusive") if len(ms) > 1 else [ms[0]] * 4
    return statistics.median(ms), q[0], q[3]


def verdict(mine: tuple[float, float, float], stock: tuple[float, float, float], slower_rounds: int,
            rounds: int) -> str:
    """faster / slower when each median lies outside the other's p20-p80 and every round agrees (``slower_rounds`` of
    ``rounds`` paired rounds had this variant's median above stock's: 0 for faster, all for slower), else a tie within
    the spread."""
    if mine[0] < stock[1] and stock[0] > mine[2] and slower_rounds == 0:
        return "faster"
    if mine[0] > stock[2] and stock[0] < mine[1] and slower_rounds == rounds:
        return "slower"
    return "tie"


def agreed(vs_stock: str, vs_copy: str | None) -> str:
    """The row's verdict: faster or slower only where the verdicts against stock and against the control agree."""
    return vs_stock if vs_copy is None or vs_stock == vs_copy else "tie"


def rounds_slower(mine: list[list[float]], stock: list[list[float]]) -> int:
    """In how many rounds this variant's median was above stock's (the same round)."""
    return sum(statistics.median(a) > statistics.median(b) for a, b in zip(mine, stock))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def _vs_copy(r: dict) -> str:
    return f"{r['verdict_vs_copy']} ({r['rounds_slower_vs_copy']})" if r.get("verdict_vs_copy") else ""


def render(rows: list[dict], head: list[str]) -> str:
    """models.md: per model, each workload x context, every variant's median, spread and verdict against stock."""
    out = ["# Model-level benchmark", "", *head, ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        out += [f"## {model}", "", "| workload | context | variant | median ms | p20-p80 ms | calls | vs stock | "
                "verdict | rounds slower | vs copy | rel err | loss rel err | grad norm rel err | tune s | peak MiB | "
                "note |", "|---|---|---|---:|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---|"]
        mine = [r for r in rows if r["model"] == model]
        for r in mine:
            stock = next((s for s in mine if s["variant"] == "stock" and s.get("workload") == r.get("workload")
                          and s.get("context") == r.get("context") and s.get("ms_p50")), None)
            speed = f"{stock['ms_p50'] / r['ms_p50']:.2f}x" if stock and r.get("ms_p50") else ""
            sp = f"{r['ms_p20']}-{r['ms_p80']}" if r.get("ms_p50") else ""
            out.append(f"| {r.get('workload', '')} | {r.get('context', '')} | {r['variant']} | {r.get('ms_p50', '')} "
                       f"| {sp} | {r.get('calls', '')} | {speed} | {r.get('verdict', '')} "
                       f"| {r.get('rounds_slower', '')} | {_vs_copy(r)} | {r.get('rel_err_vs_stock', '')} "
                       f"| {r.get('loss_rel_err_vs_stock', '')} | {r.get('grad_norm_rel_err_vs_stock', '')} "
                       f"| {r.get('tune_s', '')} | {r.get('peak_mib', '')} | {r.get('note', '')} |")
        out.append("")
    return "\n".join(out)


def save(rows: list[dict], out: Path, stem: str, columns: tuple[str, ...] | list[str], text: str) -> None:
    """``rows`` as ``out/<stem>.csv`` (``columns``, blank where a row has none) and ``text`` as ``out/<stem>.md``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in columns} for r in rows)
    (out / f"{stem}.md").write_text(text)


def write(rows: list[dict], out: Path, head: list[str]) -> None:
    save(rows, out, "models", COLUMNS, render(rows, head))
