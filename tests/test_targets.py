"""The speed targets as data: the committed grid and targets files, the grid selection and regret on the CPU (a
real sweep of two grid points), the render of every target from crafted results (met and NOT met, at the spec's
thresholds), and the commands that take them."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import builtin_ops

from tiered_ops.analysis import targets
from tiered_ops.cli.cli import main
from tiered_ops.store.store import Store
from tiered_ops.sweep import live
from tiered_ops.sweep.bench import sweep
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
GRID, SPEC = ROOT / "benchmarks" / "grid.csv", ROOT / "benchmarks" / "targets.json"


def test_the_committed_grid_spans_rows_columns_and_dtypes_off_the_default_problems():
    points = live.load_grid(GRID)
    assert len(points) >= 40
    assert {p.op for p in points} == {s.name for s in builtin_ops()}  # every op has points (not a test's plant)
    rows = [p.shape[0] for p in points]
    cols = [p.shape[-1] for p in points]
    assert min(rows) == 1 and max(rows) == 65536 and min(cols) == 7 and max(cols) == 400000
    assert {p.dtype for p in points} == {"fp32", "bf16", "fp16"}
    defaults = {str(q) for op in {p.op for p in points} for q in get_op(op).default_problems("cuda")}
    assert not any(str(live.grid_problem(p.op, p.shape, p.params)) in defaults for p in points)  # never tuned on
    assert not hasattr(targets, "GRID")  # the product holds no grid of its own


def test_a_grid_file_is_csv_or_json_and_a_bad_entry_is_named(tmp_path):
    js = tmp_path / "grid.json"
    js.write_text(json.dumps([dict(op="softmax", shape="6x10x4", dtype="bf16", mode="fwd+bwd", params={"dim": 1}),
                              dict(op="gelu", shape="1x7", dtype="fp16", mode="fwd_nograd")]))
    points = live.load_grid(js)
    assert points[0] == live.GridPoint("softmax", (6, 10, 4), "bf16", "fwd+bwd", {"dim": 1})
    assert str(live.grid_problem(*points[0][:2], points[0].params)) == str(get_op("softmax").problem((6, 10, 4),
                                                                                                        dim=1))
    assert points[1].params == {}
    bad = tmp_path / "bad.csv"
    for line, match in (("softmax,1x7,fp64,fwd_nograd,{}", "line 2: dtype 'fp64'"),
                        ("softmax,1xseven,fp32,fwd_nograd,{}", "line 2: shape '1xseven'"),
                        ("softmax,1x7,fp32,fwd_nograd,dim=1", "line 2: params 'dim=1' is not a JSON object"),
                        ("softmax,,fp32,fwd_nograd,{}", "line 2: missing shape"),
                        ("nosuchop,1x7,fp32,fwd_nograd,{}", "unknown op 'nosuchop'")):
        bad.write_text("op,shape,dtype,mode,params\n" + line + "\n")
        with pytest.raises(ValueError, match=match):
            live.load_grid(bad)


def test_the_committed_targets_file_loads_and_a_bad_one_is_named(tmp_path):
    spec = targets.load_spec(SPEC)
    assert [t["kind"] for t in spec["targets"]] == list(targets.KINDS)
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"targets": [{"kind": "fastest_ever"}]}))
    with pytest.raises(ValueError, match="target 1: kind 'fastest_ever'"):
        targets.load_spec(bad)
    bad.write_text(json.dumps({"targets": [{"kind": "dispatch", "shapes": ["1x4096"]}]}))
    with pytest.raises(ValueError, match=r"target 1 \(dispatch\): missing dtypes, at_most"):
        targets.load_spec(bad)


def test_live_grid_selects_from_the_nearest_bucket_and_regret_is_measured(tmp_path):
    main_db = tmp_path / "main.sqlite"
    spec = get_op("muladd")
    store = Store(main_db)
    sweep([spec], {"muladd": [spec.problem((64, 64))]}, [torch.float32], CPU, store, progress=False,
          log=lambda s: None, modes=["fwd_nograd"], impls=["eager", "eager_addcmul"])
    store.close()
    points = [live.GridPoint("muladd", (50, 100), "fp32", "fwd_nograd", {}),
              live.GridPoint("muladd", (3, 5), "bf16", "fwd_nograd", {})]
    said: list[str] = []
    picks = live.live_grid(CPU, str(main_db), str(tmp_path / "grid.sqlite"), points, log=said.append,
                           isolate=False, tuned_db=str(tmp_path / "tuned.sqlite"),
                           picks_csv=str(tmp_path / "picks.csv"))
    assert "nearest measured bucket" in picks.reason[0]  # fp32 was measured, bf16 (no fp16 either) was not
    assert picks.selected[1] == "eager" and "no stored decision" in picks.reason[1]
    assert list(picks["mode"]) == ["fwd_nograd", "fwd_nograd"]
    # tuning on: each point's bucket measured in its own store (holding the main store's rows), not the grid's
    assert all("no stored decision" not in r and "tuning off" not in r for r in picks.tuned_reason), picks
    assert set(picks.tuned) <= {"eager", "eager_addcmul", "compile", "triton"}
    tuned = pd.DataFrame(Store(tmp_path / "tuned.sqlite").rows())
    assert {"64x64", "50x100", "3x5"} <= set(tuned.problem)
    assert any(line.startswith("tuned 2/2: muladd 3x5 bf16") for line in said), said
    assert list(pd.read_csv(tmp_path / "picks.csv").tuned) == list(picks.tuned)
    assert live.export_grid(tmp_path, points) == ["grid.csv", "tuned.csv"]
    assert set(pd.read_csv(tmp_path / "tuned.csv").problem) == {"50x100", "3x5"}  # the points' own, not 64x64's
    gstore = Store(tmp_path / "grid.sqlite")
    grid = pd.DataFrame(gstore.rows())
    assert {"eager", "eager_addcmul"} <= set(grid.impl)
    # one sweep over both points, each in its own dtype, and no cost metadata (the grid needs timings only)
    assert set(zip(grid.problem, grid.dtype)) == {("50x100", "fp32"), ("3x5", "bf16")}
    r = grid.iloc[0]
    assert gstore.get_meta("muladd", r.impl, r.device_key, r.source_hash) is None
    gstore.close()
    for tuned in (False, True):
        n, geo, worst = targets.regret_summary(grid, picks, tuned=tuned)
        assert n == 2 and 1.0 <= geo <= worst  # the selected one is never faster than the best measured


def _row(op, impl, tier, problem, dtype, mode, us, frac=0.5):
    return dict(op=op, impl=impl, tier=tier, problem=problem, dtype=dtype, mode=mode, ok=1, caller_us=us, p50_us=us,
                gbps=frac * 3000.0, frac_copy=frac, p20_us=us, p80_us=us)


def _rows():
    p = "16384x4096,dim=-1"
    return [_row("softmax", "triton", "triton", p, "bf16", "fwd_nograd", 90.0, 0.95),
            _row("softmax", "cuda", "cuda", p, "bf16", "fwd_nograd", 100.0, 0.86),
            _row("softmax", "compile", "compile", p, "bf16", "fwd_nograd", 150.0, 0.57),
            _row("softmax", "liger", "peer", p, "bf16", "fwd_nograd", 95.0, 0.90),
            _row("softmax", "eager", "eager", p, "bf16", "fwd+bwd", 400.0),
            _row("softmax", "compile", "compile", p, "bf16", "fwd+bwd", 300.0),
            _row("softmax", "triton", "triton", p, "bf16", "fwd+bwd", 290.0)]


def test_render_shows_each_target_with_its_figure_and_verdict():
    rows, spec = _rows(), targets.load_spec(SPEC)
    text = targets.render(pd.DataFrame(rows), spec)
    assert "| softmax | 16384x4096 | bf16 | triton | 95.0 | 57.0 | 90.0 | yes |" in text  # target 1
    assert "| softmax | 16384x4096 | 100.0 | liger 95.0 | 90.0 | 0.950 | 1.00 | NOT met |" in text  # target 2
    assert "| softmax | triton 290.0 | 400.0 | 300.0 | 1.38 | 1.03 | yes |" in text  # target 3
    assert "### 4." not in text  # dispatch and regret are measured by --live: absent without their tables
    # target 1 reads kernel bandwidth: a Triton kernel whose caller time is its launch path still counts
    host_bound = [dict(r, caller_us=200.0) if r["impl"] == "triton" and r["mode"] == "fwd_nograd" else r
                  for r in rows]
    assert "| softmax | 16384x4096 | bf16 | triton | 95.0 |" in targets.render(pd.DataFrame(host_bound), spec)


def test_an_op_not_bound_by_copy_is_named_and_not_judged_against_it():
    lce = "8192x4096,head_bias=False,ignored=0.0,label_smoothing=0.0,reduction=mean,vocab=128256"
    rows = _rows() + [_row("linear_cross_entropy", "triton", "triton", lce, "bf16", "fwd_nograd", 9000.0, 0.02)]
    spec = targets.load_spec(SPEC)
    text = targets.render(pd.DataFrame(rows), spec)
    assert "Not judged here: linear_cross_entropy (" in text and "| linear_cross_entropy |" not in text
    for t in spec["targets"]:
        t.pop("except_ops", None)
    assert "| linear_cross_entropy | 8192x4096 | bf16 | triton | 2.0 |" in targets.render(pd.DataFrame(rows), spec)


def test_the_thresholds_are_the_spec_s():
    spec = targets.load_spec(SPEC)
    for t in spec["targets"]:
        if t["kind"] == "copy_fraction":
            t["at_least"] = 0.96
        if t["kind"] == "training":
            t["vs_compile"] = 1.05
    text = targets.render(pd.DataFrame(_rows()), spec)
    assert ">= 96 % of copy" in text
    assert "| softmax | 16384x4096 | bf16 | triton | 95.0 | 57.0 | 90.0 | NOT met |" in text
    assert ">= 1.05x compile" in text and "| softmax | triton 290.0 | 400.0 | 300.0 | 1.38 | 1.03 | NOT met |" in text


def test_render_regret_and_dispatch():
    grid = pd.DataFrame([_row("gelu", "eager", "eager", "1x7", "bf16", "fwd_nograd", 5.0),
                         _row("gelu", "triton", "triton", "1x7", "bf16", "fwd_nograd", 6.0),
                         _row("gelu", "eager", "eager", "9x9", "bf16", "fwd_nograd", 8.0),
                         _row("gelu", "liger", "peer", "9x9", "bf16", "fwd_nograd", 4.0)])
    picks = pd.DataFrame([dict(op="gelu", problem="1x7", dtype="bf16", selected="triton", reason="r"),
                          dict(op="gelu", problem="9x9", dtype="bf16", selected="eager", reason="r")])
    n, geo, worst = targets.regret_summary(grid, picks)
    assert n == 2 and math.isclose(worst, 2.0) and math.isclose(geo, math.sqrt(1.2 * 2.0))
    assert targets.regret_summary(grid, picks.assign(mode="fwd+bwd"))[0] == 0  # a mode's points only
    disp = pd.DataFrame([dict(op="gelu", problem="1x7", dtype="bf16", impl=i, direct_us=d, public_us=6.0,
                              chosen="eager") for i, d in (("eager", 5.0), ("triton", 20.0))])
    text = targets.render(pd.DataFrame([_row("gelu", "eager", "eager", "1x7", "bf16", "fwd_nograd", 5.0)]),
                          targets.load_spec(SPEC), grid, picks, disp)
    assert "| gelu | 1x7 | bf16 | 6.0 (eager) | 5.0 (eager) | 1.20 | 20.0 | NOT met |" in text
    assert "geomean 1.549 (target <= 1.03)" in text and "NOT met" in text.split("Regret over")[1]
    # with tuning on: both figures, the target's verdict on the tuned one; a pick with no correct timing is counted
    grid = pd.concat([grid, pd.DataFrame([_row("gelu", "triton", "triton", "9x9", "bf16", "fwd_nograd", 4.2)])])
    picks = picks.assign(tuned=["eager", "triton"])
    picks.loc[len(picks)] = dict(op="gelu", problem="5x5", dtype="bf16", selected="eager", reason="r", tuned="cuda")
    assert targets.regret_summary(grid, picks, tuned=True)[:1] == (2,)
    assert math.isclose(targets.regret_summary(grid, picks, tuned=True)[2], 1.05)
    text = targets.render(pd.DataFrame([_row("gelu", "eager", "eager", "1x7", "bf16", "fwd_nograd", 5.0)]),
                          targets.load_spec(SPEC), grid, picks, disp)
    assert "| gelu | 9x9 | bf16 | 8.0 (eager) | 4.2 (triton) | 4.0 (liger) | 2.000 | 1.050 |" in text
    on = text.split("**Regret with tuning on over 2 points (1 of 3 without a correct timing of the pick):")[1]
    assert on.split("\n")[0] == " geomean 1.025 (target <= 1.03), max 1.050 (target <= 1.10): met.**"
    assert "**Regret with tuning off over 2 points (1 of 3 without a correct timing of the pick): geomean 1.549" in text
    assert "(stated, not the target's figure)" in text


def test_regret_reads_each_implementation_s_newest_row_of_a_point():
    """A case's launch-bound rows timed again side by side are stored beside their first timing: the newer counts,
    for the best and for the pick alike (two rows of one implementation once made its own pick a regret of 1.47)."""
    first = [_row("softmax", "eager", "eager", "1x7", "fp16", "fwd_nograd", 8.6),
             _row("softmax", "cuda", "cuda", "1x7", "fp16", "fwd_nograd", 9.0)]
    again = [_row("softmax", "eager", "eager", "1x7", "fp16", "fwd_nograd", 12.6),
             _row("softmax", "cuda", "cuda", "1x7", "fp16", "fwd_nograd", 12.0)]
    grid = pd.DataFrame([dict(r, timestamp=t) for t, rows in ((1.0, first), (2.0, again)) for r in rows])
    picks = pd.DataFrame([dict(op="softmax", problem="1x7", dtype="fp16", selected="eager", reason="r", tuned="cuda")])
    (r,) = targets.regrets(grid, picks)
    assert (r["best"], r["best_us"], r["selected_us"], r["tuned_us"]) == ("cuda", 12.0, 12.6, 12.0)
    assert math.isclose(r["regret"], 12.6 / 12.0) and r["regret_tuned"] == 1.0


def test_the_commands_render_the_targets_only_when_asked(tmp_path, capsys):
    csv = tmp_path / "results.csv"
    pd.DataFrame([dict(r, torch_version="t", triton_version="tr", cuda_version="c", gpu_name="GPU", copy_gbps=3000.0,
                       host_us=r["caller_us"], timestamp=1.0, first_call_s=0.1, rel_error=0.0, reason="",
                       device_key="gpu", source_hash="h")
                  for r in _rows()]).to_csv(csv, index=False)
    assert main(["targets", "--results", str(csv)]) == 2
    assert "needs --spec FILE" in capsys.readouterr().err
    assert main(["targets", "--results", str(csv), "--spec", str(SPEC)]) == 0
    assert "| softmax | triton 290.0 | 400.0 | 300.0 | 1.38 | 1.03 | yes |" in capsys.readouterr().out
    base = ["report", "--results", str(csv), "--command", "x", "--no-csv"]
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    assert "Speed targets" not in (tmp_path / "plain" / "README.md").read_text()
    assert main([*base, "--out", str(tmp_path / "t"), "--targets-spec", str(SPEC)]) == 0
    assert "## Speed targets" in (tmp_path / "t" / "README.md").read_text()
    assert main([*base, "--out", str(tmp_path / "u"), "--targets", str(tmp_path)]) == 2


def test_live_dispatch_times_every_candidate_in_interleaved_rounds(tmp_path, monkeypatch):
    from tiered_ops.sweep import live

    order: list[str] = []
    real = live.host_time_per_call

    def spy(fn, device, budget_s=0.05):
        order.append(getattr(fn, "__name__", ""))
        return real(fn, device, budget_s=0.002)

    monkeypatch.setattr(live, "host_time_per_call", spy)
    df = live.live_dispatch(torch.device("cpu"), str(tmp_path / "store.sqlite"), ["1x64"], ["fp32"], ops=["gelu"],
                            rounds=3)
    impls = list(df.impl)
    assert impls and "eager" in impls and "peer" not in set(df.impl)
    assert len(order) == 3 * (len(impls) + 1)  # the public call and each implementation, once per round
    assert (df.direct_us > 0).all() and df.public_us.nunique() == 1 and (df.rounds == 3).all()
    assert df.chosen.nunique() == 1 and df.chosen.iloc[0] in impls
    # the public call decides first, as a user's first call would: with tuning on, its bucket is tuned and stored
    assert Store(str(tmp_path / "store.sqlite")).rows(op="gelu")
