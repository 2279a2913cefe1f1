"""A first call that measures says so: one WARNING line naming the op, the shape and the expected wait, INFO after
that, and progress lines while a long tune goes on."""

import logging

import pytest
import torch

import tiered_ops
from tiered_ops.decide import claimed
from tiered_ops.registry import Impl, Tier
from tiered_ops.tiers.catalog import get_op

SOFTMAX = get_op("softmax")
EAGER, CUDA = SOFTMAX.impls["eager"], SOFTMAX.impls["cuda"]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not tuned yet, softmax with two quick implementations, its own store and no cache."""
    impls = {"eager": SOFTMAX.impls["eager"],
             "again": Impl("again", Tier.COMPILE, lambda x, dim=-1: torch.softmax(x, dim), (SOFTMAX.source,))}
    monkeypatch.setattr(SOFTMAX, "impls", impls)
    monkeypatch.setattr(claimed, "_first", claimed.threading.Event())
    monkeypatch.setenv("TIERED_OPS_TUNE", "1")
    tiered_ops.use_store(str(tmp_path / "s.sqlite"))
    tiered_ops.clear_cache()
    yield impls
    tiered_ops.clear_cache()


def _tuning(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("tiered_ops: tuning")]


def test_the_first_call_on_an_unmeasured_shape_warns_once_naming_op_shape_and_wait(fresh, caplog):
    x = torch.randn(8, 24)
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        out = tiered_ops.softmax(x)
        tiered_ops.softmax(torch.randn(64, 40))  # a second bucket: measured too, said at INFO
        tiered_ops.softmax(x)  # decided: nothing said
    torch.testing.assert_close(out.double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-6)
    first, second = _tuning(caplog)
    assert first.levelno == logging.WARNING and second.levelno == logging.INFO
    text = first.getMessage()
    for part in ("softmax", "8x24", "fp32", "on first use", "TIERED_OPS_TUNE=background to never wait",
                 "2 implementation(s) (eager, again)"):
        assert part in text, (part, text)
    assert f"~{claimed.estimate_s(list(fresh.values()), torch.device('cpu')):.0f} s (an estimate)" in text
    assert "64x40" in second.getMessage() and "on first use" not in second.getMessage()
    assert "\n" not in text


def test_a_process_that_only_reads_stored_decisions_warns_nothing(fresh, caplog):
    x = torch.randn(8, 24)
    tiered_ops.softmax(x)
    tiered_ops.clear_cache()
    claimed._first.clear()  # as a new process with the same store
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        tiered_ops.softmax(x)
    assert not _tuning(caplog) and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_estimate_counts_only_what_can_run_here():
    spec = get_op("rms_norm")
    cpu = [i for i in spec.impls.values() if i.tier != Tier.PEER]
    expect = sum(claimed.ESTIMATE_S[i.tier] for i in cpu if i.why_not(torch.device("cpu")) is None)
    assert claimed.estimate_s(cpu, torch.device("cpu")) == expect
    assert Tier.CUDA not in {i.tier for i in cpu if i.why_not(torch.device("cpu")) is None}


def test_a_long_tune_says_how_far_it_is(fresh, caplog, monkeypatch):
    monkeypatch.setattr(claimed, "PROGRESS_EVERY_S", 0.0)  # every implementation after the first counts as long
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        tiered_ops.softmax(torch.randn(8, 24))
    still = [r.getMessage() for r in caplog.records if "still tuning" in r.getMessage()]
    assert len(still) == 1 and "1 of 2 measured" in still[0] and "next again" in still[0], still


def test_a_tune_of_tiers_that_cannot_run_here_says_no_wait_and_keeps_the_warning_for_a_real_one(monkeypatch, caplog):
    monkeypatch.setattr(claimed, "_first", claimed.threading.Event())
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="tiered_ops"):
        claimed.Announce("softmax 8x24", [CUDA], cpu).start("stored")  # unavailable here: nothing to wait for
        assert not claimed._first.is_set()
        claimed.Announce("softmax 8x24", [EAGER, CUDA], cpu).start("stored")
    assert [r.levelno for r in _tuning(caplog)] == [logging.INFO, logging.WARNING]
    assert "~1 s (an estimate)" in _tuning(caplog)[1].getMessage()
