"""The speed targets: the grid selection and regret on the CPU (a real sweep of two grid points), the render of
every target from crafted results (met and NOT met), and the dispatch measurement's shape."""

import math

import pandas as pd
import torch

from tiered_ops import targets
from tiered_ops.bench import sweep
from tiered_ops.catalog import get_op
from tiered_ops.store import Store

CPU = torch.device("cpu")


def test_grid_has_30_points_spanning_rows_columns_and_dtypes():
    assert len(targets.GRID) >= 30
    rows = [s[0] for _, s, _ in targets.GRID]
    cols = [s[-1] for _, s, _ in targets.GRID]
    assert min(rows) == 1 and max(rows) == 65536 and min(cols) == 7 and max(cols) == 400000
    assert {d for *_, d in targets.GRID} == {"fp32", "bf16", "fp16"}
    defaults = {str(p) for op in {o for o, *_ in targets.GRID} for p in get_op(op).default_problems("cuda")}
    assert not any(str(targets.grid_problem(o, s)) in defaults for o, s, _ in targets.GRID)  # never tuned on


def test_live_grid_selects_from_the_nearest_bucket_and_regret_is_measured(tmp_path, monkeypatch):
    main = tmp_path / "main.sqlite"
    spec = get_op("muladd")
    store = Store(main)
    sweep([spec], {"muladd": [spec.problem((64, 64))]}, [torch.float32], CPU, store, progress=False,
          log=lambda s: None, modes=["fwd_nograd"], impls=["eager", "eager_addcmul"])
    store.close()
    monkeypatch.setattr(targets, "GRID", [("muladd", (50, 100), "fp32"), ("muladd", (3, 5), "bf16")])
    picks = targets.live_grid(CPU, str(main), str(tmp_path / "grid.sqlite"), log=lambda s: None, isolate=False)
    assert "nearest measured bucket" in picks.reason[0]  # fp32 was measured, bf16 (no fp16 either) was not
    assert picks.selected[1] == "eager" and "no stored decision" in picks.reason[1]
    gstore = Store(tmp_path / "grid.sqlite")
    grid = pd.DataFrame(gstore.rows())
    assert {"eager", "eager_addcmul"} <= set(grid.impl)
    # one sweep over both points, each in its own dtype, and no cost metadata (the grid needs timings only)
    assert set(zip(grid.problem, grid.dtype)) == {("50x100", "fp32"), ("3x5", "bf16")}
    r = grid.iloc[0]
    assert gstore.get_meta("muladd", r.impl, r.device_key, r.source_hash) is None
    gstore.close()
    n, geo, worst = targets.regret_summary(grid, picks)
    assert n == 2 and 1.0 <= geo <= worst  # the selected one is never faster than the best measured


def _row(op, impl, tier, problem, dtype, mode, us, frac=0.5):
    return dict(op=op, impl=impl, tier=tier, problem=problem, dtype=dtype, mode=mode, ok=1, caller_us=us, p50_us=us,
                gbps=frac * 3000.0, frac_copy=frac, p20_us=us, p80_us=us)


def test_render_shows_each_target_with_its_figure_and_verdict():
    p = "16384x4096,dim=-1"
    rows = [_row("softmax", "triton", "triton", p, "bf16", "fwd_nograd", 90.0, 0.95),
            _row("softmax", "cuda", "cuda", p, "bf16", "fwd_nograd", 100.0, 0.86),
            _row("softmax", "compile", "compile", p, "bf16", "fwd_nograd", 150.0, 0.57),
            _row("softmax", "liger", "peer", p, "bf16", "fwd_nograd", 95.0, 0.90),
            _row("softmax", "eager", "eager", p, "bf16", "fwd+bwd", 400.0),
            _row("softmax", "compile", "compile", p, "bf16", "fwd+bwd", 300.0),
            _row("softmax", "triton", "triton", p, "bf16", "fwd+bwd", 290.0)]
    text = targets.render(pd.DataFrame(rows))
    assert "| softmax | 16384x4096 | bf16 | triton | 95.0 | 57.0 | 90.0 | yes |" in text  # target 1
    assert "| softmax | 16384x4096 | 100.0 | liger 95.0 | 90.0 | 0.950 | 1.00 | NOT met |" in text  # target 2
    assert "| softmax | triton 290.0 | 400.0 | 300.0 | 1.38 | 1.03 | yes |" in text  # target 3
    # target 1 reads kernel bandwidth: a Triton kernel whose caller time is its launch path still counts
    host_bound = [dict(r, caller_us=200.0) if r["impl"] == "triton" and r["mode"] == "fwd_nograd" else r
                  for r in rows]
    assert "| softmax | 16384x4096 | bf16 | triton | 95.0 |" in targets.render(pd.DataFrame(host_bound))


def test_render_regret_and_dispatch():
    grid = pd.DataFrame([_row("gelu", "eager", "eager", "1x7", "bf16", "fwd_nograd", 5.0),
                         _row("gelu", "triton", "triton", "1x7", "bf16", "fwd_nograd", 6.0),
                         _row("gelu", "eager", "eager", "9x9", "bf16", "fwd_nograd", 8.0),
                         _row("gelu", "liger", "peer", "9x9", "bf16", "fwd_nograd", 4.0)])
    picks = pd.DataFrame([dict(op="gelu", problem="1x7", dtype="bf16", selected="triton", reason="r"),
                          dict(op="gelu", problem="9x9", dtype="bf16", selected="eager", reason="r")])
    n, geo, worst = targets.regret_summary(grid, picks)
    assert n == 2 and math.isclose(worst, 2.0) and math.isclose(geo, math.sqrt(1.2 * 2.0))
    disp = pd.DataFrame([dict(op="gelu", problem="1x7", dtype="bf16", impl=i, direct_us=d, public_us=6.0,
                              chosen="eager") for i, d in (("eager", 5.0), ("triton", 20.0))])
    text = targets.render(pd.DataFrame([_row("gelu", "eager", "eager", "1x7", "bf16", "fwd_nograd", 5.0)]),
                          grid, picks, disp)
    assert "| gelu | 1x7 | bf16 | 6.0 (eager) | 5.0 (eager) | 1.20 | 20.0 | NOT met |" in text
    assert "geomean 1.549" in text and "NOT met" in text.split("Regret over")[1]
