"""A measurement's timing in one call (``timing.time_row``): its steps in the order they run on the device, the quick
look that ends a row, the step between (the gate) that ends one untimed, and the full timing's tries on a busy machine.
The device work is replaced by a recorder, so the order is exact and nothing is timed."""

import pytest
import torch

from tiered_ops.measure import timing
from tiered_ops.measure.sampling import Timing

CPU = torch.device("cpu")


@pytest.fixture
def steps(monkeypatch):
    """The steps time_row takes, in order: "quick" and "full" timings, the "peak", the "between" step; a quick look
    reads 50 us, a full timing 40 us, contended while ``steps.busy``."""
    class Steps(list):
        busy = False

    done = Steps()

    def time_call(fn, device, quick=False):
        done.append("quick" if quick else "full")
        return Timing(50.0, 50.0, 60.0, 50.0, contended="busy" if done.busy else None) if quick else \
            Timing(30.0, 40.0, 45.0, 40.0, contended="block times on multiples of 8.0 ms" if done.busy else None)

    monkeypatch.setattr(timing, "time_call", time_call)
    monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda device: 10.0)
    monkeypatch.setattr(timing, "peak_bytes", lambda call, device: done.append("peak") or 123)
    return done


def _between(steps, go=True):
    return lambda: steps.append("between") or go


def test_the_look_comes_before_the_step_between_or_after_the_peak(steps):
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, bar_us=1e9, look_first=True, between=_between(steps))
    assert steps == ["quick", "between", "peak", "full"] and f.pruned_at_us is None and f.peaked, f
    assert f.timing.p50_us == 40.0 and f.peak_bytes == 123 and f.copy_gbps == 10.0 and f.gbps == pytest.approx(1e-1)
    steps.clear()
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, bar_us=1e9, between=_between(steps))
    assert steps == ["between", "peak", "quick", "full"] and f.timing.p50_us == 40.0, f
    steps.clear()
    timing.time_row(lambda: None, CPU, 0.0, 4000, between=_between(steps))  # no bar: no look
    assert steps == ["between", "peak", "full"]


def test_a_look_above_the_bar_ends_the_row_with_its_figures(steps):
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, bar_us=10.0, look_first=True, between=_between(steps))
    assert steps == ["quick"] and f.pruned_at_us == 50.0 and not f.peaked and f.timing.p50_us == 50.0, f
    steps.clear()
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, bar_us=10.0, between=_between(steps))
    assert steps == ["between", "peak", "quick"] and f.pruned_at_us == 50.0 and f.peaked and f.peak_bytes == 123, f


def test_a_busy_look_is_not_pruned_unless_the_check_is_off(steps):
    steps.busy = True
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, bar_us=10.0, look_first=True, check_busy=True, tries=1)
    assert steps == ["quick", "peak", "full"] and f.pruned_at_us is None, f
    steps.clear()
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, bar_us=10.0, look_first=True, check_busy=False)
    assert steps == ["quick"] and f.pruned_at_us == 50.0, f


def test_the_step_between_ends_a_row_untimed(steps):
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, bar_us=1e9, between=_between(steps, go=False))
    assert steps == ["between"] and f.timing is None and not f.peaked, f


def test_a_busy_full_timing_is_taken_again_then_said_busy(steps):
    steps.busy = True
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, check_busy=True, tries=3, pause_s=0.0, label=("op", "impl"))
    assert steps == ["peak", "full", "full", "full"] and "multiples of 8.0 ms" in f.busy, f
    steps.clear()
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, check_busy=False, tries=3, pause_s=0.0)
    assert steps == ["peak", "full"] and f.busy == "" and f.timing.contended, f
    steps.clear()
    steps.busy = False
    f = timing.time_row(lambda: None, CPU, 0.0, 4000, check_busy=True, tries=3, pause_s=0.0)
    assert steps == ["peak", "full"] and f.busy == "", f


def test_only_a_long_gpu_call_skips_the_look(steps, monkeypatch):
    monkeypatch.setattr(timing, "one_call_s", lambda call, device: steps.append("one") or 0.12)
    gpu = torch.device("cuda")
    f = timing.time_row(lambda: None, gpu, 0.3, 4000, bar_us=10.0, look_first=True)
    assert steps == ["one", "peak", "full"] and f.long and f.pruned_at_us is None, f
    steps.clear()
    f = timing.time_row(lambda: None, gpu, 0.3, 4000)  # no bar: the call's length is never asked
    assert steps == ["peak", "full"] and not f.long, f
