"""benchmarks/PERF_LOG.md's tables are what the script it names prints from the files it cites."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_perf_log_table_is_what_its_script_prints():
    try:
        out = subprocess.run([sys.executable, "benchmarks/perf_log_table.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=120).stdout
    except subprocess.CalledProcessError as e:
        if "git" in e.stderr or "fatal" in e.stderr:
            pytest.skip(f"a cited results file is not in this clone's history: {e.stderr.strip()[:200]}")
        raise
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) > 10
    log = (ROOT / "benchmarks" / "PERF_LOG.md").read_text().splitlines()
    start = log.index(table[0])
    assert log[start:start + len(table)] == table
