"""tiered-ops report from a small results file produced by a real CPU bench run: Markdown, CSV and plots."""

from pathlib import Path

import pandas as pd
import pytest

from tiered_ops.analysis.analysis import latest, winners
from tiered_ops.analysis.check import removed
from tiered_ops.cli.cli import main
from tiered_ops.store.store import COLUMN_NAMES

ROOT = Path(__file__).resolve().parent.parent


def test_report_from_a_real_cpu_bench(private_store, tmp_path, capsys):
    assert main(["--db", str(private_store), "bench", "--ops", "muladd", "--impls", "eager,eager_addcmul",
                 "--shapes", "64x64", "300x7", "--modes", "fwd_nograd,fwd+bwd", "--no-progress", "--in-process"]) == 0
    csv, meta = tmp_path / "results.csv", tmp_path / "meta.jsonl"
    assert main(["--db", str(private_store), "export", "--csv", str(csv), "--meta", str(meta)]) == 0
    out = tmp_path / "report"
    assert main(["report", "--results", str(csv), "--meta", str(meta), "--out", str(out),
                 "--command", "tiered-ops bench --ops muladd ..."]) == 0
    text = (out / "README.md").read_text()
    cases = (out / "cases.md").read_text()
    df = pd.read_csv(out / "results.csv")
    assert list(df.columns) == ["id", *COLUMN_NAMES] and len(df) == 8  # 2 shapes x 2 modes x 2 impls
    w = winners(df)
    assert len(w) == 4
    for r in w.itertuples():  # every winner in the Markdown, with its margin (or tie) and time from the CSV
        margin = "tie" if r.tie else f"{r.margin:.2f}x"
        assert f"| {r.problem} | fp32 | {r.mode} | **{r.winner}** | {r.caller_us:.1f} | {margin} |" in cases
        assert r.p20 <= r.caller_us <= r.p80 and r.runner_p20 <= r.runner_p80  # and both spreads beside it
        assert f"| {r.runner_up} | {r.p20:.1f}-{r.p80:.1f} / {r.runner_p20:.1f}-{r.runner_p80:.1f} |" in cases
    assert "| eager_addcmul | " in (out / "measurements.md").read_text()  # 8 measurements: a small page
    assert "Measured by: `tiered-ops bench --ops muladd ...`" in text and "torch " in text
    assert "Rendered by: `tiered-ops report --results" in text
    for png in ("muladd-gbps.png", "winners.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again"
    assert main(["report", "--results", str(csv), "--repeat", str(csv), "--out", str(again), "--command", "x"]) == 0
    assert "**Repeatability:** a second sweep on the same GPU picks the same winner in" in \
        (again / "README.md").read_text()


def _run(times: dict[str, dict[str, float]], spread: float = 0.02) -> pd.DataFrame:
    rows = []
    for problem, per_impl in times.items():
        for impl, us in per_impl.items():
            rows.append(dict(op="muladd", impl=impl, tier="eager" if impl.startswith("eager") else impl,
                             mode="fwd_nograd", problem=problem, dtype="bf16", ok=1, caller_us=us, p50_us=us,
                             p20_us=us * (1 - spread / 2), p80_us=us * (1 + spread / 2)))
    return pd.DataFrame(rows)


def test_agreement_between_two_sweeps_skips_ties():
    from tiered_ops.analysis.report import agreement

    first = _run({"a": {"eager": 100, "triton": 50}, "b": {"eager": 100, "triton": 80}, "c": {"eager": 100,
                                                                                              "triton": 100.5}})
    second = _run({"a": {"eager": 100, "triton": 52}, "b": {"eager": 70, "triton": 80}, "c": {"eager": 99,
                                                                                              "triton": 100}})
    agree, total, differ = agreement(first, second)
    assert (agree, total) == (1, 2)  # "c" is a tie in the first run: not counted either way
    assert len(differ) == 1 and differ[0].startswith("muladd b bf16 fwd_nograd: triton (1.25x) then eager")


def test_agreement_skips_cases_a_cut_second_sweep_left_half_measured():
    """A second sweep stopped by its time limit has cases where only some implementations were timed: its
    'winner' there is no decision (on an H200, eager alone against the first run's cuda) and is not compared."""
    from tiered_ops.analysis.report import agreement

    first = _run({"a": {"eager": 100, "triton": 50}, "b": {"eager": 100, "cuda": 50}})
    second = _run({"a": {"eager": 100, "triton": 50}, "b": {"eager": 100}})
    assert agreement(first, second)[:2] == (1, 1)
    assert agreement(first, _run({"a": {"eager": 100, "triton": 50}, "b": {"eager": 100, "cuda": 150}}))[:2] == (1, 2)


def test_compare_writes_the_cross_gpu_view_from_two_results_files(tmp_path):
    base = dict(op="muladd", problem="64x64", dtype="fp32", mode="fwd_nograd", ok=1, p20_us=None, p50_us=None,
                p80_us=None, torch_version="t", triton_version="tr", copy_gbps=1000.0, source_hash="h", timestamp=1.0)
    for gpu, fast, speed in (("gpu-a", "eager", 1.0), ("gpu-b", "compile", 2.0)):
        (tmp_path / gpu).mkdir()
        pd.DataFrame([dict(base, impl=i, tier=i, gpu_name=gpu.upper(), device_key=gpu,
                           caller_us=(1.0 if i == fast else 3.0) / speed)
                      for i in ("eager", "compile")]).to_csv(tmp_path / gpu / "results.csv", index=False)
    out = tmp_path / "README.md"
    assert main(["compare", "--results", str(tmp_path / "gpu-a" / "results.csv"),
                 str(tmp_path / "gpu-b" / "results.csv"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| muladd | 64x64 | fp32 | fwd_nograd | eager 1.0 | compile 0.5 | **differs** | 2.00 |" in text
    assert "the winner is the same in 0 and differs in 1" in text and "Rendered by: `tiered-ops compare" in text
    assert main(["compare", "--results", str(tmp_path / "gpu-a" / "results.csv"), "--out", str(out)]) == 2


def test_a_host_bound_margin_inside_the_host_spread_is_a_tie():
    """Where the launch path sets a caller's time, the host batches' p20-p80 is the noise a margin must clear: a
    1.18x margin between two host-bound calls whose host spreads overlap is a tie (on an H100 such a pair flipped
    between two sweeps), one whose spreads do not overlap is a winner; a GPU-bound pair is judged by the kernel's
    spread alone, and rows without host spread (results before schema 3) by the kernel spread scaled."""
    from tiered_ops.store.rows import caller_range

    def row(impl, p50, host, host_p80, spread=0.02):
        return dict(op="muladd", impl=impl, tier="eager", mode="fwd+bwd", problem="32x4096", dtype="fp32", ok=1,
                    p20_us=p50 * (1 - spread / 2), p50_us=p50, p80_us=p50 * (1 + spread / 2), host_us=host,
                    host_p20_us=host, host_p80_us=host_p80, caller_us=max(p50, host))

    noisy = pd.DataFrame([row("eager", 15, 132, 150), row("eager_addcmul", 16, 112, 140)])
    w = winners(noisy).iloc[0]
    assert w.winner == "eager_addcmul" and w.margin == pytest.approx(132 / 112) and w.tie
    clear = pd.DataFrame([row("eager", 15, 132, 136), row("eager_addcmul", 16, 112, 118)])
    assert not winners(clear).iloc[0].tie
    gpu_bound = pd.DataFrame([row("eager", 318, 150, 400), row("eager_addcmul", 390, 160, 420)])
    assert caller_range(gpu_bound.iloc[0]) == (318 * 0.99, 400)  # the host's p80 still bounds it from above
    assert not winners(gpu_bound.assign(host_p80_us=[200, 210])).iloc[0].tie
    legacy = noisy.drop(columns=["host_p20_us", "host_p80_us"])
    assert caller_range(legacy.iloc[0]) == pytest.approx((132 * 0.99, 132 * 1.01))
    assert not winners(legacy).iloc[0].tie


def test_the_report_shows_peak_memory_where_the_results_carry_it(tmp_path):
    """GPU rows carry the bytes one call allocates above its inputs: the report shows them in MiB; results without
    them (CPU rows, older files) render as before, with no such column."""
    last_h100 = ROOT / "tests/data/h100-dab8732-results.csv"  # real GPU rows, whatever tree they measured
    df = pd.read_csv(last_h100)
    assert df.peak_bytes.notna().all()
    out = tmp_path / "with"
    assert main(["report", "--results", str(last_h100), "--out", str(out),
                 "--command", "x", "--no-csv"]) == 0
    text = (out / "measurements.md").read_text()  # 240 measurements: still a small page
    assert "| rel err | peak MiB | breaks |" in text
    r = df[(df.op == "softmax") & (df.impl == "eager") & (df.dtype == "bf16") & (df["mode"] == "fwd_nograd")
           & df.problem.str.startswith("16384x4096")].iloc[0]
    assert f"| {r.peak_bytes / 2**20:.3g} | - |" in text  # 16384x4096 bf16 out: 128 MiB
    csv = tmp_path / "no_peak.csv"
    df.drop(columns=["peak_bytes"]).to_csv(csv, index=False)
    assert main(["report", "--results", str(csv), "--out", str(tmp_path / "without"), "--command", "x"]) == 0
    assert "peak MiB" not in (tmp_path / "without" / "measurements.md").read_text()


def test_a_runner_up_timed_but_never_gated_is_shown_as_such(tmp_path):
    """Under the sweep's lazy gates a compiled tier that no choice would take is timed but never gated: it is still
    the runner-up when it is faster than the next correct row (so the margin is not measured against eager), marked
    (not gated) or (pruned); it never wins, and a failed row is never a runner-up."""
    def row(impl, tier, us, ok=1, reason=""):
        return dict(op="muladd", impl=impl, tier=tier, mode="fwd_nograd", problem="64x64", dtype="fp32", ok=ok,
                    reason=reason, p20_us=us * 0.99, p50_us=us, p80_us=us * 1.01, host_us=1.0, host_p20_us=1.0,
                    host_p80_us=1.0, caller_us=us)

    df = pd.DataFrame([row("cuda", "cuda", 10.0), row("eager", "eager", 40.0),
                       row("triton", "triton", 5.0, 0, "not gated: timed; its gate runs only where it would be chosen"),
                       row("compile", "compile", 6.0, 0, "wrong output: rel error 1.0")])
    assert winners(df).iloc[0].winner == "cuda"  # an ungated row never wins, however fast
    df = df.assign(caller_us=[10.0, 40.0, 15.0, 6.0], p50_us=[10.0, 40.0, 15.0, 6.0])
    w = winners(df).iloc[0]
    assert (w.winner, w.runner_up, w.runner_unchecked, w.margin) == ("cuda", "triton", "not gated", 1.5)
    pruned = df.assign(reason=["", "", "pruned: a short timing's caller p20 is above the bar", "wrong output"])
    assert winners(pruned).iloc[0].runner_unchecked == "pruned"
    gated = df.assign(ok=[1, 1, 1, 0])
    assert winners(gated).iloc[0].runner_unchecked is None


def test_a_resumed_store_reports_each_case_from_its_newest_rows(tmp_path):
    """A sweep resumed after a kernel changed exports the stale rows beside the fresh ones: the report's figures and
    plots read each case's newest row per implementation (two rows of one case used to break the plots)."""
    df = pd.read_csv(ROOT / "tests/data/h100-dab8732-results.csv")  # real GPU rows, one per case and impl
    assert len(latest(df)) == len(df)
    w = winners(df)
    case = w[~w.tie].iloc[0]
    old = df[(df.op == case["op"]) & (df.problem == case["problem"]) & (df.dtype == case["dtype"])
             & (df["mode"] == case["mode"]) & (df.impl == case["winner"])]
    slower = old.assign(timestamp=old.timestamp + 1, gbps=old.gbps / 100,
                        **{c: old[c] * 100 for c in ("caller_us", "p20_us", "p50_us", "p80_us")})
    resumed = pd.concat([df, slower], ignore_index=True)
    assert winners(latest(resumed)).set_index(["op", "problem", "dtype", "mode"]).loc[
        (case["op"], case["problem"], case["dtype"], case["mode"])].winner != case["winner"]
    csv = tmp_path / "resumed.csv"
    resumed.to_csv(csv, index=False)
    out = tmp_path / "report"
    assert main(["report", "--results", str(csv), "--out", str(out), "--command", "x", "--no-csv"]) == 0
    kept = len(df[~removed(df)])  # less a removed kernel's rows (muladd cuda): out of the figures
    assert (f"; {len(resumed)} measurements in the results, of which the {kept} newest of each case and "
            "implementation make the figures below;") in (out / "README.md").read_text()
    assert (out / f"{case['op']}-gbps.png").stat().st_size > 0


def _case(op, problem, dtype, mode, impl, us, gbps=None, spread=0.02):
    tier = impl.split("_")[0]
    return dict(op=op, impl=impl, tier=tier, mode=mode, problem=problem, dtype=dtype, ok=1, caller_us=us, p50_us=us,
                p20_us=us * (1 - spread / 2), p80_us=us * (1 + spread / 2), gbps=gbps,
                copy_gbps=1000.0, frac_copy=None if gbps is None else gbps / 1000.0, gpu_name="GPU X",
                torch_version="t", triton_version="tr", cuda_version="c", device_key="x", source_hash="h",
                timestamp=1.0, first_call_s=0.1, host_us=1.0, host_p20_us=1.0, host_p80_us=1.0, reason="",
                rel_error=0.0, context="eager")


def test_the_summary_opens_the_report_with_the_picture_and_the_winners_per_op(tmp_path):
    """The README opens with the picture, then per op the cases each tier wins, the ties, and the winners' fraction
    of the copy bandwidth over the cases moving at least 64 MiB (the lowest named); the tables go to cases.md."""
    big, mib = "16384x4096", 128 << 20  # 128 MiB moved: gbps * us * 1e3 bytes
    rows = [_case("gelu", big, "bf16", "fwd_nograd", "eager", 200.0, mib / 200e3),
            _case("gelu", big, "bf16", "fwd_nograd", "triton", 160.0, mib / 160e3),   # triton 1.25x
            _case("gelu", big, "fp32", "fwd_nograd", "eager", 400.0, mib / 400e3),
            _case("gelu", big, "fp32", "fwd_nograd", "cuda", 200.0, mib / 200e3),     # cuda 2x
            _case("gelu", "1x4096", "bf16", "fwd_nograd", "eager", 5.0, 1.0),        # launch-bound: no % of copy
            _case("gelu", "1x4096", "bf16", "fwd_nograd", "compile", 5.01, 1.0),     # a tie
            _case("softmax", big, "bf16", "fwd+bwd", "compile", 100.0, mib / 100e3),
            _case("softmax", big, "bf16", "fwd+bwd", "eager", 300.0, mib / 300e3)]
    csv = tmp_path / "results.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    out = tmp_path / "report"
    assert main(["report", "--results", str(csv), "--out", str(out), "--command", "x", "--no-csv"]) == 0
    text = (out / "README.md").read_text()
    lines = text.splitlines()
    picture = lines.index("![winning tier per case](winners.png)")
    assert picture < 10 and not any(x.startswith("|") for x in lines[:picture])  # the picture before any table
    w = winners(pd.DataFrame(rows))
    assert set(zip(w.op, w.problem, w.dtype, w.winner, w.tie)) == {
        ("gelu", big, "bf16", "triton", False), ("gelu", big, "fp32", "cuda", False),
        ("gelu", "1x4096", "bf16", "eager", True), ("softmax", big, "bf16", "compile", False)}
    gelu = next(x for x in lines if x.startswith("| [gelu](cases.md#gelu) |"))
    cells = [c.strip() for c in gelu.split("|")[1:-1]]
    # cases, eager, compile, triton, cuda, ties, % of copy fwd_nograd, % of copy fwd+bwd, territories
    assert cells[1:7] == ["3", "1", "0", "1", "1", "1"]
    fp32 = 100 * mib / 200e3 / 1000  # the winners' own fractions: cuda's at fp32, triton's at bf16
    bf16 = 100 * mib / 160e3 / 1000
    assert cells[7] == (f"{(fp32 + bf16) / 2:.0f} % (lowest {min(fp32, bf16):.0f} %: "
                        f"{'cuda' if fp32 < bf16 else 'triton'} {big} {'fp32' if fp32 < bf16 else 'bf16'}; 2 cases)")
    assert cells[8] == "-"  # gelu has no fwd+bwd case
    softmax = next(x for x in lines if x.startswith("| [softmax](cases.md#softmax) |"))
    assert [c.strip() for c in softmax.split("|")[1:-1]][1:7] == ["1", "0", "1", "0", "0", "0"]
    assert "| 16384x4096 | bf16 | fwd_nograd | **triton** | 160.0 | 1.25x | eager |" in (out / "cases.md").read_text()
    assert "![winning tier per case]" not in (out / "cases.md").read_text()
    assert (out / "winners.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_op_the_copy_target_leaves_out_has_no_copy_fraction_in_the_summary(tmp_path):
    """An op the speed targets' copy fraction leaves out (its limit is not the copy bandwidth: the fused loss's
    matmuls) shows no copy fraction in the summary, and the line under the table says why; the others keep theirs."""
    import json

    big, mib = "16384x4096", 128 << 20
    rows = [_case("gelu", big, "bf16", "fwd_nograd", "eager", 200.0, mib / 200e3),
            _case("gelu", big, "bf16", "fwd_nograd", "triton", 160.0, mib / 160e3),
            _case("linear_cross_entropy", "8192x4096,vocab=128256", "bf16", "fwd_nograd", "eager", 9000.0, mib / 9e6),
            _case("linear_cross_entropy", "8192x4096,vocab=128256", "bf16", "fwd_nograd", "triton", 7000.0, mib / 7e6)]
    csv, spec = tmp_path / "results.csv", tmp_path / "targets.json"
    pd.DataFrame(rows).to_csv(csv, index=False)
    spec.write_text(json.dumps({"title": "Speed targets", "targets": [
        {"kind": "copy_fraction", "mode": "fwd_nograd", "min_bytes": 1 << 26, "ours": ["triton", "cuda"],
         "compare": ["compile"], "at_least": 0.9, "except_ops": ["linear_cross_entropy"],
         "except_why": "matmul-bound"}]}))
    out = tmp_path / "report"
    assert main(["report", "--results", str(csv), "--out", str(out), "--command", "x", "--no-csv",
                 "--targets-spec", str(spec)]) == 0
    lines = (out / "README.md").read_text().splitlines()
    cells = {x.split("|")[1].strip(): [c.strip() for c in x.split("|")[1:-1]] for x in lines
             if x.startswith("| [")}
    assert cells["[linear_cross_entropy](cases.md#linear_cross_entropy)"][7] == "not copy-bound (Speed targets)"
    assert cells["[gelu](cases.md#gelu)"][7].endswith("1 case)")
    assert "No copy fraction for linear_cross_entropy: matmul-bound." in lines
    # without the spec, the report prints what it measured for every op
    assert main(["report", "--results", str(csv), "--out", str(out), "--command", "x", "--no-csv"]) == 0
    assert "not copy-bound" not in (out / "README.md").read_text()


README_MAX = 40_000
COMMITTED_READMES = sorted(ROOT.glob("reports/*/README.md"))


@pytest.mark.parametrize("readme", COMMITTED_READMES, ids=[p.parent.name for p in COMMITTED_READMES])
def test_each_committed_gpu_report_is_short_and_opens_with_the_summary(readme):
    """A person reads each GPU's README: at most 40 KB, the summary picture within its first lines, and every op of
    its results.csv in the summary table."""
    text = readme.read_text()
    assert len(text.encode()) <= README_MAX
    head = text.splitlines()[:12]
    assert "![winning tier per case](winners.png)" in head and (readme.parent / "winners.png").is_file()
    ops = set(pd.read_csv(readme.parent / "results.csv", usecols=["op"]).op)
    assert all(f"| [{op}](cases.md#{op}) |" in text for op in ops)
    assert (readme.parent / "cases.md").is_file()


def test_the_picture_outlines_a_cuda_winner_inside_a_territory_it_holds():
    from tiered_ops.analysis.summary import in_territory

    rows = [_case("softmax", "512x393216,dim=-1", "bf16", "fwd_nograd", "cuda", 100.0),  # softmax.giant-rows
            _case("softmax", "512x393216,dim=-1", "bf16", "fwd_nograd", "triton", 140.0),
            _case("softmax", "32x4096,dim=-1", "bf16", "fwd_nograd", "cuda", 5.0),  # small rows: given up
            _case("softmax", "32x4096,dim=-1", "bf16", "fwd_nograd", "triton", 6.0),
            _case("softmax", "512x393216,dim=-1", "fp32", "fwd_nograd", "triton", 90.0),  # inside, not won by cuda
            _case("softmax", "512x393216,dim=-1", "fp32", "fwd_nograd", "cuda", 95.0)]
    w = winners(pd.DataFrame(rows))
    assert dict(zip(w.problem + " " + w.dtype, in_territory(w))) == {
        "512x393216,dim=-1 bf16": True, "32x4096,dim=-1 bf16": False, "512x393216,dim=-1 fp32": False}


def test_a_removed_kernels_rows_stay_in_the_csv_and_out_of_the_figures(tmp_path):
    """muladd's CUDA kernel was deleted; a results file from before keeps its rows. The report's figures (winners,
    tables) must not crown a kernel the tree no longer has, and the README says what it left out."""
    big, mib = "16384x4096", 128 << 20
    rows = [_case("muladd", big, "bf16", "fwd_nograd", impl, us, mib / (us * 1e3))
            for impl, us in (("eager", 200.0), ("cuda", 100.0), ("triton", 160.0))]
    csv = tmp_path / "results.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    out = tmp_path / "report"
    assert main(["report", "--results", str(csv), "--out", str(out), "--command", "x"]) == 0
    readme = (out / "README.md").read_text()
    assert "Left out of the figures: the rows of muladd cuda" in readme
    assert len(pd.read_csv(out / "results.csv")) == 3  # the CSV keeps every row
    line = next(x for x in readme.splitlines() if x.startswith("| [muladd](cases.md#muladd) |"))
    assert [c.strip() for c in line.split("|")[1:-1]][1:6] == ["1", "0", "0", "1", "0"]  # Triton wins, no CUDA
