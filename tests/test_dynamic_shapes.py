"""torch.compile with dynamic shapes: a caller compiled once for a dimension that varies (a sequence length, a batch)
keeps one graph for the shapes of one bucket (the torch ops tiered_ops stands in for keep one for every shape)."""

from __future__ import annotations

import pytest
import torch
from helpers import builtin_ops
from torch._dynamo.utils import counters

import tiered_ops

ROWS = (17, 20, 25, 31)  # one bucket: rows round up to 32


def _graphs(fn, dynamic: bool | None) -> int:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="eager", dynamic=dynamic)
    for n in ROWS:
        x = torch.randn(n, 64)
        fn(x)  # in eager first: the decision exists before the trace
        compiled(x)
    torch._dynamo.reset()
    return counters["stats"]["unique_graphs"]


def _stock(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (64,), torch.ones(64), torch.zeros(64)) * 2


def _tiered(x: torch.Tensor) -> torch.Tensor:
    return tiered_ops.layer_norm(x, (64,), torch.ones(64), torch.zeros(64)) * 2


def test_the_torch_op_keeps_one_graph_for_a_varying_dimension(private_decisions):
    assert _graphs(_stock, True) == 1
    assert _graphs(_stock, None) == 2  # static first, then dynamic on the first recompile (automatic_dynamic_shapes)


def test_a_tiered_op_keeps_one_graph_for_a_varying_dimension(private_decisions):
    assert _graphs(_tiered, True) == 1


def test_a_bucket_decided_later_leaves_a_dynamic_graph_alone(private_decisions):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_tiered, backend="eager", dynamic=True, fullgraph=True)
    for n in ROWS[:2]:
        x = torch.randn(n, 64)
        _tiered(x)
        compiled(x)
    _tiered(torch.randn(100, 64))  # another bucket of the op, and another op, decided in eager
    tiered_ops.softmax(torch.randn(8, 64), -1)
    compiled(torch.randn(ROWS[2], 64))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("op", sorted(s.name for s in builtin_ops()))
def test_every_op_keeps_one_graph_for_a_varying_leading_dimension(private_decisions, op):
    from tiered_ops.tiers.catalog import get_op

    spec, fn = get_op(op), getattr(tiered_ops, op)
    base = spec.default_problems("cpu")[0]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda *a, **k: fn(*a, **k), backend="eager", dynamic=True, fullgraph=True)
    for n in ROWS:
        inp = spec.make_inputs(spec.problem((n, *base.shape[1:]), **base.kw), torch.float32, torch.device("cpu"), n)
        want, got = fn(*inp.args, **inp.kwargs), compiled(*inp.args, **inp.kwargs)
        for w, g in zip(*(o if isinstance(o, tuple) else (o,) for o in (want, got))):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("tier", [None, "triton"])
def test_a_dynamic_trace_trains_through_the_chosen_tier(private_decisions, monkeypatch, tier):
    """fwd+bwd under dynamic shapes: one graph for the bucket, the output and gradients of F.layer_norm's."""
    from test_patch import force_tier

    if tier:
        force_tier(monkeypatch, tier)
    w, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return tiered_ops.layer_norm(x, (64,), w, b)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend="eager", dynamic=True, fullgraph=True)
    for n in ROWS:
        x = torch.randn(n, 64, dtype=torch.float64).float().requires_grad_()
        f(x.detach().requires_grad_())  # the decision, in eager
        dy = torch.randn(n, 64)
        out = compiled(x)
        got = torch.autograd.grad(out, (x, w, b), dy)
        xr = x.detach().requires_grad_()
        ref = torch.nn.functional.layer_norm(xr, (64,), w, b)
        want = torch.autograd.grad(ref, (xr, w, b), dy)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_patched_model_keeps_one_graph_for_a_varying_sequence(private_decisions, family):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from test_patch import tiny

    model = tiny(family)
    tiered_ops.patch(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for n in ROWS:
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            eager = model(ids).logits  # decisions exist before the trace
            torch.testing.assert_close(compiled(ids).logits, eager, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_patched_model_trains_with_a_varying_sequence_in_one_graph(private_decisions, family):
    """Residual pairs fused and the loss routed: the loss and the gradients of the eager patched model, one graph."""
    pytest.importorskip("transformers")
    from test_patch import tiny

    model = tiny(family)
    tiered_ops.patch(model, fuse_residual=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend="eager", dynamic=True,
                             fullgraph=True)
    params = [p for p in model.parameters() if p.requires_grad]
    for n in ROWS:
        ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
        want = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, params)
        loss = compiled(ids)
        got = torch.autograd.grad(loss, params)
        torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["triton", "cuda"])
def test_a_compiled_model_on_the_gpu_keeps_one_graph_per_bucket(private_decisions, monkeypatch, tier):
    """Inductor, bf16, each custom tier forced: the chosen kernel traces with a symbolic sequence length."""
    pytest.importorskip("transformers")
    from test_patch import force_tier, tiny

    force_tier(monkeypatch, tier, "cuda")
    model = tiny("llama").to("cuda", torch.bfloat16)
    tiered_ops.patch(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for n in ROWS:
            ids = torch.randint(0, 128, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
            eager = model(ids).logits.float()
            got = compiled(ids).logits.float()
            assert (got - eager).abs().max().item() <= 0.05 * eager.abs().max().item()
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_tuning_another_model_leaves_a_dynamic_graph_alone(private_decisions):
    """tune clears the caches to record its step; the buckets its recorded signatures prime come back with the same
    names, so a caller compiled with dynamic shapes before it does not recompile."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    w = torch.randn(16)

    def f(t: torch.Tensor) -> torch.Tensor:
        return tiered_ops.rms_norm(t + 1, (16,), w) * 2

    first, other = torch.nn.Module(), torch.nn.Module()
    first.forward = f
    other.forward = lambda t: tiered_ops.softmax(t, -1)
    tiered_ops.tune(first, (torch.randn(ROWS[0], 16),), context="compiled")
    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=True)
    compiled(torch.randn(ROWS[0], 16))
    tiered_ops.tune(other, (torch.randn(5, 32),), context="compiled")
    for n in ROWS[1:]:
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x), f(x))
    assert len(_debug_get_cache_entry_list(f.__code__)) == 1  # no recompile


@pytest.mark.parametrize("class_tells", [True, False], ids=["class", "max"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_traced_size_is_symbolic_only_where_dynamo_keeps_it_so(class_tells, dynamic, monkeypatch):
    """``symbolic_size`` while dynamo traces: False for every size of a static trace, True for a dynamic dimension;
    both ways of asking (the size's class where dynamo tells it, ``max(d, 0)`` where it does not: torch before 2.13
    gave a static size's class as "not int", and a static trace then took every size for symbolic)."""
    from tiered_ops import registry

    if class_tells and not registry._CLASS_TELLS:
        pytest.skip(f"torch {torch.__version__}'s dynamo gives a static size's class as not int")
    monkeypatch.setattr(registry, "_CLASS_TELLS", class_tells)
    seen: list[list[bool]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append([registry.symbolic_size(d) for d in x.shape])
        return x + 1

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True, dynamic=dynamic)(torch.randn(5, 7))
    torch._dynamo.reset()
    assert seen == [[dynamic, dynamic]]
    assert [registry.symbolic_size(d) for d in torch.randn(5, 7).shape] == [False, False]  # outside a trace
