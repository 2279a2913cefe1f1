"""Call contexts: who launches the op (a Python caller, a torch.compile graph, a CUDA-graph replay) is part of the
decision's key, each context is priced as it pays, and the CLI and select_backend take it."""

from __future__ import annotations

import pytest
import torch

import tiered_ops
from tiered_ops.cli.cli import main
from tiered_ops.decide import decide, table
from tiered_ops.decide.choice import _decide, in_context, measured_compiled
from tiered_ops.runtime import memo


def _row(impl: str, p50: float, host: float, device_key: str = "cuda-NVIDIA H100") -> dict:
    return dict(impl=impl, tier=impl, ok=1, caller_us=max(p50, host), p50_us=p50, p20_us=0.9 * p50, p80_us=1.1 * p50,
                host_us=host, host_p80_us=1.1 * host, device_key=device_key)


def test_graphed_and_compiled_callers_pay_kernel_time_and_eager_pays_the_launch_path():
    rows = [_row("triton", p50=10.0, host=60.0), _row("eager", p50=30.0, host=12.0)]
    eager, why = in_context(rows, "eager")
    assert eager is rows and why == ""
    priced, why = in_context(rows, "graphed")
    assert [r["caller_us"] for r in priced] == [10.0, 30.0] and "graphed" in why
    assert all(r["host_us"] is None for r in priced)  # the tie range is the kernel's alone
    assert [r["caller_us"] for r in rows] == [60.0, 30.0]  # the stored rows are left as measured


def test_a_compiled_caller_without_its_own_measurement_takes_a_traced_tier():
    """A kernel tier's time alone says nothing of what Inductor's fusion of the op with its neighbours saves (measured
    inside compiled callers a traced tier is the fastest nearly everywhere): without such a measurement the traced
    tiers' rows are the candidates, by kernel time; where none has a row, every row."""
    rows = [_row("triton", p50=10.0, host=60.0), _row("eager", p50=30.0, host=12.0), _row("compile", 25.0, 40.0)]
    priced, why = in_context(rows, "compiled")
    assert [(r["impl"], r["caller_us"]) for r in priced] == [("eager", 30.0), ("compile", 25.0)]
    assert "traced into its graph" in why
    priced, why = in_context(rows[:1], "compiled")
    assert [r["impl"] for r in priced] == ["triton"] and "kernel times" in why


@pytest.mark.parametrize("mode", ["fwd+bwd", "bwd", "fwd"])
def test_a_compiled_training_caller_pays_kernel_time_and_inference_the_caller_time(mode):
    """Measured around one op, a compiled fwd+bwd's host figure is the graph's own work (hundreds of us), which a
    training step pays once per graph, not per op: training is priced by kernel time, inference as measured."""
    rows = [_row("triton", p50=92.0, host=493.0), _row("eager", p50=63.0, host=627.0)]
    priced, why = measured_compiled(rows, mode)
    assert [(r["impl"], r["caller_us"]) for r in priced] == [("triton", 92.0), ("eager", 63.0)]
    assert "by kernel time" in why and all(r["host_us"] is None for r in priced)
    inference, why = measured_compiled(rows, "fwd_nograd")
    assert inference is rows and "by kernel time" not in why


def test_a_compiled_training_decision_takes_the_faster_kernel_over_the_lighter_host():
    from tiered_ops.registry import METHOD_VERSION
    from tiered_ops.store.store import open_store

    spec = tiered_ops.get_op("rms_norm")
    rows = [dict(_row(i, p50=p, host=h), source_hash=spec.impls[i].source_hash, method=METHOD_VERSION, rel_error=0.0)
            for i, p, h in [("eager", 92.0, 493.0), ("compile", 63.0, 627.0)]]
    for r in rows:
        r["p20_us"], r["p80_us"], r["host_p80_us"] = 0.98 * r["p50_us"], 1.02 * r["p50_us"], 1.02 * r["host_us"]
    store = open_store(":memory:")

    def pick(mode: str) -> tuple[str, str]:
        impl, reason, _ = _decide(spec, measured_compiled(rows, mode)[0], torch.float32, torch.device("cpu"),
                                  "fastest", None, store)
        return impl.name, reason

    (train, why_train), (infer, why_infer) = pick("fwd+bwd"), pick("fwd_nograd")
    assert (train, infer) == ("compile", "eager"), (why_train, why_infer)
    assert "63.0" in why_train and "493.0" in why_infer


def test_a_cpu_row_keeps_its_time_in_every_context():
    rows = [_row("eager", p50=30.0, host=12.0, device_key="cpu-x86_64")]
    assert in_context(rows, "graphed")[0][0]["caller_us"] == 30.0


def test_select_backend_takes_a_context_and_records_it(private_decisions):
    for ctx in ("eager", "compiled", "graphed"):
        sel = tiered_ops.select_backend("softmax", (4, 8), "fp32", "cpu", context=ctx)
        assert sel.record["context"] == ctx


def test_an_unknown_context_is_rejected_by_name(private_decisions):
    with pytest.raises(ValueError, match="context: expected one of eager, compiled, graphed, got 'jit'"):
        tiered_ops.select_backend("softmax", (4, 8), "fp32", "cpu", context="jit")


def test_the_cli_select_takes_a_context(private_decisions, capsys):
    assert main(["select", "softmax", "4x8", "--device", "cpu", "--no-tune", "--context", "graphed"]) == 0
    assert "fwd_nograd graphed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["select", "softmax", "4x8", "--device", "cpu", "--context", "jit"])


def test_an_eager_call_is_keyed_as_eager_and_decides_every_context_at_once(private_decisions):
    decide.clear_cache()
    x = torch.randn(3, 17)
    torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x.double(), -1).float())
    assert [k[-1] for k in memo._calls if k[0] == "softmax"] == [0, 1]  # the compiled one cached for a trace
    contexts = {k[-1] for k in table.current() if k[0] == "softmax"}
    assert contexts == {"eager", "compiled", "graphed"}  # a compiled region finds its decision at trace time


def test_a_compiled_caller_is_detected_and_traced_without_a_graph_break(private_decisions):
    decide.clear_cache()
    x = torch.randn(3, 17)
    tiered_ops.softmax(x, -1)  # decided outside the graph first

    def f(t: torch.Tensor) -> torch.Tensor:
        return tiered_ops.softmax(t * 2, -1) + 1

    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), torch.softmax(2 * x.double(), -1).float() + 1)


def test_a_select_backend_callable_is_traced_without_a_graph_break(private_decisions):
    sel = tiered_ops.select_backend("softmax", (3, 17), torch.float32, "cpu", dim=-1)
    x = torch.randn(3, 17)
    sel(x, -1)  # a signature it knows in eager

    def f(t: torch.Tensor) -> torch.Tensor:
        return sel(t * 2, -1) + 1

    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x),
                               torch.softmax(2 * x.double(), -1).float() + 1)


def test_a_compiled_context_decision_measures_the_op_inside_a_compiled_caller(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_OPS_DB", str(tmp_path / "compiled.sqlite"))
    monkeypatch.setenv("TIERED_OPS_CONTENTION_CHECK", "0")
    store = decide.use_store(None)
    try:
        sel = tiered_ops.select_backend("gelu", (8, 64), "fp32", "cpu", context="compiled")
        assert "compiled caller (measured in a compiled function amid its decoder neighbours" in sel.record["reason"]
        rows = store.rows(op="gelu", context="compiled")
        assert {r["impl"] for r in rows if r["ok"]} >= {"eager", "compile"}
        assert all(r["context"] == "compiled" and r["gbps"] is None for r in rows)  # the neighbours move bytes too
        assert not [r for r in store.rows(op="gelu") if r["context"] == "compiled"]  # an eager query sees none
        eager = tiered_ops.select_backend("gelu", (8, 64), "fp32", "cpu")
        assert "compiled caller" not in eager.record["reason"]
    finally:
        decide.use_store(None)


@pytest.mark.parametrize("first", ["eager call", "tune"])
def test_a_compiled_caller_compiles_once_whatever_decided_first(private_decisions, first):
    """An eager call, and tune for the signatures its step recorded, cache the compiled context's selection of each
    call signature: a trace finds it (its guards: one lookup). A trace caches nothing itself: its miss would fail its
    guard on the key's absence (every patched model recompiled once after tune). Eager calls of the same signature
    between compiled calls change none of its guards."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    decide.clear_cache()
    torch._dynamo.reset()
    x, w = torch.randn(3, 16), torch.randn(16)

    def f(t: torch.Tensor) -> torch.Tensor:
        return tiered_ops.rms_norm(t + 1, (16,), w) * 2

    if first == "eager call":
        tiered_ops.rms_norm(x + 1, (16,), w)  # decides every context
    else:
        module = torch.nn.Module()
        module.forward = f
        report = tiered_ops.tune(module, (x,), context="compiled")
        assert [c.call.op for c in report.calls] == ["rms_norm"]
    assert [k[-1] for k in memo._calls if k[0] == "rms_norm"] == ([0, 1] if first == "eager call" else [1])
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for _ in range(3):
        torch.testing.assert_close(compiled(x), f(x))  # f(x): an eager call of the same signature each time
    # f's own compiled entries, not the process's graph count: tune's measurements (and a worker thread an earlier
    # test left) compile graphs of their own, which made a global count read 2 in some full-suite runs
    assert len(_debug_get_cache_entry_list(f.__code__)) == 1


def test_call_sites_of_one_implementation_add_no_aliasing_guard(private_decisions, monkeypatch):
    """Two call signatures that run one implementation, a callable object (as the compile tier's is): a trace reaches
    it by its name in one table, so dynamo adds no guard that the two signatures' objects are one, a guard that
    rebuilt both keys (tuples of sizes and dtypes) in Python at every call of the compiled caller. A changed name
    fails its guard: the caller is traced again."""
    import dataclasses

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tiered_ops.runtime.hot import _TRACE_FNS
    from tiered_ops.tiers.catalog import get_op

    eager = get_op("rms_norm").impls["eager"]

    class Shared:
        def __call__(self, *args, **kwargs):
            return eager.fn(*args, **kwargs)

    monkeypatch.setitem(get_op("rms_norm").impls, "eager", dataclasses.replace(eager, unchecked=Shared()))
    decide.clear_cache()
    torch._dynamo.reset()
    w1, w2 = torch.randn(16), torch.randn(32)
    a, b = torch.randn(3, 16), torch.randn(5, 32)

    def f(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return tiered_ops.rms_norm(p, (16,), w1).sum() + tiered_ops.rms_norm(q, (32,), w2).sum()

    f(a, b)  # eager calls (nothing stored: eager): both signatures decided, their compiled context's cached
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(a, b), f(a, b))
    guards = str(_debug_get_cache_entry_list(f.__code__)[0].guard_manager).splitlines()
    assert not [g for g in guards if "LAMBDA_GUARD" in g and "_calls" in g], [g[:200] for g in guards if "_calls" in g]
    traced = {k: v for k, v in memo._traced.items() if k[0] == "rms_norm" and v is not None}  # None: unprimed
    assert len(traced) == 2 and len(set(traced.values())) == 1, traced
    key = next(iter(traced))  # the first call site's signature
    _TRACE_FNS["rms_norm:planted"] = lambda *args, **kwargs: torch.zeros(3, 16)
    memo._traced[key] = "rms_norm:planted"
    torch.testing.assert_close(compiled(a, b), tiered_ops.rms_norm(b, (32,), w2).sum())
    assert len(_debug_get_cache_entry_list(f.__code__)) == 2


def test_tuning_another_model_leaves_a_compiled_caller_as_it_was_compiled(private_decisions):
    """tune clears the caches to record its step; the selections whose decision it leaves unchanged come back as the
    same objects, so a caller compiled before it does not recompile (its guards read them)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    decide.clear_cache()
    torch._dynamo.reset()
    x, w, y = torch.randn(3, 16), torch.randn(16), torch.randn(5, 32)

    def f(t: torch.Tensor) -> torch.Tensor:
        return tiered_ops.rms_norm(t + 1, (16,), w) * 2

    first, other = torch.nn.Module(), torch.nn.Module()
    first.forward = f
    other.forward = lambda t: tiered_ops.softmax(t, -1)
    tiered_ops.tune(first, (x,), context="compiled")
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    compiled(x)
    tiered_ops.tune(other, (y,), context="compiled")
    assert len(_debug_get_cache_entry_list(f.__code__)) == 1
    for _ in range(2):
        torch.testing.assert_close(compiled(x), f(x))
    # f's own compiled entries, not the process's graph count: f(x) runs the eager context's choice, which may be the
    # compile tier where the stored timings favour it (a graph of its own, compiled on its first call)
    assert len(_debug_get_cache_entry_list(f.__code__)) == 1  # no recompile
    assert {k[0] for k in table.current()} >= {"rms_norm", "softmax"}  # the first tune's decisions kept


def test_a_publication_during_a_trace_leaves_its_guards_buildable(private_decisions):
    """Background tuning publishes from its own thread while dynamo traces: a publication that drops a decision the
    trace read must not leave dynamo a guard it cannot build (a KeyError in the call path's memo), only a retrace."""
    decide.clear_cache()
    torch._dynamo.reset()
    x, w = torch.randn(3, 16), torch.randn(16)

    def f(t: torch.Tensor) -> torch.Tensor:
        return tiered_ops.rms_norm(t, (16,), w) * 2

    f(x)  # the signature primed: a trace reads its name from the memo
    assert any(k[0] == "rms_norm" and v is not None for k, v in memo._traced.items())

    def backend(gm, example):
        decide.clear_cache()  # a publication lands after the trace read the memo, before dynamo builds its guards
        return gm.forward

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), f(x))
    torch.testing.assert_close(compiled(x), f(x))


def test_a_compiled_caller_gives_each_op_its_decoder_neighbours(monkeypatch):
    from tiered_ops.measure import measure

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the caller's own code, not its compilation
    seen = []

    def op(x, *rest, **kw):
        seen.append(x)
        return x + 1

    x = torch.ones(3)
    # GEMM-fed: the op reads the caller's input and its output is the caller's (nothing for a traced tier to fold in)
    assert torch.equal(measure.in_compiled_caller(op, "cross_entropy")(x), x + 1) and seen[-1] is x
    # a norm: the residual add before it (folded into a traced norm), a GEMM after it
    assert torch.equal(measure.in_compiled_caller(op, "rms_norm")(x), x * 0.5 + 1) and seen[-1] is not x
    # softmax, and an op the table does not name: pointwise on both sides
    for name in ("softmax", "segment_sum"):
        assert torch.equal(measure.in_compiled_caller(op, name)(x), (x * 0.5 + 1) * 2)
    assert set(measure.DECODER_NEIGHBOURS) <= set(tiered_ops.registry.OPS)


def test_a_compiled_context_row_of_the_earlier_method_is_measured_again():
    from tiered_ops.method import COMPILED_METHOD_VERSION, CONTEXT_METHODS, METHOD_VERSION
    from tiered_ops.store.store import open_store

    assert CONTEXT_METHODS == {"compiled": COMPILED_METHOD_VERSION} and COMPILED_METHOD_VERSION != METHOD_VERSION
    spec = tiered_ops.get_op("gelu")
    impl = spec.impls["eager"]
    base = dict(op="gelu", impl="eager", tier="eager", mode="fwd_nograd", problem="8x64", bucket="[8,64]",
                dtype="fp32", device_key="cpu-test", source_hash=impl.source_hash, ok=1, p50_us=1.0)
    store = open_store(":memory:")
    store.add([dict(base, context="eager"), dict(base, context="compiled")])  # measured here: the current methods
    rows = store.rows() + store.rows(context="compiled")  # an eager query sees the eager row alone
    assert {(r["context"], r["method"]) for r in rows} == {("eager", METHOD_VERSION),
                                                           ("compiled", COMPILED_METHOD_VERSION)}
    assert all(spec.fresh_impl(r) is impl for r in rows)
    old = dict(base, context="compiled", method=METHOD_VERSION)  # a compiled row of the pointwise-neighbours method
    assert spec.fresh_impl(old) is None and spec.fresh_impl(dict(old, context="eager")) is impl
