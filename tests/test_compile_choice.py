"""TIERED_OPS_COMPILE_CHOICE=inductor: Inductor's custom-op autotuning chooses among an op's tiers inside
torch.compile (``tiered_ops/decide/inductor_choice.py``). On the CPU its choices are the plain-torch tiers and the
fallback (the Triton interpreter and the CUDA tier cannot be timed here); the GPU tests time the kernel tiers too."""

import copy
import logging
import math

import pytest
import torch
from torch._dynamo.utils import counters

import tiered_ops
from tiered_ops.decide import decide as select
from tiered_ops.decide import inductor_choice
from tiered_ops.tiers.catalog import get_op

needs_api = pytest.mark.skipif(inductor_choice.unavailable() is not None,
                               reason=f"{inductor_choice.unavailable()}")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def inductor_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERED_OPS_COMPILE_CHOICE", "inductor")
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # Inductor autotunes afresh


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 32), torch.nn.LayerNorm(32)).eval()


def _check_model(device: str) -> None:
    model = _model().to(device)
    stock = copy.deepcopy(model).double()
    tiered_ops.patch(model)
    x = torch.randn(24, 48, device=device)
    with torch.no_grad():
        y = torch.compile(model, fullgraph=True)(x)
        ref = stock(x.double())
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=2e-5)


def test_the_default_is_the_table(monkeypatch):
    monkeypatch.delenv("TIERED_OPS_COMPILE_CHOICE", raising=False)
    assert not inductor_choice.routed(get_op("layer_norm"), "fwd_nograd", False)
    monkeypatch.setenv("TIERED_OPS_COMPILE_CHOICE", "fastest")
    with pytest.raises(ValueError, match="TIERED_OPS_COMPILE_CHOICE"):
        inductor_choice.routed(get_op("layer_norm"), "fwd_nograd", False)


@needs_api
def test_training_and_several_outputs_keep_the_table(inductor_mode):
    assert inductor_choice.routed(get_op("rms_norm"), "fwd_nograd", False)
    assert not inductor_choice.routed(get_op("rms_norm"), "fwd+bwd", False)
    assert not inductor_choice.routed(get_op("rms_norm"), "fwd_nograd", True)  # a dtype promotion
    assert not inductor_choice.routed(get_op("fused_add_rms_norm"), "fwd_nograd", False)


def test_the_call_string_round_trips():
    args = dict(normalized_shape=(4, 8), eps=None, weight_offset=1.0, label_smoothing=math.inf,
                dtype=torch.bfloat16, reduction="mean", cast_before_weight=True, dim=-1)
    assert inductor_choice.decode(inductor_choice.encode(args)) == args


def test_the_winner_follows_torchs_rule():
    timings = {"eager": 2.0, "triton": 1.0, inductor_choice.FALLBACK: 1.05}
    assert inductor_choice.winner(timings, 1.0) == "triton"
    assert inductor_choice.winner(timings, 1.1) == inductor_choice.FALLBACK  # 1.05x is not enough
    assert inductor_choice.winner(dict(timings, triton=0.5), 1.1) == "triton"


@needs_api
@pytest.mark.parametrize("op", ["rms_norm", "softmax", "layer_norm", "gelu", "muladd"])
def test_the_choice_op_registers_and_passes_opcheck(op):
    spec = get_op(op)
    choice = inductor_choice.register(spec)
    assert inductor_choice.register(spec) is choice  # once per op
    inp = spec.make_inputs(spec.problem((6, 16)), torch.float32, torch.device("cpu"), 0)
    given = dict(zip(inductor_choice._POSITIONAL[op], inp.args)) | inp.kwargs
    names = inductor_choice.tensor_args(spec)[0]
    tensors = [given[n] for n in names]
    call = inductor_choice.encode({k: v for k, v in given.items() if k not in names})
    out = choice(*tensors, call=call)
    ref = spec.reference(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                           for a in inp.args], **inp.kwargs)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.library.opcheck(choice, (*tensors,), dict(call=call), test_utils=("test_schema", "test_faketensor"))


@needs_api
def test_a_patched_model_compiles_in_one_graph_and_stores_inductors_choice(inductor_mode, caplog):
    caplog.set_level(logging.INFO, logger="tiered_ops")
    before = inductor_choice.chosen()
    _check_model("cpu")
    new = {k: v for k, v in inductor_choice.chosen().items() if k not in before}
    assert {k[0] for k in new} == {"layer_norm", "gelu"}, new
    assert "Inductor chose" in caplog.text
    # the choice is the compiled context's decision now, for this process and the next (the store)
    problem = get_op("layer_norm").problem((24, 64), normalized_shape=(64,), weight=True, bias=True)
    sel = tiered_ops.select_backend("layer_norm", (24, 64), "fp32", "cpu", tune=False, context="compiled",
                                    normalized_shape=(64,), weight=True, bias=True)
    assert sel.name == new[("layer_norm", str(problem), "fp32", "cpu")]
    assert sel.record["reason"].startswith("compiled caller (measured"), sel.record["reason"]
    rows = select.get_store().rows(op="layer_norm", context="compiled", problem=str(problem))
    assert {r["origin"] for r in rows} == {inductor_choice.ORIGIN}
    assert [r["impl"] for r in rows if r["ok"]] == [sel.name]  # the winner alone gated


def test_a_torch_without_the_api_keeps_the_table(inductor_mode, monkeypatch, caplog):
    monkeypatch.setattr(inductor_choice, "_why_not", ["torch 2.0 has no Inductor custom-op autotuning (test)"])
    monkeypatch.setattr(inductor_choice, "_told", False)
    caplog.set_level(logging.INFO, logger="tiered_ops")
    before = inductor_choice.chosen()
    _check_model("cpu")
    assert inductor_choice.chosen() == before
    told = [r for r in caplog.records if "TIERED_OPS_COMPILE_CHOICE=inductor" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.INFO, [r.getMessage() for r in told]


@pytest.mark.gpu
@needs_api
@pytest.mark.parametrize("op,shape", [("rms_norm", (4096, 4096)), ("softmax", (4096, 8192))])
def test_inductor_times_the_kernel_tiers_on_a_gpu(inductor_mode, caplog, op, shape):
    """On a GPU the kernel tiers are among the choices (timed: a row each), and the compiled result is correct."""
    caplog.set_level(logging.INFO, logger="tiered_ops")
    dev = torch.device("cuda")
    x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    w = torch.randn(shape[-1], device=dev, dtype=torch.bfloat16)
    if op == "rms_norm":
        def fn(x):
            return tiered_ops.rms_norm(x * 2.0, (shape[-1],), w) + 1.0
        ref = torch.nn.functional.rms_norm(x.double() * 2.0, (shape[-1],), w.double()) + 1.0
    else:
        def fn(x):
            return tiered_ops.softmax(x * 0.5, -1) * 2.0
        ref = torch.softmax(x.double() * 0.5, -1) * 2.0
    with torch.no_grad():
        y = torch.compile(fn, fullgraph=True)(x)
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=2e-2)
    rows = select.get_store().rows(op=op, context="compiled")
    timed = {r["impl"] for r in rows if r["caller_us"] is not None}
    assert "triton" in timed, [(r["impl"], r["reason"]) for r in rows]
    assert sum(r["ok"] for r in rows) == 1, [(r["impl"], r["ok"], r["reason"]) for r in rows]
