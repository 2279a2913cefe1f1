"""tiered-ops check on crafted results: a CUDA kernel passes only when it beats every compiler tier by its margin
plus the noise, fails on stale evidence, and a retired kernel is reported (and flagged when it wins again)."""

import pandas as pd
import pytest

from tiered_ops.catalog import get_op
from tiered_ops.check import check
from tiered_ops.cli import main

SPEC = get_op("softmax")
TIMES = {"eager": 200.0, "compile": 150.0, "triton": 150.0}


def _rows(cuda_us: float, triton_us: float = 150.0, spread: float = 0.02, cuda_hash: str | None = None) -> pd.DataFrame:
    rows = []
    for p in SPEC.default_problems("cuda"):
        for impl, us in {**TIMES, "triton": triton_us, "cuda": cuda_us}.items():
            i = SPEC.impls[impl]
            rows.append(dict(op="softmax", impl=impl, tier=i.tier.label, mode="fwd_nograd", problem=str(p),
                             dtype="bf16", device_key="gpu", ok=1, p20_us=us * (1 - spread / 2), p50_us=us,
                             p80_us=us * (1 + spread / 2), caller_us=us, timestamp=1.0,
                             source_hash=cuda_hash if impl == "cuda" and cuda_hash else i.source_hash))
    return pd.DataFrame(rows)


@pytest.fixture(autouse=True)
def _not_retired(monkeypatch):
    """The crafted cases are about a kernel in service: the real softmax CUDA kernel is retired (retired.py)."""
    monkeypatch.setattr(SPEC.impls["cuda"], "retired", None)


def _one(df):
    (f,) = [f for f in check(df, [SPEC]) if f.impl == "cuda"]
    return f


def test_a_kernel_that_beats_every_compiler_tier_by_its_margin_passes():
    f = _one(_rows(cuda_us=100.0))
    assert f.kind == "beats" and not f.fails


def test_a_kernel_inside_its_margin_fails_and_names_the_tier_to_retire_to():
    f = _one(_rows(cuda_us=100.0, triton_us=105.0))
    # needs more than 1 + margin (10 %) + spread (2 %)
    assert f.kind == "loses" and f.fails and "retire it to triton" in f.text and "needs > 1.12x" in f.text


def test_a_win_inside_the_noise_is_not_a_win():
    assert _one(_rows(cuda_us=100.0, triton_us=130.0, spread=0.02)).kind == "beats"
    assert _one(_rows(cuda_us=100.0, triton_us=130.0, spread=0.4)).kind == "loses"  # needs > 1.5x


def test_stale_evidence_fails():
    findings = check(_rows(cuda_us=100.0, cuda_hash="0123456789abcdef"), [SPEC])
    assert any(f.kind == "stale" and f.impl == "cuda" and f.fails for f in findings)
    assert any(f.kind == "no-evidence" and f.impl == "cuda" for f in findings)


def test_a_retired_kernel_is_reported_not_failed_and_flagged_when_it_wins(monkeypatch):
    monkeypatch.setattr(SPEC.impls["cuda"], "retired", "v1 reads rows twice; Triton wins at 16384x4096")
    f = _one(_rows(cuda_us=160.0))
    assert f.kind == "retired" and not f.fails
    f = _one(_rows(cuda_us=100.0))
    assert f.kind == "retired-wins" and not f.fails and "now wins" in f.text


def test_cli_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    _rows(cuda_us=100.0).to_csv(good, index=False)
    _rows(cuda_us=149.0).to_csv(bad, index=False)
    assert main(["check", "--results", str(good)]) == 0
    assert "check passed" in capsys.readouterr().out
    assert main(["check", "--results", str(bad)]) == 1
    assert "FAIL softmax cuda [loses]" in capsys.readouterr().out
    assert main(["check"]) == 2


@pytest.mark.parametrize("csv", ["reports/nvidia-h100/training/results.csv"])
def test_the_committed_h100_evidence_is_checked_and_its_verdict_is_what_it_is(csv, capsys):
    """Not a pass: the training run (reports/nvidia-h100/training) measured kernel sources that have changed since,
    so the check calls that evidence stale. This pins that the check reads real results and says so."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / csv
    assert main(["check", "--results", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL softmax triton [stale]" in out and "FAIL layer_norm cuda [stale]" in out


@pytest.mark.parametrize("csv", ["reports/nvidia-h100/results.csv", "reports/nvidia-h200/results.csv"])
def test_the_current_evidence_passes_with_every_losing_kernel_retired(csv, monkeypatch, capsys):
    from pathlib import Path

    from tiered_ops import retired

    monkeypatch.undo()  # this one checks the kernels as retired.py has them
    retired.apply()
    path = Path(__file__).resolve().parent.parent / csv
    assert main(["check", "--results", str(path)]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and out.count("[retired") == 5


def test_check_compares_rows_of_one_device_only():
    """Two GPUs' results checked together: on GPU A the kernel beats the compiler tiers by 1.5x, on GPU B it loses
    (its compiler tiers are faster than GPU A's cuda row). Mixed, GPU A's cuda row would be judged against GPU B's
    faster Triton row and lose; per device, GPU A's cases all win and GPU B's all lose."""
    a = _rows(cuda_us=100.0).assign(device_key="gpu-a")
    b = _rows(cuda_us=100.0, triton_us=60.0).assign(device_key="gpu-b")
    b.loc[b.impl.isin(["eager", "compile"]), "caller_us"] = 60.0
    f = _one(pd.concat([a, b]))
    assert f.kind == "loses"
    assert f.text.count("cuda 100.0 us vs") == len(SPEC.default_problems("cuda"))  # only GPU B's cases lose
    assert "needs" in f.text and "60.0 us" in f.text and "150.0 us" not in f.text
    assert _one(a).kind == "beats"
