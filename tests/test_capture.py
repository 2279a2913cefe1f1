"""CUDA-graph capture safety: a call inside a capture never measures, compiles or synchronizes; it runs the graphed
decision where that was called once outside capture (warmed), else what is warm. The CPU tests stand in for the
capture check; the GPU tests capture a patched model."""

from __future__ import annotations

import logging

import pytest
import torch

import tiered_ops
from tiered_ops.decide import capture, choice, claimed, decide, table
from tiered_ops.registry import Impl, Tier
from tiered_ops.runtime import dispatch, memo
from tiered_ops.tiers.catalog import get_op


def _key(x: torch.Tensor, w: torch.Tensor, context: int) -> tuple:
    return ("rms_norm", x.shape, x.dtype, x.get_device(), (x.shape[-1],), w.shape, w.dtype, False, context)


def _counting(calls: list) -> Impl:
    spec = get_op("rms_norm")

    def fn(*a, **k):
        calls.append(a)
        return spec.reference(*a, **k) * 2  # tells its output apart from eager's

    return Impl("planted", Tier.TRITON, fn, (spec.source,))


def _plant(x: torch.Tensor, impl: Impl) -> tuple:
    """The eager context decides eager, the graphed context ``impl``, for rms_norm at x's shape."""
    spec = get_op("rms_norm")
    base = ("rms_norm", spec.bucket(spec.problem_of(x, (x.shape[-1],), torch.ones(x.shape[-1]))), x.dtype, x.device,
            "fwd_nograd")
    eager = spec.impls["eager"]
    table.publish(add={base + ("eager",): decide.Selection(eager.fn, eager, {"reason": "planted"}),
                       base + ("compiled",): decide.Selection(eager.fn, eager, {"reason": "planted"}),
                       base + ("graphed",): decide.Selection(impl.fn, impl, {"reason": "planted"})})
    return base


@pytest.fixture()
def fresh(monkeypatch):
    decide.clear_cache()
    monkeypatch.setattr(table, "_current", table.DecisionTable({}, 0))  # nothing warm
    monkeypatch.setattr(decide, "_told", set())
    yield
    decide.clear_cache()


def test_a_call_inside_capture_never_measures_and_runs_eager_once_logged(fresh, monkeypatch, caplog):
    def no_measuring(*a, **k):
        raise AssertionError("measured inside a capture")

    monkeypatch.setattr(decide, "measure_kept", no_measuring)
    monkeypatch.setattr(claimed, "measure_kept", no_measuring)
    monkeypatch.setattr(choice, "gate", no_measuring)
    x, w = torch.randn(4, 64), torch.randn(64)
    spec = get_op("rms_norm")
    with caplog.at_level(logging.WARNING, logger="tiered_ops.decide.decide"):
        for _ in range(2):
            out = dispatch.dispatch(spec, _key(x, w, 2), x, (x, (64,), w), {})
            torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), w))
    assert sum("inside CUDA-graph capture" in r.message for r in caplog.records) == 1  # logged once
    assert not memo._calls and not table.current()  # nothing decided or cached inside the capture


def test_capture_runs_the_graphed_choice_only_once_it_is_warm(fresh, monkeypatch):
    monkeypatch.setattr(capture, "capturable", lambda device: True)  # the CPU stands in for a GPU
    calls: list = []
    impl = _counting(calls)
    x, w = torch.randn(4, 64), torch.randn(64)
    _plant(x, impl)
    spec = get_op("rms_norm")
    ref = torch.nn.functional.rms_norm(x, (64,), w)
    torch.testing.assert_close(dispatch.dispatch(spec, _key(x, w, 2), x, (x, (64,), w), {}), ref)  # cold: eager
    assert calls == []
    torch.testing.assert_close(tiered_ops.rms_norm(x, (64,), w), ref)  # the eager warm-up call runs eager...
    assert len(calls) == 1 and calls[0][0] is x  # ...and warms the graphed choice once, on its own tensors
    torch.testing.assert_close(tiered_ops.rms_norm(x, (64,), w), ref)
    assert len(calls) == 1  # once
    torch.testing.assert_close(dispatch.dispatch(spec, _key(x, w, 2), x, (x, (64,), w), {}), 2 * ref)  # warm
    assert len(calls) == 2


def test_a_decision_warms_its_graphed_choice_on_the_problems_inputs(fresh, monkeypatch):
    monkeypatch.setattr(capture, "capturable", lambda device: True)
    calls: list = []
    impl = _counting(calls)
    spec = get_op("rms_norm")
    monkeypatch.setitem(spec.impls, "planted", impl)
    monkeypatch.setattr(choice, "_decide", lambda spec, rows, *a, **k: (impl, "planted", []))
    monkeypatch.setattr(decide, "in_context", lambda rows, ctx: ([{"impl": "measured elsewhere"}], ""))
    problem = spec.problem((8, 64), normalized_shape=(64,))
    sel = decide.select_problem(spec, problem, torch.float32, torch.device("cpu"), tune=False, mode="fwd+bwd",
                                context="eager")
    assert sel.impl is impl
    assert len(calls) == 1 and calls[0][0].shape == (8, 64) and calls[0][0].requires_grad  # forward and backward
    assert capture.is_warm(spec, impl, problem, torch.float32, torch.device("cpu"), "fwd+bwd", capture.flavor(calls[0]))


def test_the_capture_check_reaches_the_capture_path(fresh, monkeypatch):
    """The generated fast path asks the capture check for a device tensor only; with it answering True, a call is
    keyed as graphed and takes the capture path (no measuring, no caching)."""
    x, w = torch.randn(4, 64), torch.randn(64)
    seen = []
    monkeypatch.setattr(dispatch, "dispatch", lambda spec, key, *a, **k: seen.append(key[-1]))
    fn = dispatch.make_public(get_op("rms_norm"))
    fn.__globals__["_capturing"] = lambda: True
    fn(x, (64,), w)
    assert seen == [0]  # a CPU tensor (get_device() == -1) is never capturing


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _capture(model, ids):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(input_ids=ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    return g, out


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["eager-warmup", "tune-graphed"])
def test_a_patched_model_captures_and_replays(how):
    model = _tiny_llama()
    ids = torch.randint(0, 512, (1, 128), device="cuda")
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.float()
    tiered_ops.patch(model)
    if how == "tune-graphed":
        tiered_ops.tune(model, dict(input_ids=ids, use_cache=False), context="graphed")
    g, out = _capture(model, ids)
    g.replay()
    torch.cuda.synchronize()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    tiered_ops.unpatch(model)


@pytest.mark.gpu
def test_reduce_overhead_compile_of_a_patched_model_runs():
    model = _tiny_llama()
    ids = torch.randint(0, 512, (1, 16), device="cuda")
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.float()
        tiered_ops.patch(model)
        model(input_ids=ids, use_cache=False)  # decided outside the graph
        fn = torch.compile(model, mode="reduce-overhead")
        for _ in range(4):
            out = fn(input_ids=ids, use_cache=False).logits.float()
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2


def test_warming_passes_the_calls_keyword_arguments(fresh, monkeypatch):
    """The warm-up call runs what the capture will run: a keyword-only argument (a norm form, a Triton constexpr)
    reaches the warmed implementation, so no kernel specialization is compiled for the first time inside capture."""
    seen: list = []
    spec = get_op("rms_norm")

    def fn(*a, **k):
        seen.append(k)
        return spec.reference(*a, **k)

    impl = Impl("planted", Tier.TRITON, fn, (spec.source,))
    monkeypatch.setattr(capture, "capturable", lambda device: True)
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64)
    problem = spec.problem_of(x, (64,), w, cast_before_weight=True)
    capture.warm(spec, impl, problem, x.dtype, x.device, "fwd_nograd", (x, (64,), w, 1e-6),
                {"cast_before_weight": True})
    assert seen == [{"cast_before_weight": True}]
    how = capture.flavor((x, (64,), w, 1e-6))
    assert capture.is_warm(spec, impl, problem, x.dtype, x.device, "fwd_nograd", how)


def test_warm_only_for_the_flavour_it_ran(fresh, monkeypatch):
    """A compiled implementation guards on each tensor's type, requires_grad and strides: warmed on the op's own
    inputs (plain tensors), it is not warm for a model's call with a Parameter weight that requires grad, so that
    call warms it again and a capture of it runs nothing cold."""
    spec = get_op("rms_norm")
    calls: list = []
    impl = _counting(calls)
    monkeypatch.setattr(capture, "capturable", lambda device: True)
    x = torch.randn(4, 64)
    w = torch.nn.Parameter(torch.randn(64))
    problem = spec.problem_of(x, (64,), w)
    capture.warm(spec, impl, problem, x.dtype, x.device, "fwd_nograd")  # the op's own inputs
    model_call = capture.flavor((x, (64,), w, 1e-6))
    assert not capture.is_warm(spec, impl, problem, x.dtype, x.device, "fwd_nograd", model_call)
    capture.warm(spec, impl, problem, x.dtype, x.device, "fwd_nograd", (x, (64,), w, 1e-6))
    assert capture.is_warm(spec, impl, problem, x.dtype, x.device, "fwd_nograd", model_call)
    assert len(calls) == 2 and calls[-1][2] is w  # inference warms on the call's own tensors
    assert w.grad is None
