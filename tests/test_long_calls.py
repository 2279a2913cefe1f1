"""A long call (at least ``timing.LONG_CALL_MS``, synchronized) is timed within a time budget; a short call is timed
with the same counts as before (the stored method of its rows does not change)."""

import pytest
import torch

from tiered_ops.measure import timing


def _old_samples(est_ms: float, per_rep_ms: float, rep_ms: float) -> int:
    """``gpu_times_ms``'s timed calls before long calls had a budget of their own."""
    return max(20, min(int(rep_ms / est_ms), 300, int(1000 / per_rep_ms)))


@pytest.mark.parametrize("rep_ms", [100.0, 10.0], ids=["full", "quick"])
def test_a_short_call_takes_the_samples_it_took_before(rep_ms):
    for est in (0.002, 0.05, 0.3, 1.0, 4.9, 5.0, 13.0, 30.0, 47.0, 49.9):
        per_rep = est + 0.02 + 0.1  # the sleep before it and the flush
        assert timing.gpu_samples(est, per_rep, rep_ms) == _old_samples(est, per_rep, rep_ms), est


def test_a_long_calls_samples_fit_a_time_budget():
    # 170 ms and 500 ms: linear_cross_entropy's float32 forward and training step at the default GPU problem; the
    # floor of 20 samples made each of them 20 calls (3.4 s and 10 s) in its quick look and again in its full timing
    for est in (50.0, 120.0, 170.0, 500.0, 2000.0):
        per_rep = est + 0.2
        full, quick = timing.gpu_samples(est, per_rep, 100.0, True), timing.gpu_samples(est, per_rep, 10.0, True)
        assert timing.LONG_MIN_SAMPLES[10.0] <= quick <= full <= 20, (est, quick, full)
        assert full * per_rep <= max(timing.GPU_BUDGET_MS, timing.LONG_MIN_SAMPLES[100.0] * per_rep), (est, full)
        assert quick < full or full == timing.LONG_MIN_SAMPLES[100.0], (est, quick, full)
    assert timing.gpu_samples(500.0, 500.2, 100.0, True) == 5 and timing.gpu_samples(500.0, 500.2, 10.0, True) == 3


def test_host_batches_of_a_long_call_make_no_untimed_call_and_one_call_each():
    calls = []
    per = timing.batch_times_us(lambda: calls.append(1), torch.device("cpu"), 0.025, batches=2, one_s=0.5,
                                min_calls=1)
    assert len(per) == 2 and len(calls) == 2
    calls.clear()
    # a short call as before: one untimed call to size the batches, then batches of at least 3 calls
    per = timing.batch_times_us(lambda: calls.append(1), torch.device("cpu"), 0.025)
    assert len(per) == 5 and len(calls) >= 1 + 5 * 3


@pytest.mark.gpu
@pytest.mark.alone  # beside other processes' kernels on the GPU, a 120 ms sleep's probes waited past the test's limit
@pytest.mark.parametrize("ms,quick", [(120.0, False), (120.0, True), (20.0, False)])
def test_a_long_call_is_timed_in_few_calls_and_a_short_one_as_before(ms, quick):
    # a kernel of a known length (torch.cuda._sleep): its median as long, the calls made by time_call counted
    dev = torch.device("cuda")
    cycles = int(ms * 1e3 * timing._cycles_per_us(dev))
    calls = []

    def call() -> None:
        calls.append(1)
        torch.cuda._sleep(cycles)

    call()
    # its length now, by events: the clock the cycles were counted at (measured once per process) moves with the
    # GPU's load (tests in other processes on it), which took a 120 ms sleep to 95.6 ms
    ref = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        ref.append(start.elapsed_time(end) * 1e3)
    ref_us = sorted(ref)[1]
    assert 0.5 * ms * 1e3 <= ref_us <= 2 * ms * 1e3, ref
    calls.clear()
    call()
    t = timing.time_call(call, dev, quick=quick)
    made = len(calls) - 1
    assert 0.9 * ref_us <= t.p50_us <= 1.2 * ref_us, (t, ref)
    assert t.host_us < 0.2 * t.p50_us, t  # the launch path of a GPU-bound call
    if ms >= timing.LONG_CALL_MS:
        # one sizing call, 2 + 2 host calls, 2 + 2 probes, the samples (5 or 3 at 120 ms: GPU_BUDGET_MS / 120)
        samples = timing.gpu_samples(ms, ms + 0.2, 10.0 if quick else 100.0, True)
        assert made <= 1 + 4 + 4 + samples + 1, made
    else:
        assert made >= 20 + 15 + 15, made  # the short call's floors: 20 samples, two host windows of 5 x 3 calls


def test_only_a_long_gpu_call_skips_the_quick_look(monkeypatch):
    # the pruning's quick look of a long call costs about what its full timing does: it is timed in full at once;
    # the one more call that says so is made only where the first call took that long, and never on the CPU
    from tiered_ops.measure import timing

    took = []
    monkeypatch.setattr(timing, "one_call_s", lambda call, device: took.append(1) or 0.12)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert timing.long_call(lambda: None, gpu, 0.3) and len(took) == 1
    assert not timing.long_call(lambda: None, gpu, 0.01) and len(took) == 1  # a first call of 10 ms: short
    assert not timing.long_call(lambda: None, cpu, 5.0) and len(took) == 1
    monkeypatch.setattr(timing, "one_call_s", lambda call, device: 0.004)  # a long compile, a short call
    assert not timing.long_call(lambda: None, gpu, 3.0)


@pytest.mark.gpu
@pytest.mark.alone
def test_a_long_call_is_timed_in_full_not_pruned():
    from tiered_ops.measure.measure import measure
    from tiered_ops.tiers.catalog import get_op

    spec = get_op("linear_cross_entropy")
    p = spec.problem((8192, 4096), 128256)  # fp32: a call of ~170 ms on an H200
    row = measure(spec, spec.impls["triton"], p, torch.float32, torch.device("cuda"), prune_above_us=1.0)
    assert row["ok"] and not str(row.get("reason") or "").startswith("pruned"), row
