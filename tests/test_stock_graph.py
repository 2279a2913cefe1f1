"""A patched model under torch.compile gives the compiler stock's graph where every compiled-context decision is the
op's plain torch decomposition (``tracing() and op.decomposes(...)``, ``patch_layers.tracing``): the forwards trace
the code they replaced, so nothing of ours (a cast order, a target check) reaches Inductor; and a decision for a
kernel still calls the op.

A tiny model of each RMSNorm family (Llama, Mistral, Qwen2, Qwen3, Gemma) in training (the loss through
``cross_entropy``, the residual add + RMSNorm fused; Qwen3's QK-norm + RoPE through ``qk_norm_rope``; Llama and
Qwen3 also with the LM head + loss fused, ``linear_cross_entropy``), compiled with ``fullgraph=True``: dynamo's graph
holds the stock graph's calls, plus the two reshapes the loss's question is asked with (unused: AOT drops them; none
with the LM head + loss fused), and the loss and every gradient equal stock's."""

import collections
import copy
import difflib

import pytest
import torch
from test_patch import needs_hf, tiny
from torch._dynamo.utils import counters

import tiered_ops
from tiered_ops.models.lm_head_loss import DESCRIPTION as LM_HEAD_ROUTE
from tiered_ops.models.patch_layers import tracing
from tiered_ops.models.patching import PATCHABLE_OPS
from tiered_ops.registry import Impl, Tier
from tiered_ops.runtime import dispatch
from tiered_ops.tiers.catalog import get_op

OPS = [o for o in PATCHABLE_OPS if o != "linear_cross_entropy"]  # the loss through cross_entropy (logits kept)


@pytest.fixture(autouse=True)
def fresh_dynamo(private_decisions):
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _calls(model: torch.nn.Module, ids: torch.Tensor) -> tuple[collections.Counter, torch.Tensor]:
    """The FX calls of dynamo's one graph of a training step, and its loss (backward run)."""
    graphs = []

    def backend(gm, example):
        graphs.append(gm)
        return gm.forward

    loss = torch.compile(lambda m, x: m(x, labels=x).loss, fullgraph=True, backend=backend)(model, ids)
    loss.backward()
    assert len(graphs) == 1 and dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    return collections.Counter(str(n.target) for n in graphs[0].graph.nodes
                               if n.op in ("call_function", "call_method", "call_module")), loss


# what dynamo's graph holds beyond stock's, unused (AOT drops them): the two reshapes the loss's question asks with
# (Qwen3's attentions and the fused LM head + loss ask theirs with stand-ins that put no node in the graph; the fused
# head traced as stock's calls transformers' loss itself, which asks no question: nothing beyond stock's there)
EXTRA = collections.Counter(reshape=2)


@needs_hf
@pytest.mark.parametrize("family,lce", [("llama", False), ("mistral", False), ("qwen2", False), ("qwen3", False),
                                        ("gemma", False), ("llama", True), ("qwen3", True)])
def test_a_patched_training_step_traces_stock_graph(family, lce):
    model = tiny(family).train()
    stock = copy.deepcopy(model)
    report = tiered_ops.patch(model, ops=PATCHABLE_OPS if lce else OPS, fuse_residual=True)
    assert any("fused_add_rms_norm" in s.replacement for s in report.swapped), str(report)
    assert any("cross_entropy" in s.replacement for s in report.swapped if s.path == ""), str(report)
    assert any(LM_HEAD_ROUTE in s.replacement for s in report.swapped) is lce, str(report)
    ids = torch.randint(0, 128, (2, 8))
    want, ref = _calls(stock, ids)
    torch._dynamo.reset()
    got, loss = _calls(model, ids)
    extra, missing = got - want, want - got
    assert not missing and extra == (collections.Counter() if lce else EXTRA), (extra, missing)
    assert not any("_assert_async" in k for k in got)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    grads = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=0, msg=name)


@needs_hf
def test_a_kernel_decision_traces_the_op(monkeypatch):
    """A trace whose decision names another tier than the decomposition calls the op (here a stand-in tier that
    counts its calls), not the original code."""
    spec = get_op("rms_norm")
    called = []
    eager = spec.impls["eager"]
    other = Impl("other", Tier.TRITON, lambda *a, **k: called.append(1) or eager.fn(*a, **k), (spec.source,))
    monkeypatch.setattr(spec, "impls", {"eager": eager, "other": other})
    real = dispatch.trace_plan
    monkeypatch.setattr(dispatch, "trace_plan", lambda key, described: ("other", False) if key[0] == "rms_norm"
                        else real(key, described))
    model = tiny("llama").eval()
    stock = copy.deepcopy(model)
    tiered_ops.patch(model, ops=["rms_norm"])
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
        want = stock(ids).logits
    assert len(called) == 5  # two norms per layer and the final one, each traced once
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _kernel_decision(op: str, monkeypatch) -> tuple[list, set, list]:
    """A trace of ``op`` decides a kernel ("other": the eager tier, counting its calls) instead of its decomposition;
    returns the calls, the keys the trace plan was asked with, and the ops ``decomposes`` was asked about."""
    spec = get_op(op)
    called = []
    eager = spec.impls["eager"]
    other = Impl("other", Tier.TRITON, lambda *a, **k: called.append(1) or eager.fn(*a, **k), (spec.source,))
    monkeypatch.setattr(spec, "impls", {"eager": eager, "other": other})
    real, asked = dispatch.trace_plan, set()

    def plan(key: tuple, described: tuple) -> tuple[str, bool] | None:
        if key[0] != op:
            return real(key, described)
        asked.add(key)
        return "other", False

    monkeypatch.setattr(dispatch, "trace_plan", plan)
    questions, real_question = [], dispatch.plan_decomposes
    monkeypatch.setattr(dispatch, "plan_decomposes", lambda key, described: questions.append(key[0]) or
                        real_question(key, described))
    return called, asked, questions


@needs_hf
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_kernel_decision_for_qk_norm_rope_traces_the_op(train, monkeypatch):
    """Qwen3's attention asks its question before the projections run, with stand-ins for q and k: the key it asks
    with is the key of the op's own call (one key per layer shape, whatever asked), so a decision for a kernel there
    traces the rewrite and calls the op, once per layer."""
    called, asked, questions = _kernel_decision("qk_norm_rope", monkeypatch)
    model = tiny("qwen3").train(train)
    stock = copy.deepcopy(model)
    tiered_ops.patch(model, ops=["qk_norm_rope"])
    ids = torch.randint(0, 128, (2, 8))
    with torch.set_grad_enabled(train):
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
        want = stock(ids).logits
    assert len(called) == 2  # one attention per layer, each traced once
    assert questions.count("qk_norm_rope") == 2, questions
    assert len(asked) == 1 and next(iter(asked))[-2] is train, asked  # the question's key is the call's
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if train:
        got.sum().backward()
        want.sum().backward()
        grads = dict(stock.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@needs_hf
def test_a_kernel_decision_for_the_fused_loss_traces_the_op(monkeypatch):
    """With the LM head + loss fused, a decision for a kernel of linear_cross_entropy traces the fused route (the op
    called once, no logits), and the loss and gradients match stock's."""
    called, asked, questions = _kernel_decision("linear_cross_entropy", monkeypatch)
    model = tiny("llama").train()
    stock = copy.deepcopy(model)
    tiered_ops.patch(model, ops=["linear_cross_entropy"])
    ids = torch.randint(0, 128, (2, 8))
    out = torch.compile(lambda m, x: m(x, labels=x), fullgraph=True, backend="aot_eager")(model, ids)
    want = stock(ids, labels=ids)
    assert len(called) == 1 and out.logits is None
    assert questions.count("linear_cross_entropy") == 1 and len(asked) == 1, (questions, asked)  # the call's key
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    grads = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@needs_hf
def test_qwen3_under_autocast_traces_stock_attention(monkeypatch):
    """Under autocast q and k come out in autocast's dtype, which float32 norm weights do not match (the op is not
    called): the attention traces stock's forward, in one graph, with the eager patched model's outputs, also where
    the op's decision (for the float32 hidden states' key) is a kernel."""
    real = dispatch.trace_plan
    monkeypatch.setattr(dispatch, "trace_plan", lambda key, described: ("other", False)
                        if key[0] == "qk_norm_rope" else real(key, described))
    model = tiny("qwen3").eval()
    stock = copy.deepcopy(model)
    tiered_ops.patch(model, ops=["qk_norm_rope"])
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = _fx_calls(stock, ids)
        torch._dynamo.reset()
        got, out = _fx_calls(model, ids)
        ref = model(ids).logits
    assert got == want, "\n".join(difflib.unified_diff(want, got, lineterm="", n=0))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _fx_calls(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """The FX calls of dynamo's one graph of an inference call, in order, and its logits."""
    graphs = []
    out = torch.compile(model, fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm.forward)(ids).logits
    assert len(graphs) == 1
    return [str(n.target) for n in graphs[0].graph.nodes
            if n.op in ("call_function", "call_method", "call_module")], out


def test_outside_a_trace_the_question_is_never_asked():
    x = torch.randn(4, 64)
    assert (tracing() and tiered_ops.rms_norm.decomposes(x, (64,))) is False


@needs_hf
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_inductors_code_for_a_training_step_is_stocks_on_the_gpu(family, dtype, monkeypatch, caplog):
    """No decision (the eager tier everywhere): Inductor's output code for the patched model's training step is the
    stock model's, line for line once hashes and paths are left out (``benchmarks/compiled_graphs.normalized``). A
    failure shows what each traced op was decided on (the call path's INFO lines)."""
    import logging
    import sys
    from pathlib import Path

    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.compiled_graphs import normalized

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # each compile writes its code
    caplog.set_level(logging.INFO, logger="tiered_ops")
    model = tiny(family).to("cuda", dtype).train()
    stock = copy.deepcopy(model)
    tiered_ops.patch(model, ops=OPS, fuse_residual=True)
    ids = torch.randint(0, 128, (2, 64), device="cuda")

    def code(m: torch.nn.Module) -> list[str]:
        torch._dynamo.reset()
        step = torch.compile(lambda x: m(x, labels=x).loss, fullgraph=True)
        _, codes = run_and_get_code(lambda: step(ids).backward())
        return normalized("\n".join(codes))

    want, got = code(stock), code(model)
    assert got == want, "\n".join(difflib.unified_diff(want, got, lineterm="", n=0))


def test_the_compile_tier_leaves_the_process_donated_buffers_on():
    """The compile tier's backward replays from a retained graph (the bwd timing): donated buffers are off for its
    own compile, not for the process, so a model compiled after ``tune`` keeps stock's buffer reuse."""
    import torch._functorch.config as fcfg

    before = fcfg.donated_buffer
    x = torch.randn(8, 64, requires_grad=True)
    out = get_op("rms_norm").impls["compile"].fn(x, (64,))
    dy = torch.randn_like(out)
    first = torch.autograd.grad(out, x, dy, retain_graph=True)[0]
    again = torch.autograd.grad(out, x, dy, retain_graph=True)[0]
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    want = torch.autograd.grad(torch.nn.functional.rms_norm(x, (64,)), x, dy)[0]
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
    assert fcfg.donated_buffer == before is True
