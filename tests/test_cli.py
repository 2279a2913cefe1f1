"""The tiered-ops CLI end to end on the CPU (a real, small sweep)."""

import argparse
import inspect
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from helpers import builtin_ops, default_sigint

import tiered_ops
from tiered_ops.analysis.analysis import shown as _shown
from tiered_ops.analysis.analysis import table
from tiered_ops.cli.args import build_parser
from tiered_ops.cli.cli import main
from tiered_ops.measure.meta import with_progress
from tiered_ops.tiers.catalog import get_op


def test_list_shows_every_tier_with_reasons(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for spec in builtin_ops():
        tiers = {i.tier.label for i in spec.impls.values()} & {"eager", "compile", "triton", "cuda"}
        assert {"eager", "compile", "triton"} <= tiers, (spec.name, tiers)  # cuda where cuda_src has the op's files
        for tier in tiers:
            assert any(line.startswith(spec.name) and f" {tier} " in line for line in out.splitlines()), (spec, tier)
    assert "unavailable: runs on cuda only" in out


def test_bench_on_cpu_prints_table_and_writes_csv(tmp_path, capsys):
    csv = tmp_path / "bench.csv"
    db = tmp_path / "cli.sqlite"
    assert main(["bench", "--ops", "muladd", "--shapes", "96x80", "--dtype", "fp32", "--mode", "fwd_nograd,fwd+bwd",
                 "--no-progress", "--device", "cpu", "--csv", str(csv), "--db", str(db), "--tables"]) == 0  # --db after
    out, err = capsys.readouterr()
    impls = len(get_op("muladd").impls)
    assert f"cost metadata 1/{impls}: muladd eager" in err  # the metadata phase says how far it is, on stderr
    assert "no GPU: benchmarking on the CPU" in out and "<- winner" in out and "% copy" in out
    assert "winner per mode" in out
    df = pd.read_csv(csv)
    assert set(df["mode"]) == {"fwd_nograd", "fwd+bwd"}
    assert set(df.impl) == {"eager", "compile", "triton", "eager_addcmul"}  # muladd has no CUDA kernel
    timed = df[df.caller_us.notna()]
    assert set(timed.impl) == {"eager", "compile", "eager_addcmul"} and (timed[timed.impl != "compile"].ok == 1).all()
    # the compile tier is timed first and gated only where a choice would take it
    assert all(r.ok == 1 or "(never chosen)" in r.reason for r in timed[timed.impl == "compile"].itertuples())
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
    with caplog.at_level("INFO", logger="tiered_ops.measure.meta"):
        assert list(with_progress(pairs)) == pairs  # stderr is captured here: no terminal, so log lines
    lines = [r.getMessage() for r in caplog.records if r.name == "tiered_ops.measure.meta"]
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
        [sys.executable, "-m", "tiered_ops.cli.cli", "bench", "--device", "cpu", "--ops", "muladd", "--shapes", "96x80",
         "--dtype", "fp32", "--mode", "fwd_nograd", "--impls", "eager,compile", "--no-progress"],
        env=dict(os.environ, TIERED_OPS_DB=str(db)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=default_sigint)
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


# ------------------------------------------------------------------------ routine errors: one line, exit 2
SOFTMAX = get_op("softmax")


@pytest.fixture
def quick_softmax(monkeypatch):
    """softmax with eager and one more implementation that is quick to measure on the CPU."""
    impls = {"eager": SOFTMAX.impls["eager"],
             "again": tiered_ops.registry.Impl("again", tiered_ops.registry.Tier.COMPILE,
                                               lambda x, dim=-1: torch.softmax(x, dim), (SOFTMAX.source,))}
    monkeypatch.setattr(SOFTMAX, "impls", impls)
    return impls


def _one_line_error(capsys, *says: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    for s in says:
        assert s in err, (s, err)
    return err


def _results_csv(path) -> str:
    pd.DataFrame([dict(op="softmax", impl="eager", tier="eager", problem="8x4,dim=-1", dtype="fp32", mode="fwd",
                       device_key="cpu", ok=1, caller_us=1.0, source_hash="h", timestamp=1.0)]).to_csv(path)
    return str(path)


@pytest.mark.parametrize("case", ["db-is-a-directory", "db-cannot-be-created", "check-missing", "check-not-csv",
                                  "check-binary", "check-other-csv", "report-missing", "report-repeat-missing",
                                  "compare-missing", "export-missing-dir", "export-meta-missing-dir",
                                  "decisions-export-missing-dir"])
def test_a_routine_error_is_one_line_naming_the_path_and_exit_2(case, tmp_path, capsys):
    ok = _results_csv(tmp_path / "a" / "results.csv") if (tmp_path / "a").mkdir() is None else None
    missing, db = tmp_path / "nope.csv", ["--db", str(tmp_path / "s.sqlite")]
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nnot, a, results, file\n\"unclosed\n")
    binary = tmp_path / "blob.csv"
    binary.write_bytes(bytes(range(256)) * 8)
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    argv, says = {
        "db-is-a-directory": (["--db", str(tmp_path), "select", "softmax", "8x4", "--no-tune", "--device", "cpu"],
                              [str(tmp_path), "is a directory", "set TIERED_OPS_DB or --db"]),
        "db-cannot-be-created": (["--db", "/proc/tiered-ops-missing/s.sqlite", "export", "--csv",
                                  str(tmp_path / "x.csv")], ["/proc/tiered-ops-missing/s.sqlite"]),
        "check-missing": (["check", "--results", ok, str(missing)], [str(missing), "no such file"]),
        "check-not-csv": (["check", "--results", str(notes)], [str(notes), "not a results CSV"]),
        "check-binary": (["check", "--results", str(binary)], [str(binary), "not a results CSV"]),
        "check-other-csv": (["check", "--results", str(other)], [str(other), "not a results CSV", "no column op"]),
        "report-missing": (["report", "--results", str(missing), "--out", str(tmp_path / "r"), "--command", "x"],
                           [str(missing), "no such file"]),
        "report-repeat-missing": (["report", "--results", ok, "--repeat", str(missing), "--out", str(tmp_path / "r"),
                                   "--command", "x"], [str(missing)]),
        "compare-missing": (["compare", "--results", ok, str(missing), "--out", str(tmp_path / "c.md")],
                            [str(missing), "no such file"]),
        "export-missing-dir": ([*db, "export", "--csv", str(tmp_path / "no" / "x.csv")],
                               [str(tmp_path / "no"), "does not exist", "mkdir -p"]),
        "export-meta-missing-dir": ([*db, "export", "--csv", str(tmp_path / "x.csv"), "--meta",
                                     str(tmp_path / "no" / "m.jsonl")], [str(tmp_path / "no"), "does not exist"]),
        "decisions-export-missing-dir": ([*db, "decisions", "export", "--out", str(tmp_path / "no" / "p.json")],
                                         [str(tmp_path / "no"), "does not exist"]),
    }[case]
    assert main(argv) == 2
    _one_line_error(capsys, *says)
    assert not (tmp_path / "r").exists()


def test_a_postgresql_server_that_is_down_is_one_line_exit_2(tmp_path, capsys):
    pytest.importorskip("psycopg")
    url = "postgresql://nobody@127.0.0.1:9/none?connect_timeout=2"
    assert main(["--db", url, "select", "softmax", "8x4", "--no-tune", "--device", "cpu"]) == 2
    _one_line_error(capsys, "127.0.0.1:9", "cannot connect to PostgreSQL")


def test_an_unknown_postgresql_database_is_one_line_exit_2(pg_server, capsys):
    url = pg_server.url("no_such_database_here")
    assert main(["--db", url, "export", "--csv", os.devnull]) == 2
    _one_line_error(capsys, "no_such_database_here", "cannot connect to PostgreSQL")


def test_check_exits_1_only_when_the_check_fails(tmp_path, capsys):
    """A results file that is read and checked keeps exit 1 for a failed check (no CUDA evidence on this CSV)."""
    assert main(["check", "--results", _results_csv(tmp_path / "results.csv")]) in (0, 1)
    assert "error:" not in capsys.readouterr().err


def test_select_into_a_read_only_store_says_nothing_was_saved(quick_softmax, tmp_path, monkeypatch, capsys, caplog):
    db = tmp_path / "s.sqlite"
    tiered_ops.store.store.Store(db).close()
    before = db.read_bytes()
    monkeypatch.setattr(tiered_ops.cli.cli, "Store", lambda p: tiered_ops.store.store.Store(p, read_only=True))
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        assert main(["--db", str(db), "select", "softmax", "8x16", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "stored in" not in out + err + caplog.text
    # two implementations: 2 rows, or 3 where the compiled one, timed before its gate, is stored again once gated
    assert re.search(r"nothing was saved: [23] new measurement\(s\) kept in memory only", err) and str(db) in err
    assert db.read_bytes() == before and tiered_ops.get_store().writable is False


def test_select_logs_what_it_tunes_and_what_it_decided(quick_softmax, tmp_path, caplog, capsys):
    db = tmp_path / "s.sqlite"
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        assert main(["--db", str(db), "select", "softmax", "8x16", "--device", "cpu"]) == 0
    tuning = next(r.getMessage() for r in caplog.records if "tiered_ops: tuning" in r.getMessage())
    for part in ("softmax", "8x16", "fp32", "fwd_nograd", "eager", "2 implementation(s) (eager, again)",
                 f"stored in {db}"):
        assert part in tuning, (part, tuning)
    done = next(r.getMessage() for r in caplog.records if "tiered_ops: tuned" in r.getMessage())
    assert re.search(r"tuned softmax 8x16,dim=-1 fp32 fwd_nograd eager in \d+\.\d s: (eager|again) ", done), done


def test_quiet_shows_warnings_only(quick_softmax, tmp_path, capsys):
    assert main(["-q", "--db", str(tmp_path / "s.sqlite"), "select", "softmax", "8x16", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    # the CLI's handler shows warnings only: at most the process's first-use warning, never the INFO "tuned" line
    assert "tiered_ops: tuned" not in err and all("on first use" in line for line in err.splitlines()), err
    assert logging.getLogger("tiered_ops").level == logging.NOTSET  # restored after the command
    parser = build_parser()
    assert parser.parse_args(["select", "softmax", "8x4", "-q"]).quiet
    assert parser.parse_args(["-q", "select", "softmax", "8x4"]).quiet
    assert not parser.parse_args(["select", "softmax", "8x4"]).quiet


# ------------------------------------------------------------------ every TIERED_OPS_* variable applies to the CLI
def _select_json(tmp_path, capsys, *extra: str) -> dict:
    import json

    assert main(["--db", str(tmp_path / "s.sqlite"), "select", "softmax", "8x16", "--device", "cpu", "--json",
                 *extra]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


def test_tiered_ops_tune_0_is_honoured_by_select(quick_softmax, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    monkeypatch.setattr(tiered_ops.decide.decide, "measure_kept",
                        lambda *a, **k: pytest.fail("measured with tuning off"))
    record = _select_json(tmp_path, capsys)
    assert record["chosen"] == "eager" and "tuning off" in record["reason"]


def test_tiered_ops_policy_and_calls_are_honoured_by_select(quick_softmax, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERED_OPS_POLICY", "cold-start")
    monkeypatch.setenv("TIERED_OPS_CALLS", "7")
    record = _select_json(tmp_path, capsys)
    assert record["policy"] == "cold-start" and record["calls"] == 7
    monkeypatch.delenv("TIERED_OPS_POLICY")
    record = _select_json(tmp_path, capsys, "--policy", "cold-start")  # the calls of the variable, the policy given
    assert record["policy"] == "cold-start" and record["calls"] == 7
    assert _select_json(tmp_path, capsys, "--policy", "cold-start", "--calls", "9")["calls"] == 9


def test_tiered_ops_margins_is_read_by_select(quick_softmax, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERED_OPS_MARGINS", "warp=0.5")
    assert main(["-q", "--db", str(tmp_path / "s.sqlite"), "select", "softmax", "8x16", "--device", "cpu", "--policy",
                 "cost-aware"]) == 2
    _one_line_error(capsys, "TIERED_OPS_MARGINS: unknown tier 'warp'")


def test_tiered_ops_db_is_the_cli_store_unless_db_is_given(quick_softmax, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERED_OPS_DB", str(tmp_path / "env.sqlite"))
    assert main(["export", "--csv", str(tmp_path / "x.csv")]) == 0
    assert f"from {tmp_path / 'env.sqlite'} to" in capsys.readouterr().out
    assert main(["--db", str(tmp_path / "flag.sqlite"), "export", "--csv", str(tmp_path / "x.csv")]) == 0
    assert f"from {tmp_path / 'flag.sqlite'} to" in capsys.readouterr().out


def test_decisions_export_and_import_say_their_summary_once(quick_softmax, tmp_path, capsys):
    db, pack = tmp_path / "s.sqlite", tmp_path / "pack.json"
    tiered_ops.use_store(str(db))
    tiered_ops.softmax(torch.randn(8, 16), -1)
    tiered_ops.get_store().close()
    assert main(["--db", str(db), "decisions", "export", "--out", str(pack)]) == 0
    out, err = capsys.readouterr()
    assert (out + err).count("wrote 1 decisions") + (out + err).count("wrote 1 decision ") == 1, out + err
    assert main(["--db", str(tmp_path / "t.sqlite"), "decisions", "import", str(pack)]) == 0
    out, err = capsys.readouterr()
    assert (out + err).count("2 measurement(s) added") + (out + err).count("2 row(s) added") == 1, out + err


def test_bench_shapes_take_the_op_options_a_report_prints(tmp_path, capsys):
    """A problem as results.csv prints it (dims, then name=value options) is a --shapes value: the sweep measures that
    problem, options typed by the op's own parameters; an option the op does not take names the op and its options."""
    db = tmp_path / "opts.sqlite"
    out = tmp_path / "o.csv"
    assert main(["bench", "--ops", "linear_cross_entropy", "--impls", "eager", "--shapes",
                 "16x8,vocab=40,head_bias=True,reduction=sum", "--dtype", "fp32", "--mode", "fwd_nograd",
                 "--no-progress", "--no-meta", "--device", "cpu", "--db", str(db), "--csv", str(out)]) == 0
    capsys.readouterr()
    df = pd.read_csv(out)
    assert set(df.problem) == {"16x8,head_bias=True,ignored=0.0,label_smoothing=0.0,reduction=sum,vocab=40"}
    assert main(["bench", "--ops", "linear_cross_entropy", "--shapes", "16x8,vocabulary=40", "--device", "cpu",
                 "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "linear_cross_entropy takes no option vocabulary" in err and "its options: vocab, head_bias" in err
    assert main(["bench", "--ops", "linear_cross_entropy", "--shapes", "16x8,vocab=forty", "--device", "cpu",
                 "--db", str(db)]) == 2
    assert "linear_cross_entropy's option vocab" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "--shapes", "16x8,vocab"])
    assert e.value.code == 2 and "must look like vocab=32000" in capsys.readouterr().err
