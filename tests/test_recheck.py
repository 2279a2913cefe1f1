"""Launch-bound candidates timed again side by side (``measure.recheck``): which rows of a case are taken again, what
their new rows hold, the interleaved rounds themselves (on the CPU), and a GPU sweep that stores them."""

import pytest
import torch
from helpers import HAS_CUDA

from tiered_ops.measure import recheck
from tiered_ops.store.rows import CONTENDED, PRUNED, UNGATED, WAITING
from tiered_ops.store.store import Store
from tiered_ops.sweep.bench import sweep
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


def row(impl, p50, host, **kw):
    """A GPU row as the store holds it: caller time the larger of kernel and host time, with spread."""
    return dict(dict(id=7, impl=impl, ok=1, p20_us=p50 * 0.98, p50_us=p50, p80_us=p50 * 1.02, host_us=host,
                     host_p20_us=host * 1.01, host_p80_us=host * 1.05, caller_us=max(p50, host), context="eager",
                     reason=None, origin=None), **kw)


def test_a_launch_bound_row_near_the_fastest_asks_for_every_usable_row():
    rows = [row("eager", 9.6, 13.4), row("cuda", 8.9, 22.3), row("triton", 7.6, 15.6),
            row("compile", 7.0, 51.0, reason=PRUNED + "slower"), row("liger", 7.8, 66.0, reason=CONTENDED + "busy"),
            row("cuda_c", 8.0, 12.0, context="compiled")]
    assert [r["impl"] for r in recheck.candidates(rows)] == ["eager", "cuda", "triton"]


def test_rivals_timed_in_another_run_near_the_fastest_are_taken_with_them():
    """A sweep resumed after the CUDA source changed times the kernel again, not Triton's row pruned (or timed and
    never gated) days before on another host: the check compares the two, so the side-by-side rounds time both."""
    ungated = UNGATED + "never chosen"
    rows = [row("eager", 24.9, 194.0), row("cuda", 16.9, 157.0),
            row("triton", 13.4, 300.0, ok=0, reason=PRUNED + "slower"),  # within REACH of cuda's 157
            row("compile", 13.9, 330.0, ok=0, reason=ungated),
            row("liger", 17.8, 320.0, ok=0, reason=CONTENDED + "busy"),  # flagged: never used, never re-timed
            row("triton_b", 13.4, 157.0 * recheck.REACH * 1.01, ok=0, reason=ungated),  # beyond reach
            row("cuda_c", 13.0, 200.0, ok=0, reason="wrong: rel error 3e-1")]  # failed its gate
    assert [r["impl"] for r in recheck.candidates(rows)] == ["eager", "cuda", "triton", "compile"]
    # the rivals do not start a re-timing: a kernel-bound case stays as timed
    assert recheck.candidates([row("cuda", 50.0, 20.0), row("eager", 60.0, 20.0),
                               row("triton", 40.0, 55.0, ok=0, reason=ungated)]) == []
    # timed together already, rivals included: nothing to do
    done = [dict(r, origin=recheck.ORIGIN + "x") for r in rows[:4]]
    assert recheck.candidates(done) == []


def test_kernel_bound_cases_and_far_launch_bound_rows_ask_for_nothing():
    # the fastest is kernel-bound and the launch-bound one is more than WITHIN behind it
    far = recheck.WITHIN * 50.0 * 1.01
    assert recheck.candidates([row("triton", 50.0, 20.0), row("compile", 40.0, far)]) == []
    assert recheck.candidates([row("triton", 50.0, 20.0), row("cuda", 60.0, 15.0)]) == []  # none launch-bound
    assert recheck.candidates([row("eager", 9.0, 13.0)]) == []  # nothing to compare with
    # a launch-bound one close behind a kernel-bound fastest asks, and so does one whose host time is within the
    # swing of its kernel time (kernel-bound here, launch-bound on a slower host)
    assert len(recheck.candidates([row("triton", 47.0, 17.0), row("compile", 46.8, 50.0)])) == 2
    assert len(recheck.candidates([row("triton", 47.5, 23.9), row("compile", 46.7, 42.7)])) == 2
    assert not recheck.launch_sensitive(row("compile", 46.7, 46.7 / recheck.HOST_SWING * 0.99))


def test_a_rival_slowed_by_another_runs_host_asks_for_the_case_again():
    """A sweep resumed after the CUDA source changed times the kernel again; Triton's row (its kernel close, its caller
    time set by an earlier run's host) stays beyond WITHIN: timed an hour or more apart, it asks for both again."""
    t = 1.8e9
    cuda = row("cuda", 194.0, 60.0, timestamp=t)
    triton = row("triton", 208.4, 346.2, timestamp=t - 22 * 3600)  # 1.78x by caller, 1.07x by kernel
    assert [r["impl"] for r in recheck.candidates([cuda, triton])] == ["cuda", "triton"]
    # the same two rows from one run: its host set both, the case stays as timed
    assert recheck.candidates([cuda, dict(triton, timestamp=t - 600)]) == []
    # a kernel too far behind, or a caller time beyond REACH, stays as timed across runs too
    assert recheck.candidates([cuda, dict(triton, p50_us=194.0 * recheck.WITHIN * 1.01)]) == []
    assert recheck.candidates([cuda, dict(triton, host_us=194.0 * recheck.REACH * 1.01,
                                          caller_us=194.0 * recheck.REACH * 1.01)]) == []


def test_a_pruned_row_under_the_bar_beside_its_rivals_is_pruned_no_longer():
    """Pruned on another run's host (its short timing's caller time 300 us against a bar of 1.5 x 157 us), a row whose
    rounds beside the others put it under their bar is usable again where its gate passed, else waits for its gate."""
    rows = [row("cuda", 16.9, 157.0), row("triton", 13.4, 300.0, ok=0, reason=PRUNED + "slower; not gated"),
            row("compile", 13.9, 330.0, ok=1, reason=PRUNED + "slower"), row("eager", 24.9, 194.0, reason=PRUNED)]
    hosts = {"cuda": [150.0] * 7, "triton": [120.0] * 7, "compile": [140.0] * 7, "eager": [400.0] * 7}
    new = {r["impl"]: r for r in recheck.retimed(rows, hosts)}
    assert new["triton"]["reason"] == WAITING and new["triton"]["ok"] == 0  # no gate ran: it waits for one
    assert new["compile"]["reason"] is None and new["compile"]["ok"] == 1  # gated before its short timing: usable
    assert new["eager"]["reason"] == PRUNED  # 400 us: still over 1.5 x the bar of the others' rounds
    assert new["cuda"]["reason"] is None
    assert rows[1]["reason"].startswith(PRUNED)  # the rows given are left as they were


def test_rows_timed_side_by_side_already_are_not_taken_again():
    done = [row("eager", 9.6, 13.4, origin=recheck.ORIGIN + "cuda"), row("cuda", 8.9, 14.0, origin=recheck.ORIGIN)]
    assert recheck.candidates(done) == []
    # one new row beside them (a source changed, measured again): the case is taken again, all of it
    assert len(recheck.candidates(done[:1] + [row("cuda", 8.9, 22.0)])) == 2


def test_retimed_rows_take_their_host_figures_from_the_rounds():
    rows = [row("eager", 9.6, 21.6), row("cuda", 8.9, 12.3)]
    hosts = {"eager": [14.9, 14.6, 15.2, 30.0, 14.7], "cuda": [14.5, 14.4, 14.8, 29.0, 14.6]}
    new = {r["impl"]: r for r in recheck.retimed(rows, hosts)}
    assert set(new) == {"eager", "cuda"} and all("id" not in r for r in new.values())
    assert new["eager"]["host_us"] == 14.6 and new["cuda"]["host_us"] == 14.4
    assert new["eager"]["caller_us"] == 14.6  # launch-bound: the host time
    assert new["eager"]["host_p20_us"] <= new["eager"]["host_p80_us"] <= 30.0
    assert new["eager"]["origin"] == recheck.ORIGIN + "cuda" and new["cuda"]["origin"] == recheck.ORIGIN + "eager"
    assert rows[0]["host_us"] == 21.6  # the rows given are left as they were
    # a kernel-bound row keeps its kernel time as the caller's
    (k,) = recheck.retimed([row("triton", 47.0, 17.0)], {"triton": [16.0, 18.0]})
    assert k["caller_us"] == 47.0 and k["host_us"] == 16.0
    assert recheck.retimed(rows, {"eager": []}) == []  # nothing timed, nothing new


def test_side_by_side_times_each_candidate_once_a_round_on_the_cpu():
    spec = get_op("muladd")
    names = ["eager", "eager_addcmul"]
    out = recheck.side_by_side(spec, names, spec.problem((32, 32)), torch.float32, CPU, "fwd_nograd", rounds=3,
                               batch_s=0.001)
    assert set(out) == set(names) and all(len(v) == 3 and min(v) > 0 for v in out.values())


def test_nothing_is_taken_again_on_the_cpu():
    spec = get_op("muladd")
    rows = [row("eager", 9.6, 13.4), row("eager_addcmul", 8.9, 22.3)]
    assert recheck.retime(spec, rows, spec.problem((32, 32)), torch.float32, CPU, "fwd_nograd") == ([], None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_a_gpu_sweep_stores_launch_bound_rows_timed_side_by_side(private_store, monkeypatch):
    spec = get_op("rms_norm")
    monkeypatch.setattr(spec, "impls", {n: spec.impls[n] for n in ("eager", "cuda")})
    store = Store(private_store)
    problem = spec.problem((1, 2048))
    kw = dict(progress=False, log=lambda s: None, modes=["fwd_nograd"], cost_metadata=False, isolate=True)
    sweep([spec], {"rms_norm": [problem]}, [torch.bfloat16], torch.device("cuda"), store, **kw)
    rows = store.rows(op="rms_norm")
    again = [r for r in rows if str(r["origin"] or "").startswith(recheck.ORIGIN)]
    assert {r["impl"] for r in again} == {"eager", "cuda"}  # a 1-row norm is launch-bound on every tier
    for r in again:
        assert r["caller_us"] == max(r["p50_us"], r["host_us"]) and r["host_us"] <= r["host_p80_us"]
    n = len(rows)
    sweep([spec], {"rms_norm": [problem]}, [torch.bfloat16], torch.device("cuda"), store, **kw)
    assert len(store.rows(op="rms_norm")) == n  # resumed: nothing measured or timed again


def test_a_candidate_that_raises_side_by_side_is_left_out_and_said(monkeypatch, caplog):
    spec = get_op("muladd")
    from tiered_ops.measure import measure as measure_mod

    real = measure_mod.timed_call

    def failing(spec_, impl, inp, mode, context="eager"):
        if impl.name != "eager_addcmul":
            return real(spec_, impl, inp, mode, context)

        def boom():
            raise RuntimeError("out of memory")
        return boom

    monkeypatch.setattr(measure_mod, "timed_call", failing)
    with caplog.at_level("WARNING"):
        out = recheck.side_by_side(spec, ["eager", "eager_addcmul"], spec.problem((32, 32)), torch.float32, CPU,
                                   "fwd_nograd", rounds=2, batch_s=0.001)
    assert set(out) == {"eager"} and len(out["eager"]) == 2
    assert "eager_addcmul raised while timed side by side (RuntimeError: out of memory)" in caplog.text


def test_retime_hands_the_names_to_a_worker_and_keeps_the_rows_when_it_fails(monkeypatch):
    """The sweep's and background tuning's path: ``run`` (a worker's ``host`` task) times the named candidates; a
    worker that died or hung leaves no new row and says why. Only the device's type is read here: no GPU needed."""
    spec = get_op("muladd")
    monkeypatch.setattr(spec, "fresh_impl", lambda r: spec.impls[r["impl"]])
    rows = [row("eager", 9.6, 13.4), row("eager_addcmul", 8.9, 22.3)]
    asked = []

    def worker(names):
        asked.append(names)
        return {n: [11.0, 12.0] for n in names}, None

    gpu, problem = torch.device("cuda"), spec.problem((32, 32))
    new, why = recheck.retime(spec, rows, problem, torch.float32, gpu, "fwd_nograd", worker)
    assert why is None and asked == [["eager", "eager_addcmul"]]
    assert {r["impl"]: r["caller_us"] for r in new} == {"eager": 11.0, "eager_addcmul": 11.0}
    assert recheck.retime(spec, rows, problem, torch.float32, gpu, "fwd_nograd",
                          lambda names: (None, "the worker died")) == ([], "the worker died")
    assert recheck.retime(spec, rows[:1], problem, torch.float32, gpu, "fwd_nograd", worker) == ([], None)
    assert len(asked) == 1  # nothing to compare: no worker task


def test_a_row_the_rounds_unprune_is_gated_before_the_sweep_ends(private_store, monkeypatch):
    """The rounds' new row of a candidate pruned before its gate waits for that gate (``WAITING``); the sweep settles
    the case once more, so the newest row of every candidate is gated or passed over, none left waiting. On the CPU
    the rounds never run: ``retime`` stands in for them, handing back the compile tier's row un-pruned."""
    import time

    from tiered_ops.store.rows import waits_for_gate

    spec = get_op("muladd")
    monkeypatch.setattr(spec, "impls", {n: spec.impls[n] for n in ("eager", "compile")})
    handed: list[dict] = []

    def rounds(spec_, rows, problem, dtype, device, mode, run=None):
        if handed:
            return [], None
        r = next(r for r in rows if r["impl"] == "compile")
        handed.append(dict({k: v for k, v in r.items() if k != "id"}, ok=0, reason=WAITING, timestamp=time.time(),
                           origin=recheck.ORIGIN + "eager"))
        return list(handed), None

    monkeypatch.setattr(recheck, "retime", rounds)
    store = Store(private_store)
    sweep([spec], {"muladd": [spec.problem((8, 16))]}, [torch.float32], CPU, store, progress=False,
          log=lambda s: None, modes=["fwd_nograd"], cost_metadata=False)
    assert handed, "the stand-in for the rounds was never asked"
    newest = {}
    for r in sorted(store.rows(op="muladd"), key=lambda r: r["timestamp"]):
        newest[r["impl"]] = r
    assert set(newest) == {"eager", "compile"}
    assert not any(waits_for_gate(r) for r in newest.values()), {k: r["reason"] for k, r in newest.items()}
