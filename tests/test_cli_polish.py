"""The command line as a newcomer meets it: options only as spelled, a mistake on one line, an aligned `list`, help
that names real files, and a `select` that measures a case once."""

import argparse
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiered_ops
from tiered_ops.cli.args import build_parser
from tiered_ops.cli.cli import main
from tiered_ops.registry import Impl, Tier
from tiered_ops.tiers.catalog import get_op

ROOT = Path(__file__).resolve().parents[1]
SOFTMAX = get_op("softmax")


def _parsers() -> list[argparse.ArgumentParser]:
    out, todo = [], [build_parser()]
    while todo:
        p = todo.pop()
        out.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    return out


@pytest.mark.parametrize("argv", [["select", "softmax", "8x16", "--dtyp", "fp32"], ["bench", "--op", "softmax"],
                                  ["export", "--csv", "x.csv", "--cont", "*"]])
def test_an_abbreviated_option_is_not_taken_for_the_whole_one(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"tiered-ops {argv[0]}: error: unrecognized arguments" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv, says", [
    (["select", "softmax", "8x16", "--dtype", "fp3"], "invalid choice: 'fp3'"),
    (["bench", "--dtype", "fp3"], "dtype must be one of fp32, bf16, fp16, got 'fp3'"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
])
def test_a_bad_value_is_one_line_without_the_usage(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert "-h`: the usage" in err


def test_list_is_aligned_whatever_the_length_of_the_names(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    starts = {tuple(m.start() for m in re.finditer(r"(?<=\s\s)\S", line))[:3] for line in lines}
    assert len(starts) == 1, starts  # impl, tier and state each start in one column on every line
    assert any(len(line.split()[0]) > 10 for line in lines)  # the case that used to drift


def test_every_path_a_help_text_names_exists():
    for p in _parsers():
        for text in [p.description or ""] + [a.help or "" for a in p._actions]:
            for path in re.findall(r"(?<![\w/.~])(?:tiered_ops|tests|benchmarks|scripts)/[\w/]+\.\w+", text):
                assert (ROOT / path).exists(), (p.prog, path)


@pytest.fixture
def eager_and_cuda(monkeypatch):
    """softmax with eager and its CUDA tier, which cannot run on the CPU."""
    monkeypatch.setattr(SOFTMAX, "impls", {"eager": SOFTMAX.impls["eager"], "cuda": SOFTMAX.impls["cuda"]})
    assert SOFTMAX.impls["cuda"].why_not(torch.device("cpu"))


def test_select_measures_a_case_once_even_with_a_tier_that_cannot_run_here(eager_and_cuda, tmp_path, caplog, capsys):
    db = str(tmp_path / "s.sqlite")
    argv = ["--db", db, "select", "softmax", "8x16", "--device", "cpu"]
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        assert main(argv) == 0
        assert "measuring 2 implementation(s) (eager, cuda)" in caplog.text
        caplog.clear()
        tiered_ops.clear_cache()  # as a second `tiered-ops select` process would
        assert main(argv) == 0
    assert "measuring" not in caplog.text and "tuned" not in caplog.text, caplog.text
    out = capsys.readouterr().out
    assert "unavailable: runs on cuda only" in out


def test_select_after_a_sweep_measures_nothing(eager_and_cuda, tmp_path, caplog, capsys):
    db = str(tmp_path / "s.sqlite")
    assert main(["--db", db, "bench", "--ops", "softmax", "--shapes", "8x16", "--mode", "fwd_nograd", "--no-meta",
                 "--no-progress", "--in-process"]) == 0
    tiered_ops.clear_cache()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        assert main(["--db", db, "select", "softmax", "8x16", "--device", "cpu"]) == 0
    assert "measuring" not in caplog.text and "tuned" not in caplog.text, caplog.text


def test_select_after_a_sweep_with_a_second_implementation(monkeypatch, tmp_path, caplog, capsys):
    again = Impl("again", Tier.COMPILE, lambda x, dim=-1: torch.softmax(x, dim), (SOFTMAX.source,))
    monkeypatch.setattr(SOFTMAX, "impls", {"eager": SOFTMAX.impls["eager"], "again": again})
    test_select_after_a_sweep_measures_nothing(None, tmp_path, caplog, capsys)


def test_python_and_python3_of_one_installation_are_one_build_environment(tmp_path):
    """A sweep run by `python3` (scripts/bench.sh) stores the CUDA tier as unavailable with its build environment; a
    `tiered-ops select` run by `python` must find that row fresh, not measure it again."""
    bin_dir = Path(sys.executable).parent
    names = [n for n in ("python", "python3") if (bin_dir / n).exists()]
    if len(names) < 2:
        pytest.skip(f"{bin_dir} has no python and python3 both")
    code = "from tiered_ops.environment import environment; print(environment())"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    seen = {subprocess.run([str(bin_dir / n), "-c", code], env=env, capture_output=True, text=True, check=True,
                           timeout=120).stdout for n in names}
    assert len(seen) == 1, seen
