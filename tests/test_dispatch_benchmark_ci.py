"""benchmarks/dispatch_overhead.py's interval of a median and its verdict against the target: the interval covers the
true median about 95 % of the time, narrows as rounds are added, and the verdict says which side of the target the
interval lies on (or that it lies across)."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "dispatch_overhead", Path(__file__).resolve().parents[1] / "benchmarks" / "dispatch_overhead.py")
bench = importlib.util.module_from_spec(SPEC)
_env = dict(os.environ)
SPEC.loader.exec_module(bench)  # (it sets its own environment defaults: not for the other tests)
os.environ.clear()
os.environ.update(_env)


def test_the_interval_covers_the_median_about_95_percent_of_the_time():
    rng = random.Random()
    trials, covered = 600, 0
    for _ in range(trials):
        xs = [rng.lognormvariate(0.0, 1.0) for _ in range(301)]  # skewed: the true median is exp(0) = 1
        lo, hi = bench.median_ci(xs)
        covered += lo <= 1.0 <= hi
    assert 0.90 <= covered / trials <= 0.99, covered / trials


def test_the_interval_narrows_with_more_rounds_and_holds_the_sample_median():
    rng = random.Random()
    widths = []
    for n in (50, 500, 5000):
        xs = [rng.gauss(0.8, 2.0) for _ in range(n)]
        lo, hi = bench.median_ci(xs)
        assert lo <= sorted(xs)[n // 2] <= hi
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2], widths
    assert bench.median_ci([3.0]) == (3.0, 3.0) and bench.median_ci([2.0, 1.0]) == (1.0, 2.0)


def test_the_verdict_says_where_the_interval_lies():
    assert bench.verdict((0.4, 0.9)) == "meets" and bench.verdict((0.4, 1.0)) == "meets"
    assert bench.verdict((1.01, 1.3)) == "over"
    assert bench.verdict((0.9, 1.2)) == "open"
    assert bench.verdict((0.2, 0.6), target=0.5) == "open"
