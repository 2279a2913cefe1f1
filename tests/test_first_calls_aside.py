"""Background tuning makes a bucket's compiled candidates' first calls in its gate helpers while the worker times the
others (``helpers.FirstCalls``): each call is awaited on its own, a failure or a dead helper is None (the worker's
own first call then runs as before), and the stored row keeps the cold call's cost."""

import logging
import threading

import pytest
import torch

import tiered_ops
from tiered_ops.decide import background
from tiered_ops.decide import decide as select
from tiered_ops.decide.bucket import FIRST_ASIDE
from tiered_ops.decide.helpers import FirstCalls
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op


class _Pool:
    """A stand-in for a gate helper's pool: ``run`` answers from ``replies`` (a name's reply, or an Event to wait
    for first), recording the tasks it was given."""

    def __init__(self, replies):
        self.replies, self.tasks = replies, []

    def run(self, task, what):
        self.tasks.append(task)
        reply = self.replies[task[2]]
        if isinstance(reply, threading.Event):
            reply.wait(30)
            return 0.5, None
        if isinstance(reply, Exception):
            raise reply
        return reply


def test_each_first_call_is_awaited_on_its_own_and_a_failure_is_none():
    slow = threading.Event()
    one = _Pool({"triton": (0.25, None), "slow": slow, "unknown to it": None})  # None: not subscriptable, a TypeError
    two = _Pool({"compile": (None, "the worker died (SIGKILL)"), "broken": RuntimeError("x: it raised\ntrace")})
    calls = FirstCalls([one, two], ("first_call", "softmax"), ("problem", "fp32", "fwd_nograd"),
                       ["triton", "compile", "slow", "broken", "unknown to it"], "softmax 4x64")
    assert calls.wait("triton") == 0.25  # while "slow", after it on the same helper, still runs
    assert calls.wait("compile") is None  # its helper died: the worker's own first call runs as before
    assert calls.wait("broken") is None  # it raised in the helper
    slow.set()
    assert calls.wait("slow") == 0.5 and calls.wait("eager") is None  # eager: never asked for
    assert calls.wait("unknown to it") is None  # the pool itself failed: no waiter is left hanging
    calls.join()
    assert [t[2] for t in one.tasks] == ["triton", "slow", "unknown to it"]
    assert [t[2] for t in two.tasks] == ["compile", "broken"]
    assert one.tasks[0] == ("first_call", "softmax", "triton", "problem", "fp32", "fwd_nograd")


def test_no_helper_runs_nothing():
    calls = FirstCalls([], ("first_call", "softmax"), (), ["triton"], "softmax")
    assert calls.wait("triton") is None
    calls.join()


@pytest.fixture
def bg():
    background.shutdown()
    select.set_tuning("background")
    yield
    background.shutdown()
    select.set_tuning(None)


@pytest.mark.parametrize("aside", ["1", "0"])
def test_a_helper_makes_the_compiled_candidates_first_call_and_its_cost_is_stored(bg, private_store, monkeypatch,
                                                                                   caplog, aside):
    monkeypatch.setenv("TIERED_OPS_GATE_HELPERS", "1")
    monkeypatch.setenv("TIERED_OPS_FIRST_CALLS_ASIDE", aside)  # 0: the worker makes every first call itself
    spec = get_op("softmax")
    monkeypatch.setattr(spec, "impls", {k: v for k, v in spec.impls.items() if k in ("eager", "triton")})
    caplog.set_level(logging.INFO, logger="tiered_ops")
    tiered_ops.warm_tuning("cpu", wait=True, timeout=600)  # the worker and its helper up before the bucket
    assert len(background._s.runner.helpers.ready()) == 1
    x = torch.randn(4, 64)
    torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x, -1))
    assert tiered_ops.wait_for_tuning(timeout=600)
    figures = [getattr(r, background.CANDIDATE) for r in caplog.records if hasattr(r, background.CANDIDATE)]
    order = [f["impl"] for f in figures if f["op"] == "softmax"]
    rows = {r["impl"]: r for r in Store(private_store).rows(op="softmax")}
    assert set(rows) == {"eager", "triton"} and rows["triton"]["first_call_s"] > 0
    if aside == "0":
        assert not [n for n in order if n.endswith(FIRST_ASIDE)], order
        return
    assert order.index("triton" + FIRST_ASIDE) < order.index("triton"), order  # made before the worker reached it
    made = next(f for f in figures if f["impl"] == "triton" + FIRST_ASIDE)
    assert made["first_call_s"] > 0 and "beside the timings" in made["outcome"]
    assert rows["triton"]["first_call_s"] >= made["first_call_s"]
    assert "eager" + FIRST_ASIDE not in order  # a candidate whose gate compiles nothing is not made aside

