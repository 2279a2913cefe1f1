"""A patched model under every torch.compile mode on a GPU (reduce-overhead, max-autotune,
max-autotune-no-cudagraphs), in any order of patch, compile, call and tune: no graph break, outputs as the stock
model's, the compiled context's decision traced also where the graph is replayed as a CUDA graph. GPU-only (the
CUDA-graph modes need one); run by scripts/gpu.sh, or alone: ``pytest -m gpu tests/test_compile_modes.py``."""

import copy
import time

import pytest
import torch
from test_patch import _out, needs_hf, tiny
from torch._dynamo.utils import counters

import tiered_ops
from tiered_ops.decide import background
from tiered_ops.decide import decide as select
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import bucket_str
from tiered_ops.registry import DTYPE_NAMES
from tiered_ops.runtime import dispatch
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

MODES = ["reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
ORDERS = ["patch-compile-call", "compile-patch-call", "call-compile-call", "compile-call-tune-call"]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """A fresh dynamo; a trace's miss recorded, not measured (the tune order measures on purpose)."""
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(background, "request", lambda *a: (None, background.NOT_QUEUED + "recorded by the test"))
    yield
    torch._dynamo.reset()


def _calls(fn, ids, n: int = 3) -> list[torch.Tensor]:
    """``n`` calls, each output copied at once (a CUDA-graph replay overwrites the last one's)."""
    outs = []
    with torch.no_grad():
        for _ in range(n):
            outs.append(_out(fn(ids)).float().clone())
    return outs


@pytest.mark.gpu
@needs_hf
@pytest.mark.timeout(900)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_in_any_order(mode, order):
    model = tiny("llama").to(CUDA)
    stock = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), device=CUDA)
    with torch.no_grad():
        ref = _out(stock(ids)).float()
    outs = []
    if order == "compile-patch-call":
        compiled = torch.compile(model, mode=mode, fullgraph=True)
        tiered_ops.patch(model)
    else:
        tiered_ops.patch(model)
        if order == "call-compile-call":
            outs += _calls(model, ids, 1)  # an eager call first: its decisions exist at trace time
        compiled = torch.compile(model, mode=mode, fullgraph=True)
    outs += _calls(compiled, ids)
    if order == "compile-call-tune-call":
        tiered_ops.tune(model, (ids,), context="compiled")
        counters["graph_break"].clear()  # tune's own measuring compiles functions of its own
        outs += _calls(compiled, ids)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    for out in outs:
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@needs_hf
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_training_step_in_a_cuda_graph_mode(mode):
    model = tiny("llama").to(CUDA).train()
    stock = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), device=CUDA)
    tiered_ops.patch(model)
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    for _ in range(2):
        model.zero_grad()
        loss = compiled(ids, labels=ids).loss
        loss.backward()
    ref = stock(ids, labels=ids).loss
    ref.backward()
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    torch.testing.assert_close(loss.detach(), ref.detach(), atol=2e-3, rtol=2e-3)
    grads = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=2e-3, rtol=2e-2, msg=name)


def _rows(op: str, problem, eager_winner: str, compiled_winner: str) -> list[dict]:
    """Rows in which ``eager_winner`` is fastest as Python and CUDA-graph callers pay it, ``compiled_winner`` inside
    compiled callers."""
    spec, fp = get_op(op), fingerprint(CUDA)
    out = []
    for ctx, winner in (("eager", eager_winner), ("compiled", compiled_winner)):
        for i in spec.impls.values():
            us = 1.0 if i.name == winner else 9.0
            out.append(dict(op=op, impl=i.name, tier=i.tier.label, mode="fwd_nograd", problem=str(problem),
                            bucket=bucket_str(spec.bucket(problem)), dtype=DTYPE_NAMES[torch.float32],
                            device_key=fp.key, ok=1, caller_us=us, p50_us=us, source_hash=i.source_hash,
                            timestamp=time.time(), context=ctx))
    return out


@pytest.mark.gpu
def test_a_cuda_graph_replayed_region_traces_the_compiled_decision(private_store, monkeypatch):
    """reduce-overhead replays the compiled graph as a CUDA graph: what it traced is the compiled context's choice
    (fusion decides), not the graphed (kernel time) one, which is for an eager caller under torch.cuda.graph."""
    spec = get_op("softmax")
    problem = spec.problem((64, 256), dim=-1)
    Store(private_store).add(_rows("softmax", problem, "triton", "eager"))
    select.set_tuning(False)
    seen = []
    choice = dispatch.trace_choice

    def spy(*args):
        seen.append(choice(*args))
        return seen[-1]

    spy._dynamo_marked_constant = True
    monkeypatch.setattr(dispatch, "trace_choice", spy)
    try:
        x = torch.randn(64, 256, device=CUDA)
        graphed = select.select_backend("softmax", (64, 256), torch.float32, CUDA, context="graphed")
        f = torch.compile(lambda t: tiered_ops.softmax(t.sin(), -1).cos(), mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            out = f(x).clone()
    finally:
        select.set_tuning(None)
    assert graphed.name == "triton" and seen == ["eager"], (graphed, seen)
    torch.testing.assert_close(out, torch.softmax(x.sin(), -1).cos())
