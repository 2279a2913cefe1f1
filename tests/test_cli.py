"""The tiered-ops CLI end to end on the CPU (a real, small sweep)."""

import os

import pandas as pd

from tiered_ops.cli import main


def test_list_shows_every_tier_with_reasons(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for op in ("softmax", "rms_norm", "muladd", "layer_norm", "gelu"):
        for tier in ("eager", "compile", "triton", "cuda"):
            assert any(line.startswith(op) and f" {tier} " in line for line in out.splitlines()), (op, tier)
    assert "unavailable: runs on cuda only" in out


def test_bench_on_cpu_prints_table_and_writes_csv(tmp_path, capsys):
    csv = tmp_path / "bench.csv"
    db = tmp_path / "cli.sqlite"
    assert main(["--db", str(db), "bench", "--ops", "muladd", "--shapes", "96x80", "--dtypes", "fp32",
                 "--modes", "fwd_nograd,fwd+bwd", "--no-progress", "--device", "cpu", "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
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
