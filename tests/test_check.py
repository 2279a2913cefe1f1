"""tiered-ops check on crafted results: a CUDA kernel holds a territory only when it beats the best compiler tier there
by its margin beyond the noise; no CUDA result inside a held territory, a loss, a tie and stale evidence fail; a
retired territory is reported, not failed; the report ends with one summary line. Then the committed evidence, the
territory table's own rules and the docs/territories.md section generated from it."""

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from tiered_ops.analysis import gpus
from tiered_ops.analysis import territories as terr
from tiered_ops.analysis.check import cases, check, live_plan, report
from tiered_ops.analysis.territories import Territory, rows_and_len
from tiered_ops.cli.cli import main
from tiered_ops.tiers.catalog import all_ops, get_op

ROOT = Path(__file__).resolve().parent.parent
SPEC = get_op("softmax")
SMALL = Territory("softmax.small", "softmax", "cuda", (1, 32), (4096, 4096), ("bf16",), ("fwd_nograd",),
                  ("eager", "graphed"))
BIG = Territory("softmax.big", "softmax", "cuda", (1024, None), (1, None), ("bf16",), ("fwd_nograd",))
# the kernels without a territory follow where there are any: "; 4 kernels stay without one (picked 3, remove 1)",
# and the kernels removed from the catalog: "; 1 kernels removed, their rows ignored (muladd cuda)"
SUMMARY = re.compile(r"^cuda: (\d+) kernels defend (\d+) cases in (\d+) territories; (\d+) territories retired"
                     r"(?:; \d+ kernels [a-z, ]+(?: \([a-z_\d, ]+\))?)*$")


def _row(problem, impl, us, spread=0.02, host=None, host_spread=0.0, device="gpu", context=None, **kw):
    i = SPEC.impls[impl]
    host = us / 4 if host is None else host  # GPU-bound unless told: the host path hides under the kernel
    r = dict(op="softmax", impl=impl, tier=i.tier.label, mode="fwd_nograd", problem=problem, dtype="bf16",
             device_key=device, ok=1, p20_us=us * (1 - spread / 2), p50_us=us, p80_us=us * (1 + spread / 2),
             host_us=host, host_p20_us=host * (1 + host_spread / 4), host_p80_us=host * (1 + 5 * host_spread / 4),
             caller_us=max(us, host), timestamp=1.0, source_hash=i.source_hash, reason=None)
    if context is not None:
        r["context"] = context
    return {**r, **kw}


def _case(problem, cuda_us, compile_us=150.0, triton_us=150.0, **kw):
    return [_row(problem, "eager", 200.0, **kw), _row(problem, "compile", compile_us, **kw),
            _row(problem, "triton", triton_us, **kw), _row(problem, "cuda", cuda_us, **kw)]


def _frame(cuda_us=100.0, problems=("1x4096,dim=-1", "32x4096,dim=-1"), **kw):
    return pd.DataFrame([r for p in problems for r in _case(p, cuda_us, **kw)])


def _run(df, territories=(SMALL,), retired=None, kernels=()):
    return check(df, [SPEC], list(territories), retired or {}, list(kernels))


def _only(findings, kind=None, territory=None, kernel=False):
    """The one finding of softmax's CUDA kernel of that kind or territory; ``kernel``: the kernel's own statement."""
    fs = [f for f in findings if f.impl == "cuda" and f.kernel == kernel
          and (territory is None or f.territory == territory) and (kind is None or f.kind == kind)]
    assert len(fs) == 1, [(f.kind, f.territory) for f in findings]
    return fs[0]


# --------------------------------------------------------------------------------------------- rows and length
@pytest.mark.parametrize("op, problem", [
    ("softmax", "8x4096x3,dim=-2"), ("softmax", "32x4096,dim=-1"),
    ("layer_norm", "16x64x256x256,bias=True,normalized_shape=(64, 256, 256),weight=True"),
    ("rms_norm", "65536x256,normalized_shape=(256,),weight=True"),
    ("gelu", "7x9x300,approximate=none,bias=True"), ("muladd", "16384x4096,operands=16384x4096,4096,4096")])
def test_rows_times_row_length_is_the_problem_and_the_row_is_the_reduced_dim(op, problem):
    rows, n = rows_and_len(op, problem)
    shape = [int(d) for d in problem.split(",")[0].split("x")]
    assert rows * n == math.prod(shape)
    spec = get_op(op)
    p = next((q for q in spec.default_problems("cuda") if str(q) == problem), None)
    if p is not None:  # a Problem gives what its string gives
        assert rows_and_len(op, p) == (rows, n)
    expected = {"softmax": shape[int(problem.split("dim=")[1])] if "dim=" in problem else shape[-1],
                "layer_norm": 64 * 256 * 256, "rms_norm": 256}.get(op, shape[-1])
    assert n == expected


def test_rows_and_len_of_a_problem_object_and_bad_input():
    assert rows_and_len("softmax", SPEC.problem((6, 10, 4), dim=1)) == (24, 10)
    with pytest.raises(ValueError, match="does not start with a shape"):
        rows_and_len("softmax", "dim=-1")
    with pytest.raises(ValueError, match="not the trailing dims"):
        rows_and_len("rms_norm", "8x16,normalized_shape=(4,)")
    with pytest.raises(ValueError, match="expected a Problem"):
        rows_and_len("gelu", 42)


# ---------------------------------------------------------------------------------------------------- verdicts
def test_a_kernel_that_beats_the_compiler_tiers_by_margin_and_noise_defends_its_territory():
    findings = _run(_frame(cuda_us=100.0))  # 1.5x the compiler tiers; the bar is 1 + 10 % + 2 %
    f = _only(findings, territory="softmax.small")
    assert f.kind == "defends" and not f.fails and (f.cases, f.won) == (2, 2)
    assert "wins all 2 cases" in f.text and "1.50x against a bar of 1.12x" in f.text
    assert report(findings).splitlines()[-1] == "cuda: 1 kernels defend 2 cases in 1 territories; 0 territories retired"


def test_eager_is_no_competitor_but_the_best_compiler_tier_is():
    f = _only(_run(_frame(cuda_us=100.0, compile_us=300.0, triton_us=120.0)), territory="softmax.small")
    assert f.kind == "defends" and "1.20x against a bar of 1.12x" in f.text  # Triton's 120 us, not eager's 200


def test_a_compiler_tier_timed_but_never_gated_is_still_a_rival_and_a_failed_one_is_not():
    """A sweep gates a compiled tier only where a choice would take it: a Triton row it timed and passed over (not
    gated, never chosen) or pruned without its gate still sets the bar; one that failed its gate does not."""
    never = "not gated: timed; cuda, correct, is chosen over it: its gate never ran (never chosen)"
    df = _frame(cuda_us=100.0, compile_us=300.0, triton_us=105.0)
    df.loc[df.impl == "triton", ["ok", "reason"]] = [0, never]
    f = _only(_run(df), territory="softmax.small")
    assert f.fails and f.kind != "defends", f.text  # 1.05x against Triton's timing: below the bar
    df.loc[df.impl == "triton", "reason"] = "pruned: a short timing's caller p20 ... ; not gated either (never chosen)"
    assert _only(_run(df), territory="softmax.small").fails
    df.loc[df.impl == "triton", "reason"] = "wrong output at 1x4096 seed 1: rel error 5e-01 > bound 1e-02"
    f = _only(_run(df), territory="softmax.small")
    assert f.kind == "defends" and "3.00x against a bar of 1.12x" in f.text  # compile's 300 us is the rival left


def test_a_launch_bound_comparison_across_runs_says_how_far_apart_its_rows_are():
    """``cases`` names the hours between the kernel's row and its rival's where one is launch-sensitive and they
    come from runs over an hour apart (a resumed sweep re-times only a changed implementation): such a ratio
    compares two hosts' states as much as the implementations."""
    hour = 3600.0
    launch = [_row("1x4096,dim=-1", "eager", 10.0, host=30.0), _row("1x4096,dim=-1", "triton", 8.0, host=40.0),
              _row("1x4096,dim=-1", "cuda", 6.0, host=20.0, timestamp=1.0 + 84 * hour)]
    (c,) = cases(pd.DataFrame(launch), [SPEC]).itertuples()
    assert c.best_impl == "triton" and c.apart_h == pytest.approx(84.0)
    same_run = [dict(r, timestamp=1.0 + 0.5 * hour) if r["impl"] == "cuda" else r for r in launch]
    assert cases(pd.DataFrame(same_run), [SPEC]).apart_h.isna().all()
    # kernel-bound rows compare across runs: the GPU's time does not follow the host's
    kernel = [_row("1x4096,dim=-1", "triton", 80.0, host=20.0),
              _row("1x4096,dim=-1", "cuda", 60.0, host=20.0, timestamp=1.0 + 84 * hour)]
    assert cases(pd.DataFrame(kernel), [SPEC]).apart_h.isna().all()


def test_no_cuda_rows_for_a_held_territory_fail():
    df = _frame()
    f = _only(_run(df[df.impl != "cuda"]), territory="softmax.small")
    assert f.kind == "no-evidence" and f.fails and "no fresh CUDA result inside it on gpu" in f.text
    # CUDA rows elsewhere do not count: a results file whose CUDA rows all lie outside the territory fails too
    outside = _frame(problems=("4096x4096,dim=-1",))
    assert _only(_run(outside), territory="softmax.small").kind == "no-evidence"


def test_cuda_rows_that_all_failed_their_gate_fail():
    df = _frame()
    df.loc[df.impl == "cuda", ["ok", "reason"]] = [0, "wrong output at 1x7: rel error 3e-01"]
    f = _only(_run(df), territory="softmax.small")
    assert f.kind == "broken" and f.fails and f.text.count("the CUDA row failed (wrong output at 1x7") == 2


def test_losing_inside_the_territory_by_more_than_the_noise_fails():
    findings = _run(_frame(cuda_us=140.0))  # 150 / 140 = 1.07x: short of 1.10 by more than the 2 % noise
    f = _only(findings, territory="softmax.small")
    assert f.kind == "loses" and f.fails and "0 of 2 cases won" in f.text
    assert "compile 150.0 us / cuda 140.0 us = 1.07x, needs > 1.12x [loses]" in f.text
    assert SUMMARY.match(report(findings).splitlines()[-1]).groups() == ("0", "0", "0", "0")


def test_a_tie_inside_the_territory_fails():
    """The decision: a kernel whose lead over the compiler tiers, net of its margin, lies inside the noise fails its
    territory. It has not shown that it pays for itself there, and the cost-aware policy gives a tie to the cheaper
    tier, so the kernel would not be picked in the territory it claims. Just above the noise, it wins."""
    f = _only(_run(_frame(cuda_us=100.0, compile_us=111.0, triton_us=111.0)), territory="softmax.small")
    assert f.kind == "ties" and f.fails and "1.11x, needs > 1.12x [ties]" in f.text
    assert _only(_run(_frame(cuda_us=100.0, compile_us=113.0, triton_us=113.0))).kind == "defends"


def test_the_host_spread_counts_only_where_the_case_is_host_bound_in_the_eager_context():
    """Host-bound rows (host 30-40 us over kernels of 5-8 us) with a 40 % host spread: a 1.33x lead is inside the
    noise in the eager context (bar 1.50x); the same rows in the graphed context are judged by their 2 % kernel
    spread (bar 1.12x) and win."""
    def frame(context):
        return pd.DataFrame([r for p in ("1x4096,dim=-1", "32x4096,dim=-1") for r in (
            _row(p, "compile", 5.0, host=40.0, host_spread=0.4, context=context),
            _row(p, "triton", 5.0, host=45.0, host_spread=0.4, context=context),
            _row(p, "cuda", 8.0, host=30.0, host_spread=0.4, context=context))])

    eager = _only(_run(frame("eager")), territory="softmax.small")
    assert eager.kind == "ties" and "1.33x, needs > 1.50x" in eager.text
    assert _only(_run(frame("graphed")), territory="softmax.small").kind == "defends"
    # a GPU-bound row's host spread is not noise: the same spreads on a host path under the kernel change nothing
    gpu_bound = _frame(cuda_us=100.0, host_spread=3.0)
    assert _only(_run(gpu_bound), territory="softmax.small").kind == "defends"


def test_results_without_a_context_column_are_eager_and_other_contexts_are_other_cases():
    df = _frame()
    assert "context" not in df.columns and _only(_run(df)).kind == "defends"
    compiled = _frame(cuda_us=200.0, context="compiled")  # losing, but in a context the territory does not claim
    findings = _run(pd.concat([df.assign(context="eager"), compiled]))
    assert _only(findings, territory="softmax.small").kind == "defends"
    assert "2 cases fall in none of its territories" in _only(findings, kind="outside").text


def test_stale_evidence_fails():
    findings = _run(_frame(source_hash="0123456789abcdef"))
    assert any(f.kind == "stale" and f.impl == "cuda" and f.fails for f in findings)
    f = _only(findings, territory="softmax.small")
    assert f.kind == "no-evidence" and "(2 stale CUDA rows)" in f.text


def test_a_retired_territory_is_reported_not_failed_and_flagged_where_it_wins():
    why = "loses to Triton at bandwidth: 0.70x at 16384x4096 bf16"
    lose = _frame(cuda_us=160.0, problems=("4096x4096,dim=-1",))
    findings = _run(pd.concat([_frame(), lose]), (SMALL, BIG), {"softmax.big": why})
    f = _only(findings, territory="softmax.big")
    assert f.kind == "retired" and not f.fails and why in f.text
    assert not any(x.fails for x in findings)
    assert report(findings).splitlines()[-1] == "cuda: 1 kernels defend 2 cases in 1 territories; 1 territories retired"
    win = _frame(cuda_us=100.0, problems=("4096x4096,dim=-1",))
    f = _only(_run(pd.concat([_frame(), win]), (SMALL, BIG), {"softmax.big": why}), territory="softmax.big")
    assert f.kind == "retired-wins" and not f.fails and "now wins at 1 of 1 cases" in f.text


def test_each_device_is_judged_on_its_own_rows_and_needs_its_own_cuda_rows():
    """GPU A: the kernel wins 1.5x. GPU B: its compiler tiers are faster than GPU A's kernel; mixed, A's rows would be
    judged against B's and lose. Per device B alone loses; and a device without CUDA rows fails the territory."""
    a = _frame(cuda_us=100.0, device="gpu-a")
    b = _frame(cuda_us=100.0, compile_us=60.0, triton_us=60.0, device="gpu-b")
    f = _only(_run(pd.concat([a, b])), territory="softmax.small")
    assert f.kind == "loses" and f.cases == 4 and f.won == 2 and f.text.count("[loses]") == 2
    assert "60.0 us / cuda 100.0 us" in f.text and "150.0 us /" not in f.text
    f = _only(_run(pd.concat([a, b[b.impl != "cuda"]])), territory="softmax.small")
    assert f.kind == "no-evidence" and "on gpu-b" in f.text and "on gpu-a" not in f.text


def test_cli_exit_codes_and_the_last_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(terr, "TERRITORIES", (SMALL,))
    monkeypatch.setattr(terr, "RETIRED", {})
    import tiered_ops.analysis.check as chk

    monkeypatch.setattr(chk, "TERRITORIES", (SMALL,))
    monkeypatch.setattr(chk, "RETIRED", {})
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    _frame(cuda_us=100.0).to_csv(good, index=False)
    _frame(cuda_us=149.0).to_csv(bad, index=False)
    assert main(["check", "--results", str(good)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("check passed") and SUMMARY.match(out[-1]).groups() == ("1", "2", "1", "0")
    assert main(["check", "--results", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAIL softmax cuda [loses]: does not hold softmax.small" in out and SUMMARY.match(out.splitlines()[-1])
    assert main(["check"]) == 2


# ------------------------------------------------------------------------------------------ the committed table
def test_the_training_run_evidence_is_stale_and_the_h100s_so_never_fails(tmp_path, capsys):
    """The H100's training run (reports/nvidia-h100/training until 11799ea; its results kept in tests/data) measured
    kernel sources that have changed since: stale. It is the H100's, an archived GPU (reports/gpus.toml): information,
    exit 0; with the H100 current it fails."""
    training = str(ROOT / "tests/data/h100-training-results.csv.xz")
    assert main(["check", "--results", training, "--gpus", str(ROOT / "reports" / "gpus.toml")]) == 0
    out = capsys.readouterr().out
    assert "nvidia-h100: archived (last swept at tree" in out and "info softmax cuda [stale]: " in out
    current = tmp_path / "gpus.toml"
    current.write_text('current = ["nvidia-h200", "nvidia-h100"]\n')
    assert main(["check", "--results", training, "--gpus", str(current)]) == 1


GPUS = gpus.load(ROOT / "reports" / "gpus.toml")
# what CI gates: the current GPUs' results (the archived ones' are reported, never failing)
COMMITTED = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("reports/*/results.csv")
                   if GPUS.is_current(p.parent.name))
# The first H100 sweep (reports/nvidia-h100/tree-dab8732 until 11799ea), kept in tests/data: real rows for the crafted
# evidence.
LAST_H100 = ROOT / "tests/data/h100-dab8732-results.csv"


@pytest.mark.parametrize("csv", COMMITTED or [pytest.param(None, marks=pytest.mark.skip(
    reason="no committed reports/*/results.csv: no GPU's evidence of the current sources to check"))])
def test_the_committed_evidence_holds_every_declared_territory(csv, capsys):
    assert main(["check", "--results", str(ROOT / csv)]) == 0
    out = capsys.readouterr().out
    measured = set(pd.read_csv(ROOT / csv).op)
    held = [t for t in terr.TERRITORIES if t.name not in terr.RETIRED and t.op in measured]
    for t in held:
        assert f"[defends]: defends {t.name} (" in out
    for t in terr.TERRITORIES:  # declared before a sweep measured its op: reported, not failed
        if t.name not in terr.RETIRED and t.op not in measured:
            assert f"[unmeasured]: not yet measured: {t.name} (" in out
    n, m, t, k = map(int, SUMMARY.match(out.splitlines()[-1]).groups())
    assert (t, k) == (len(held), len(terr.RETIRED)) and n == len({(x.op, x.impl) for x in held}) and m >= t
    # every CUDA kernel of the catalog says what it defends, why it stays, or that it is not yet measured
    kernels = [(s.name, i.name) for s in all_ops() for i in s.impls.values() if i.tier.label == "cuda"]
    for op, impl in kernels:
        said = [line for line in out.splitlines() if re.match(
            rf"ok   {op} {impl} \[(kernel\]: defends |(stays|remove)\]: holds no territory; |unmeasured\]: not yet "
            rf"measured: no row of {op} {impl} )", line)]
        assert len(said) == 1, (op, impl)
    assert "[defends-nothing]" not in out and "[unfounded]" not in out


def test_the_table_follows_its_rules_and_bad_entries_are_named():
    terr.validate()
    cuda = {(s.name, i.name) for s in (get_op(o) for o in ("softmax", "rms_norm", "layer_norm", "gelu", "muladd"))
            for i in s.impls.values() if i.tier.label == "cuda"}
    assert cuda <= {(t.op, t.impl) for t in terr.TERRITORIES}  # every CUDA kernel declares its regions
    for t in terr.TERRITORIES:  # the table is data outside every implementation's source hash
        assert all(Path(p).name != "territories.py" for p in get_op(t.op).impls[t.impl].sources)
    with pytest.raises(ValueError, match="has no CUDA implementation 'triton'"):
        terr.validate([Territory("x", "softmax", "triton", (1, 2), (1, 2), ("bf16",), ("fwd_nograd",))], {})
    with pytest.raises(ValueError, match="softmax.small and softmax.wide overlap"):
        terr.validate([SMALL, Territory("softmax.wide", "softmax", "cuda", (16, 64), (1, None), ("bf16",),
                                        ("fwd_nograd",))], {})
    with pytest.raises(ValueError, match="retired but not declared: softmax.gone"):
        terr.validate([SMALL], {"softmax.gone": "never declared"})
    with pytest.raises(ValueError, match="modes"):
        terr.validate([Territory("x", "softmax", "cuda", (1, 2), (1, 2), ("bf16",), ("fwd_only",))], {})


def test_live_measures_the_default_problems_inside_the_held_territories():
    specs = [get_op(o) for o in ("softmax", "rms_norm", "layer_norm", "gelu", "muladd")]
    problems, dtypes, modes = live_plan(specs)
    held = [t for t in terr.TERRITORIES if t.name not in terr.RETIRED]
    for s in specs:
        inside = [p for p in s.default_problems("cuda") if any(
            t.op == s.name and terr._inside(rows_and_len(s.name, p)[0], t.rows)
            and terr._inside(rows_and_len(s.name, p)[1], t.row_len) for t in held)]
        assert problems.get(s.name, []) == inside
    assert set(dtypes) == {d for t in held for d in t.dtypes} and set(modes) == {m for t in held for m in t.modes}


def test_the_territories_page_lists_which_kernels_defend_what():
    text = (ROOT / "docs" / "territories.md").read_text()
    start = text.index("<!-- territories:")
    section = text[text.index("\n", start) + 1:text.index("<!-- /territories -->")]
    assert section == terr.markdown()
    for t in terr.TERRITORIES:
        assert t.name in section


@pytest.mark.parametrize("drop", ["rows", "fail"])
def test_the_committed_evidence_without_working_cuda_rows_fails(drop, tmp_path, capsys, monkeypatch):
    """What used to pass: the last H100 results with no CUDA rows, or with every CUDA row failed, where a
    territory is held (the small-row ones, retired on that evidence, are held again here). The failed CUDA rows
    carry the tree's source hashes, as if measured now: a stale row would fail as stale before it is judged."""
    import tiered_ops.analysis.check as check_mod

    kept = {k: v for k, v in terr.RETIRED.items() if not k.endswith(".small-rows")}
    assert len(kept) < len(terr.RETIRED)
    monkeypatch.setattr(check_mod, "RETIRED", kept)
    df = pd.read_csv(LAST_H100)
    if drop == "rows":
        df = df[df.tier != "cuda"]
    else:
        df["reason"] = df["reason"].astype(object)  # all empty in a file where every row passed
        cuda = df.tier == "cuda"
        df.loc[cuda, ["ok", "reason"]] = [0, "crafted: wrong output"]
        df.loc[cuda, "source_hash"] = [get_op(o).impls[i].source_hash if i in get_op(o).impls else h
                                       for o, i, h in zip(df.op[cuda], df.impl[cuda], df.source_hash[cuda])]
    csv = tmp_path / "results.csv"
    df.to_csv(csv, index=False)
    assert main(["check", "--results", str(csv)]) == 1
    out = capsys.readouterr().out
    measured = set(df.op)
    held = [t for t in terr.TERRITORIES if t.name not in kept and t.op in measured]
    kind = "no-evidence" if drop == "rows" else "broken"
    lines = out.splitlines()
    for t in held:  # each held territory fails: broken where that file has a case inside it, else without evidence
        said = [line for line in lines if f"does not hold {t.name} (" in line]
        assert len(said) == 1 and (f"[{kind}]:" in said[0] or "[no-evidence]:" in said[0]), (t.name, said)
    assert held and sum(f"[{kind}]: does not hold" in line for line in lines) >= 4  # the small-row territories
    if drop == "fail":  # muladd's CUDA rows, failed or not, are not judged: that kernel is no longer in the catalog
        assert "ok   muladd cuda [removed]: no longer in the catalog" in out
    assert SUMMARY.match(out.splitlines()[-1]).groups() == ("0", "0", "0", str(len(kept)))


# ------------------------------------------------------------------------------------------ territories as data
def test_a_territory_without_rows_of_its_op_is_not_yet_measured_but_stale_rows_fail():
    """Declared before any sweep of its op: reported, never failed. Rows of the op whose CUDA source is not the
    tree's (stale): that fails, with the stale rows named."""
    f = _only(check(_frame().assign(op="muladd"), [SPEC], [SMALL], {}))
    assert f.kind == "unmeasured" and not f.fails and "not yet measured: softmax.small" in f.text
    stale = _frame().assign(source_hash="0ld")
    findings = check(stale, [SPEC], [SMALL], {})
    assert any(f.kind == "stale" and f.fails for f in findings)
    held = _only(findings, territory="softmax.small")
    assert held.kind == "no-evidence" and held.fails and "stale CUDA rows" in held.text


def test_a_retired_territorys_figures_come_from_the_evidence():
    """The reason is words; the figures are computed now: cases won of judged, the best ratio against its bar."""
    text = _only(_run(_frame(cuda_us=149.0), retired={"softmax.small": "ties Triton"}), kind="retired").text
    assert "ties Triton; on this evidence it wins 0 of 2 cases (its best 1.01x against a bar of 1.12x)" in text
    assert "150.0 us / cuda 149.0 us = 1.01x, needs > 1.12x [loses]" in text
    assert "no case of it in this evidence" in _only(_run(_frame(problems=("4096x4096,dim=-1",)),
                                                          retired={"softmax.small": "x"}), kind="retired").text


def test_a_territory_margin_and_problem_options_are_its_own():
    wide = Territory("softmax.small", "softmax", "cuda", (1, 32), (4096, 4096), ("bf16",), ("fwd_nograd",),
                     margin=0.6)
    assert _only(_run(_frame(cuda_us=100.0), (wide,))).kind == "loses"  # 1.5x is short of 1.6x beyond the noise
    assert _only(_run(_frame(cuda_us=100.0))).kind == "defends"  # the same cases under the 10 % margin
    picky = Territory("softmax.small", "softmax", "cuda", (1, 32), (4096, 4096), ("bf16",), ("fwd_nograd",),
                      options=(("lengths", "powerlaw"),))
    assert not picky.contains(1, 4096, "bf16", "fwd_nograd", "eager", "1x4096,dim=-1")
    assert picky.contains(1, 4096, "bf16", "fwd_nograd", "eager", "1x4096,dim=-1,lengths=powerlaw")


def test_rows_of_a_kernel_no_longer_in_the_catalog_are_reported_as_removed_and_ignored():
    """A kernel whose sources were deleted leaves rows in the committed evidence: the check names it once per kernel
    (its rows per GPU), never fails for it, judges nothing on them and takes no rival from them; the summary says so."""
    gone = _frame(cuda_us=100.0, gpu_name="NVIDIA H200").assign(impl=lambda d: d.impl.replace({"cuda": "cuda_v0",
                                                                                              "triton": "triton_v0"}))
    findings = _run(pd.concat([_frame(cuda_us=100.0), gone[gone.impl != "eager"]]))
    removed = [f for f in findings if f.kind == "removed"]
    assert [(f.op, f.impl) for f in removed] == [("softmax", "cuda_v0"), ("softmax", "triton_v0")]
    assert all(not f.fails and "(2 of NVIDIA H200) are ignored by the check" in f.text for f in removed)
    held = _only(findings, territory="softmax.small")  # judged on the catalog's kernel alone, as without those rows
    assert held.kind == "defends" and (held.cases, held.won) == (2, 2) and "1.50x against a bar of 1.12x" in held.text
    # a removed Triton kernel 3x faster would have beaten the CUDA kernel as its rival: it is no rival
    fast = gone[gone.impl == "triton_v0"].assign(p20_us=49.0, p50_us=50.0, p80_us=51.0, caller_us=50.0)
    assert _only(_run(pd.concat([_frame(cuda_us=100.0), fast])), territory="softmax.small").kind == "defends"
    last = report(findings).splitlines()[-1]
    assert last.endswith("; 2 kernels removed, their rows ignored (softmax cuda_v0, softmax triton_v0)")
    assert SUMMARY.match(last).groups() == ("1", "2", "1", "0")


def test_the_data_file_loads_and_a_malformed_entry_is_named(tmp_path):
    ts, retired = terr.load()
    assert ts == terr.TERRITORIES and retired == terr.RETIRED
    assert all(isinstance(v, str) and v for v in retired.values())
    for t in ts:  # no figures typed into a retired reason: they come from the evidence
        assert not re.search(r"\d\.\d\dx", retired.get(t.name, "")), t.name
    bad = tmp_path / "t.json"
    bad.write_text('{"territories": [{"name": "x.y", "op": "softmax", "impl": "cuda", "rows": [1]}]}')
    with pytest.raises(ValueError, match=r"entry 0 \(x.y\) is malformed"):
        terr.load(bad)


def test_the_default_gpu_sweep_reaches_into_every_held_territory():
    """Each held territory has a default GPU problem inside it, so the default sweep brings evidence for it."""
    for t in terr.TERRITORIES:
        if t.name in terr.RETIRED:
            continue
        probs = get_op(t.op).default_problems("cuda")
        assert any(t.contains(*rows_and_len(t.op, p), d, m, c, str(p)) for p in probs for d in t.dtypes
                   for m in t.modes for c in t.contexts), t.name
