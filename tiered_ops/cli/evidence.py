"""Committed GPU evidence on the command line: ``tiered-ops check --results/--all`` over the current and archived GPUs
(``reports/gpus.toml``, ``tiered_ops.analysis.gpus``), and the archive note ``report`` and ``compare`` print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..analysis import gpus as gpu_list
from ..analysis.check import by_gpu, check_gpus
from .io import UsageError, read_results


def check_files(args: argparse.Namespace) -> int:
    """check --results FILE... / --all DIR: the current GPUs' evidence gates (exit 1 when it fails); the archived
    GPUs' is reported for information."""
    if bool(args.results) == bool(args.all):
        print("error: check needs --results reports/<gpu>/results.csv, --all reports or --live", file=sys.stderr)
        return 2
    if args.all:
        base = Path(args.all)
        if not base.is_dir():
            raise UsageError(f"check --all {args.all}: no such directory; expected the reports folder")
        files = sorted(str(p) for p in base.glob("*/results.csv"))
        own = base / gpu_list.FILE_NAME
        gpus = gpu_list.load(args.gpus or (own if own.is_file() else None))
        for g in gpus.current:
            if not (base / g / "results.csv").is_file():
                print(f"{g}: current, but no {base / g / 'results.csv'}: no evidence of it to check")
        if not files:
            print(f"no {base / '*' / 'results.csv'}: no GPU evidence to check")
            return 0
    else:
        files = args.results
        gpus = gpu_list.load(args.gpus or gpu_list.find(files[0]))
    text, fails = check_gpus(by_gpu([(gpus.of_file(f), read_results([f])) for f in files], gpus), gpus)
    print(text)
    return 1 if fails else 0


def archived_note(results: str) -> str | None:
    """The archive note of the GPU of a results file (the gpus.toml above it), None where the GPU is current."""
    gpus = gpu_list.load(gpu_list.find(results))
    a = gpus.archive(gpus.of_file(results))
    return a.describe() if a is not None else None
