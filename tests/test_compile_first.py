"""A patched model compiled with no decision made: one graph, no break, under fullgraph=True, in any order of patch,
compile, tune and call; outputs as the stock model's. A trace's miss puts the eager tier into the graph and queues its
bucket for tuning (``tiered_ops/decide/compiled.py``)."""

import copy
import re
from pathlib import Path

import pytest
import torch
from test_patch import _out, needs_hf, tiny
from torch._dynamo.utils import counters

import tiered_ops
from tiered_ops.decide import background, choice, compiled, table
from tiered_ops.decide import decide as select
from tiered_ops.models.patching import PATCHABLE_OPS
from tiered_ops.registry import Impl, Tier
from tiered_ops.tiers.catalog import get_op

# the families patch supports: RMSNorm (two forms) + RoPE (qwen3: fused with its QK-norm) + SwiGLU, LayerNorm + GELU
FAMILIES = ["llama", "qwen3", "gpt2"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["decomposition", "kernel"])
def quick_tiers(request, monkeypatch):
    """Each patched op with its eager tier and one more correct one (``again``, its eager function behind another
    name: fast to measure on the CPU, traceable, and in a trace a kernel: not the decomposition), so that ``tune``
    measures no compiler tier. Which one the policy picks is set, not left to a timing between two equal functions:
    "decomposition", the eager tier (a patched module traces its original's code), or "kernel", ``again`` (the module
    traces its rewrite)."""
    for op in PATCHABLE_OPS + ("fused_add_rms_norm",):
        spec = get_op(op)
        eager = spec.impls["eager"]
        again = Impl("again", Tier.COMPILE, lambda *a, _f=eager.fn, **k: _f(*a, **k), (spec.source,))
        monkeypatch.setattr(spec, "impls", {"eager": eager, "again": again})
    wanted, real = {"decomposition": "eager", "kernel": "again"}[request.param], choice.choose

    def choose(cands, *a, **k):
        best, why, totals = real(cands, *a, **k)
        return next((c for c in cands if c["impl"] == wanted), best), why, totals

    monkeypatch.setattr(choice, "choose", choose)
    return request.param


def _queued(monkeypatch) -> list[tuple]:
    """The buckets a trace asks background tuning for (recorded, not measured)."""
    asked: list[tuple] = []

    def request(spec, problem, dtype, device, mode, context, key, impls, store, hook):
        asked.append((key, context, tuple(impls)))
        return None, background.NOT_QUEUED + "recorded by the test"

    monkeypatch.setattr(background, "request", request)
    return asked


def _model(family: str):
    model = tiny(family)
    return model, copy.deepcopy(model), torch.randint(0, 128, (2, 8))


def _stock(stock, ids) -> torch.Tensor:
    with torch.no_grad():
        return _out(stock(ids))


def _run(fn, ids, times: int = 2) -> list[torch.Tensor]:
    with torch.no_grad():
        return [_out(fn(ids)) for _ in range(times)]


def _assert_one_graph(outs: list[torch.Tensor], ref: torch.Tensor, graphs: int = 1) -> None:
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _tune(model, inputs, train: bool = False) -> None:
    """``tune`` for the compiled context: its measurements compile functions of their own, not counted here."""
    before = dict(counters["stats"])
    tiered_ops.tune(model, inputs if isinstance(inputs, dict) else (inputs,), train=train, context="compiled")
    counters["stats"].clear()
    counters["stats"].update(before)


def _compile(model):
    return torch.compile(model, fullgraph=True, backend="aot_eager")


@needs_hf
@pytest.mark.parametrize("family", [*FAMILIES, "gemma"])  # gemma: its MLP's GELU tanh through swiglu
def test_patch_compile_call_with_a_fresh_store(family, monkeypatch):
    """The natural order, nothing decided: the eager tier traced, its buckets queued for tuning, nothing measured."""
    monkeypatch.setenv("TIERED_OPS_TUNE", "1")  # blocking: what a fresh process does by default
    monkeypatch.setattr(select, "measure_kept", lambda *a, **k: pytest.fail("measured while tracing"))
    asked = _queued(monkeypatch)
    model, stock, ids = _model(family)
    tiered_ops.patch(model)
    _assert_one_graph(_run(_compile(model), ids), _stock(stock, ids))
    assert asked and {c for _, c, _ in asked} == {"compiled"}, asked
    ops = {k[0] for k, _, _ in asked}
    # gemma's MLP, with swiglu undecided, traces as the original's with its activation's own forward: no gelu asked
    want = {"gpt2": {"layer_norm", "gelu"}, "llama": {"rms_norm", "rotary_embedding", "swiglu"},
            "qwen3": {"rms_norm", "qk_norm_rope", "swiglu"}, "gemma": {"rms_norm", "rotary_embedding", "swiglu"}}
    assert ops == want[family], asked
    assert not any(k[-1] == "compiled" for k in table.current()), "a miss caches no decision"


@needs_hf
@pytest.mark.parametrize("family", [*FAMILIES, "gemma"])
def test_compile_then_patch_then_call(family, monkeypatch):
    _queued(monkeypatch)
    model, stock, ids = _model(family)
    compiled_model = _compile(model)
    tiered_ops.patch(model)
    _assert_one_graph(_run(compiled_model, ids), _stock(stock, ids))


@needs_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_tune_then_compile(family, quick_tiers, monkeypatch):
    _queued(monkeypatch)
    model, stock, ids = _model(family)
    tiered_ops.patch(model)
    _tune(model, ids)
    _assert_one_graph(_run(_compile(model), ids), _stock(stock, ids))
    assert any(k[-1] == "compiled" for k in table.current())


@needs_hf
@pytest.mark.parametrize("family", [*FAMILIES, "gemma"])  # gemma: its MLP traced as stock's calls its GELU's own code
def test_tune_after_compile(family, quick_tiers, monkeypatch):
    """Compiled, then tuned before the first call: one trace, of the tuned decisions. Tuned after a first call: the
    graph is traced again once, with them (the trace read that the signature had no decision)."""
    asked = _queued(monkeypatch)
    model, stock, ids = _model(family)
    tiered_ops.patch(model)
    compiled_model = _compile(model)
    _tune(model, ids)
    ref = _stock(stock, ids)
    _assert_one_graph(_run(compiled_model, ids), ref)
    assert asked == [], "a trace after tune found every decision"

    torch._dynamo.reset()
    counters.clear()
    tiered_ops.clear_cache()
    again = _compile(model)
    outs = _run(again, ids)
    _tune(model, ids)
    outs += _run(again, ids)
    _assert_one_graph(outs, ref, graphs=2)


def _assert_one_training_graph(loss: torch.Tensor, ref: torch.Tensor, model: torch.nn.Module,
                               stock: torch.nn.Module) -> None:
    """One graph, no break; the loss and every gradient as the stock model's (both backwards run)."""
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    grads = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@needs_hf
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_tune_after_compile_in_training(family, quick_tiers, monkeypatch):
    """A training step compiled, then tuned (fwd+bwd) before its first call, the residual add + RMSNorm and the LM
    head + loss fused too: one trace, which finds every decision it asks for. Where an op decides its decomposition,
    the module traces stock's code, and what that code calls asks only for decisions tune made: the loss of a fused
    head and Qwen3's q/k norms run their own code (the op's decision covers them); the post-attention norm of a fused
    residual asks for the input norms' rms_norm bucket (their shape, dtype and weight)."""
    asked = _queued(monkeypatch)
    model, stock, ids = _model(family)
    model.train(), stock.train()
    report = tiered_ops.patch(model, fuse_residual=True)
    assert any("linear_cross_entropy" in s.replacement for s in report.swapped if s.path == ""), str(report)

    def step(m, x):
        return m(x, labels=x).loss

    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
    _tune(model, {"input_ids": ids, "labels": ids}, train=True)
    loss = compiled_step(model, ids)
    loss.backward()
    assert asked == [], "a trace after tune found every decision"
    ref = step(stock, ids)
    ref.backward()
    _assert_one_training_graph(loss, ref, model, stock)


@needs_hf
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_a_compiled_training_step_before_any_decision(family, monkeypatch):
    """fwd+bwd: the loss and its backward through one graph, gradients as the stock model's; the loss through the
    fused LM head + loss (linear_cross_entropy: no logits)."""
    _queued(monkeypatch)
    model, stock, ids = _model(family)
    model.train(), stock.train()
    report = tiered_ops.patch(model)
    assert any("linear_cross_entropy" in s.replacement for s in report.swapped if s.path == ""), str(report)

    def step(m, x):
        return m(x, labels=x).loss

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(model, ids)
    loss.backward()
    ref = step(stock, ids)
    ref.backward()
    _assert_one_training_graph(loss, ref, model, stock)


def test_a_trace_reads_a_decision_made_before(private_decisions, two_softmaxes):
    """The compiled context's decision made by an eager call is what the trace calls, by name."""
    x = torch.randn(8, 32)
    tiered_ops.softmax(x, -1)
    sel = select.select_backend("softmax", (8, 32), torch.float32, "cpu", context="compiled")
    name = compiled.trace_choice("softmax", get_op("softmax").bucket(get_op("softmax").problem((8, 32), dim=-1)),
                                 (8, 32), (("dim", -1),), "fp32", "cpu", "fwd_nograd")
    assert name == sel.name


def test_the_constant_mark_is_torchs():
    """trace_choice carries what torch.compiler.assume_constant_result sets (set by hand: importing tiered_ops does
    not import dynamo)."""
    def probe():
        return 0

    assert vars(torch.compiler.assume_constant_result(probe)) == {"_dynamo_marked_constant": True}
    assert compiled.trace_choice._dynamo_marked_constant is True


@needs_hf
def test_the_docs_snippet_runs_as_written(monkeypatch):
    """docs/compile.md's code, run as written (Inductor on the CPU), tuning off: one graph, no break."""
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    text = (Path(__file__).resolve().parents[1] / "docs" / "compile.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    ns: dict = {}
    exec(compile(blocks[0], "docs/compile.md", "exec"), ns)  # noqa: S102 (the doc's own snippet)
    assert ns["logits"].shape == (2, 8, 128)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("dynamic", [True, None])
def test_symbolic_sizes_with_no_decision_stay_in_the_graph(private_decisions, dynamic):
    """Dynamic shapes (asked for, or dynamo's switch at a first recompile) with nothing decided: the eager tier, one
    graph per bucket of rows at most, never a break."""
    w = torch.randn(64)

    def f(x):
        return tiered_ops.rms_norm(x.sin(), (64,), w).cos()

    cf = torch.compile(f, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    for n in (5, 7, 8, 9, 30):
        x = torch.randn(n, 64)
        torch.testing.assert_close(cf(x), torch.nn.functional.rms_norm(x.sin(), (64,), w).cos())
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])  # buckets 8, 16, 32 (+ the static first)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", [64, (64,), [64], torch.Size([64])], ids=["int", "tuple", "list", "size"])
def test_a_shape_argument_in_any_form_traces_without_a_break(private_decisions, shape, device):
    """An op's shape argument as torch takes it (an int, a tuple, a list, a torch.Size) traces with fullgraph=True
    and gives eager's result. (Keyed by its class, an int went to tuple() under torch 2.11's dynamo: a break.)"""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: run scripts/gpu.sh on a GPU machine")
    x = torch.randn(8, 64, device=device)

    def f(t: torch.Tensor) -> torch.Tensor:
        return tiered_ops.rms_norm(t, shape) * 2

    got = torch.compile(f, fullgraph=True, backend="eager")(x)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(got, f(x), rtol=0, atol=0)
