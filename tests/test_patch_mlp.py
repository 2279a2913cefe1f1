"""The gated MLP rewrite (tiered_ops/models/patch_mlp.py): transformers' Llama, Mistral, Qwen2, Qwen3 (SiLU) and Gemma
(GELU tanh) MLPs through tiered_ops.swiglu; outputs and gradients as the stock model's; other MLPs left, with why."""

import copy
import pickle

import pytest
import torch
from helpers import rel
from test_patch import _flat, force_tier, needs_hf, step, tiny
from torch import nn

from tiered_ops.models.patch_mlp import activation_of
from tiered_ops.models.patching import patch, patched, unpatch
from tiered_ops.registry import rel_error

DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma"]
ACTIVATION = {"llama": "silu", "mistral": "silu", "qwen2": "silu", "qwen3": "silu", "gemma": "gelu_tanh"}


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")


def _count_swiglu_calls(monkeypatch) -> list:
    """The activations the rewritten MLPs call tiered_ops.swiglu with."""
    from tiered_ops.models import patch_mlp

    calls: list = []
    real = patch_mlp.swiglu
    monkeypatch.setattr(patch_mlp, "swiglu", lambda gate, up, act: calls.append(act) or real(gate, up, act))
    return calls


@needs_hf
@pytest.mark.parametrize("tier", ["eager", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", DECODERS)
def test_mlps_through_swiglu_match_stock(family, dtype, tier, monkeypatch):
    """Only the MLPs patched (ops=["swiglu"]): outputs and every parameter's gradient as the stock model's (fp32: a
    few ulps; bf16: an error against the float64 model at most 2x the stock model's own)."""
    force_tier(monkeypatch, tier)
    calls = _count_swiglu_calls(monkeypatch)
    model = tiny(family).to(dtype)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    truth = step(copy.deepcopy(model).double(), ids)
    stock = step(model, ids)
    report = patch(model, ops=["swiglu"])
    mlps = [s for s in report.swapped if "tiered_ops.swiglu" in s.replacement]
    assert [s.path for s in mlps] == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    assert all(f"activation={ACTIVATION[family]!r}" in s.replacement for s in mlps)
    got = step(model, ids)
    assert calls == [ACTIVATION[family]] * 2, calls
    assert set(got[1]) == set(stock[1])
    if dtype == torch.float32:
        assert rel(got[0], stock[0]) < 1e-5, "output"
        scale = max(g.double().norm().item() for g in stock[1].values())
        for name in stock[1]:
            assert rel_error(got[1][name], stock[1][name], floor=scale) < 1e-5, name
    else:
        for what, g, s, t in [("output", got[0], stock[0], truth[0]),
                              ("gradients", _flat(got[1]), _flat(stock[1]), _flat(truth[1]))]:
            assert rel(g, t) <= 2 * rel(s, t), f"{what}: patched {rel(g, t):.2e} vs stock {rel(s, t):.2e}"
    assert unpatch(model) == len(report.swapped)
    assert all(patched(m) is None for m in model.modules())


@needs_hf
def test_an_activation_swiglu_does_not_have_leaves_the_mlp():
    model = transformers_model(hidden_act="relu")
    report = patch(model)
    assert not any("swiglu" in s.replacement for s in report.swapped), str(report)
    left = {x.path: x.reason for x in report.left if x.path.endswith(".mlp")}
    assert set(left) == {"model.layers.0.mlp", "model.layers.1.mlp"}, str(report)
    assert all("act_fn (ReLU) is none of tiered_ops.swiglu's activations" in r for r in left.values())


@needs_hf
def test_the_erf_gelu_is_taken():
    model = transformers_model(hidden_act="gelu")
    stock = copy.deepcopy(model)
    report = patch(model, ops=["swiglu"])
    assert sum("activation='gelu')" in s.replacement for s in report.swapped) == 2, str(report)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        assert rel(model(ids).logits, stock(ids).logits) < 1e-5


@needs_hf
def test_an_mlp_whose_forward_differs_is_left(monkeypatch):
    from transformers.models.llama import modeling_llama

    class LlamaMLP(modeling_llama.LlamaMLP):  # a transformers-like class whose forward does one more step
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 2

    LlamaMLP.__module__ = modeling_llama.__name__
    model = tiny("llama")
    model.model.layers[0].mlp.__class__ = LlamaMLP
    report = patch(model, ops=["swiglu"])
    assert [s.path for s in report.swapped] == ["model.layers.1.mlp"], str(report)
    assert [x.reason for x in report.left if x.path == "model.layers.0.mlp"] == [
        "its forward is not the gated MLP's code (down_proj(act_fn(gate_proj(x)) * up_proj(x))) this rewrite "
        "reproduces"]


@needs_hf
def test_float64_runs_the_original_expression_and_copies_stay_patched():
    model = tiny("qwen2")
    patch(model, ops=["swiglu"])
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 64, dtype=torch.float64)
    m64 = copy.deepcopy(mlp).double()
    want = m64.down_proj(torch.nn.functional.silu(m64.gate_proj(x)) * m64.up_proj(x))
    assert rel(m64(x), want) < 1e-12
    for copied in (copy.deepcopy(mlp), pickle.loads(pickle.dumps(mlp))):
        assert patched(copied) == patched(mlp) and type(copied).forward is type(mlp).forward


@needs_hf
def test_activation_of_each_module():
    from transformers import activations as A

    cases = {"silu": [nn.SiLU(), A.SiLUActivation()],
             "gelu_tanh": [nn.GELU("tanh"), A.GELUTanh(), A.NewGELUActivation(), A.FastGELUActivation()],
             "gelu": [nn.GELU(), A.GELUActivation()],
             None: [nn.ReLU(), A.QuickGELUActivation(), nn.Tanh()]}
    for want, mods in cases.items():
        for m in mods:
            assert activation_of(m) == want, type(m).__name__


def transformers_model(**config):
    """A tiny Llama with its config changed (hidden_act)."""
    import transformers as t
    from test_patch import SMALL

    torch.manual_seed(0)
    return t.LlamaForCausalLM(t.LlamaConfig(**SMALL, **config)).eval()
