"""The tiered-ops CLI end to end on the CPU (a real, small sweep)."""

import argparse
import inspect
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pandas as pd
import pytest
from helpers import builtin_ops

import tiered_ops
from tiered_ops.analysis import shown as _shown
from tiered_ops.analysis import table
from tiered_ops.catalog import get_op
from tiered_ops.cli import main
from tiered_ops.cli_args import build_parser
from tiered_ops.meta import with_progress


def test_list_shows_every_tier_with_reasons(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for op in (s.name for s in builtin_ops()):
        for tier in ("eager", "compile", "triton", "cuda"):
            assert any(line.startswith(op) and f" {tier} " in line for line in out.splitlines()), (op, tier)
    assert "unavailable: runs on cuda only" in out


def test_bench_on_cpu_prints_table_and_writes_csv(tmp_path, capsys):
    csv = tmp_path / "bench.csv"
    db = tmp_path / "cli.sqlite"
    assert main(["bench", "--ops", "muladd", "--shapes", "96x80", "--dtype", "fp32", "--mode", "fwd_nograd,fwd+bwd",
                 "--no-progress", "--device", "cpu", "--csv", str(csv), "--db", str(db)]) == 0  # --db after it too
    out, err = capsys.readouterr()
    impls = len(get_op("muladd").impls)
    assert f"cost metadata 1/{impls}: muladd eager" in err  # the metadata phase says how far it is, on stderr
    assert "no GPU: benchmarking on the CPU" in out and "<- winner" in out and "% copy" in out
    assert "winner per mode" in out
    df = pd.read_csv(csv)
    assert set(df["mode"]) == {"fwd_nograd", "fwd+bwd"}
    assert set(df.impl) == {"eager", "compile", "triton", "cuda", "eager_addcmul"}
    timed = df[df.caller_us.notna()]
    assert set(timed.impl) == {"eager", "compile", "eager_addcmul"} and (timed.ok == 1).all()
    triton = df[df.impl == "triton"].iloc[0]
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert triton.ok == 1 and "not timed" in triton.reason  # interpreter: gated, not timed
    else:  # a GPU machine benching its CPU: Triton needs the interpreter there
        assert triton.ok == 0 and triton.reason.startswith("unavailable")
    assert main(["--db", str(db), "select", "muladd", "96x80", "--no-tune", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "fastest correct" in out and "fwd_nograd" in out
    sel = ["--db", str(db), "select", "muladd", "96x80", "--no-tune", "--device", "cpu", "--mode"]
    assert main(sel + ["fwd+bwd"]) == 0
    assert "fwd+bwd" in capsys.readouterr().out
    assert main(sel + ["bwd"]) == 0
    assert "no stored decision" in capsys.readouterr().out  # bwd was not measured: its own decision


def test_bad_shape_is_a_clear_error(capsys):
    try:
        main(["bench", "--shapes", "12xq"])
    except SystemExit as e:
        assert e.code == 2
    assert "shape must look like 16384x4096" in capsys.readouterr().err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_argument_has_help_and_every_subcommand_is_listed():
    parser = build_parser()
    top = parser.format_help()
    assert "tiered-ops COMMAND -h" in top
    subs = _subcommands(parser)
    assert len(subs) == 11
    for name, sub in subs.items():
        assert re.search(rf"^\s+{re.escape(name)}\s+\S", top, re.M), f"{name} missing from the top-level help"
        for action in sub._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"


def test_one_spelling_per_option_and_the_old_one_still_parses():
    subs = _subcommands(build_parser())
    for name in ("bench", "check"):
        shown = subs[name].format_help()
        assert "--dtype " in shown and "--mode " in shown and "--dtypes" not in shown and "--modes" not in shown
    old = build_parser().parse_args(["bench", "--dtypes", "bf16,fp32", "--modes", "fwd+bwd"])
    assert old.dtype == [tiered_ops.registry.DTYPES["bf16"], tiered_ops.registry.DTYPES["fp32"]]
    assert old.mode == ["fwd+bwd"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_db_is_accepted_before_or_after_the_subcommand(tmp_path, where, capsys):
    db = tmp_path / "s.sqlite"
    args = ["select", "softmax", "8x4", "--no-tune", "--device", "cpu"]
    args = ["--db", str(db), *args] if where == "before" else [*args, "--db", str(db)]
    assert build_parser().parse_args(args).db == str(db)
    assert main(args) == 0 and db.exists()


def test_every_op_parameter_has_a_select_option():
    options = {s: a.help for a in _subcommands(build_parser())["select"]._actions for s in a.option_strings}
    for spec in builtin_ops():
        for prm in list(inspect.signature(spec.problem).parameters.values())[1:]:
            flag = f"--{'no-' if prm.default is True else ''}{prm.name.replace('_', '-')}"
            assert spec.name in options.get(flag, ""), (spec.name, flag)


@pytest.mark.parametrize("argv, says", [
    (["layer_norm", "8x4096", "--dim", "3"], "layer_norm takes no --dim; its options: --normalized-shape, "
                                             "--no-weight, --no-bias"),
    (["gelu", "8x4096", "--normalized-shape", "4096"], "gelu takes no --normalized-shape; its options: --no-bias, "
                                                       "--approximate"),
    (["softmax", "8x4", "--approximate", "tanh"], "softmax takes no --approximate; its options: --dim"),
])
def test_an_option_the_op_does_not_take_is_rejected_by_name_before_anything_runs(tmp_path, capsys, argv, says):
    db = tmp_path / "never.sqlite"
    assert main(["select", *argv, "--db", str(db)]) == 2
    assert says in capsys.readouterr().err
    assert not db.exists()  # rejected before the store was opened or anything measured


@pytest.mark.parametrize("argv, says", [
    (["select", "softmax", "-1x4"], "shape: dims must be positive, got -1x4"),
    (["select", "softmax", "8x0"], "shape: dims must be positive, got 8x0"),
    (["bench", "--shapes", "64x64", "-1x4"], "--shapes: dims must be positive, got -1x4"),
    (["bench", "--shapes", "0x4"], "--shapes: dims must be positive, got 0x4"),
])
def test_negative_or_zero_dims_are_a_clear_error(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(-1, 64), (8, 0)])
def test_select_backend_rejects_dims_that_are_not_positive(shape):
    with pytest.raises(ValueError, match="shapes: dims must be positive"):
        tiered_ops.select_backend("softmax", shape, "fp32", "cpu", tune=False)


def test_an_ungated_eager_gradient_is_not_printed_as_a_relative_error():
    """Eager's gradients are not gated; over a normalized dim of 1 the exact gradient is 0 and eager's roundoff,
    measured against the zero floor, read 1.8e+01 next to '<- winner'. Gated figures are printed as they are."""
    base = dict(op="layer_norm", problem="8x1", dtype="fp32", ok=1, p50_us=5.0, caller_us=5.0, gbps=1.0,
                frac_copy=0.1, reason=None)
    df = pd.DataFrame([dict(base, impl="eager", tier="eager", mode="fwd+bwd", rel_error=17.8),
                       dict(base, impl="compile", tier="compile", mode="fwd+bwd", rel_error=7.9e-7, caller_us=9.0),
                       dict(base, impl="eager", tier="eager", mode="fwd_nograd", rel_error=3e-8)])
    note: list[str] = []
    text = table(_shown(df, note), "layer_norm")
    assert "1.8e+01" not in text and "7.9e-07" in text and "3.0e-08" in text
    assert len(note) == 1 and "0 in exact arithmetic" in note[0]
    assert df.rel_error[0] == 17.8  # the rows themselves (CSV, store) keep the figure


def test_the_metadata_phase_logs_a_line_per_implementation_when_not_on_a_terminal(caplog):
    spec = get_op("muladd")
    pairs = [(spec, spec.impls["eager"]), (spec, spec.impls["compile"])]
    with caplog.at_level("INFO", logger="tiered_ops.meta"):
        assert list(with_progress(pairs)) == pairs  # stderr is captured here: no terminal, so log lines
    lines = [r.getMessage() for r in caplog.records if r.name == "tiered_ops.meta"]
    assert [line.split(" (")[0] for line in lines] == ["cost metadata 1/2: muladd eager",
                                                        "cost metadata 2/2: muladd compile"]


def _stored(db) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_ctrl_c_stops_the_bench_within_seconds_and_keeps_finished_rows(tmp_path):
    """SIGINT while the worker compiles a candidate (~10 s on the CPU): the sweep used to wait for the worker to
    finish it before stopping it; now it stops at once. 2 s is the aim; the bound has slack for a loaded CI box."""
    db = tmp_path / "s.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiered_ops.cli", "bench", "--device", "cpu", "--ops", "muladd", "--shapes", "96x80",
         "--dtype", "fp32", "--mode", "fwd_nograd", "--impls", "eager,compile", "--no-progress"],
        env=dict(os.environ, TIERED_OPS_DB=str(db)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while _stored(db) < 1:  # eager is stored: the worker is now on compile
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the bench stored nothing in 300 s"
            time.sleep(0.05)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"bench stopped {took:.2f} s after SIGINT")
    assert proc.returncode == 130 and "interrupted: every finished measurement is in" in out, out
    assert took < 4, f"took {took:.2f} s to stop"
    assert _stored(db) >= 1
