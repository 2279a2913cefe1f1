"""patch's fused LM head + loss (op linear_cross_entropy, tiered_ops/models/lm_head_loss.py): a causal LM trained
with labels gets its loss from the hidden states and the head's weight, never the logits.

Tiny transformers models (hidden 64, vocabulary 128, 2 layers, weights off their init) in training mode: the loss and
every parameter's gradient of the patched model against the stock one, in fp32 to a few ulps, in bf16 no farther from
the float64 model than 2x the stock model is; the logits are None on that route and back after unpatch."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel
from test_patch import force_tier, needs_hf, tiny
from test_patch_layers import DECODERS, _batch, _flat

import tiered_ops
from tiered_ops.models import lm_head_loss
from tiered_ops.models.patching import patch, patched, unpatch
from tiered_ops.registry import rel_error

ROUTE = "tiered_ops.linear_cross_entropy"


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")


def _step(model, ids, labels, **kw) -> tuple[torch.Tensor, object, dict[str, torch.Tensor]]:
    """(loss, logits or None, parameter gradients) of one training step on the model's own loss."""
    model.zero_grad()
    out = model(ids, labels=labels, **kw)
    out.loss.backward()
    return out.loss.detach(), out.logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(got, stock, truth, dtype) -> None:
    assert set(got[2]) == set(stock[2])
    if dtype == torch.float32:
        assert rel(got[0], stock[0]) < 1e-5, (got[0], stock[0])
        scale = max(g.double().norm().item() for g in stock[2].values())
        for name in stock[2]:
            assert rel_error(got[2][name], stock[2][name], floor=scale) < 1e-5, name
        return
    for what, g, s, t in [("loss", got[0], stock[0], truth[0]),
                          ("gradients", _flat(got[2]), _flat(stock[2]), _flat(truth[2]))]:
        assert rel(g, t) <= 2 * rel(s, t) + 1e-6, f"{what}: patched {rel(g, t):.2e} vs stock {rel(s, t):.2e}"


@needs_hf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", DECODERS)
def test_fused_head_and_loss_match_stock(family, dtype):
    model = tiny(family).to(dtype).train()
    ids, labels = _batch()
    truth = _step(copy.deepcopy(model).double(), ids, labels)
    stock = _step(model, ids, labels)
    report = patch(model, ops=["linear_cross_entropy"])
    assert [s.path for s in report.swapped if ROUTE in s.replacement] == [""], str(report)
    assert ROUTE in patched(model)
    got = _step(model, ids, labels)
    assert got[1] is None  # no [tokens, vocab] logits on this route
    assert got[0].dtype == torch.float32  # transformers' loss upcasts the logits: a float32 loss
    _compare(got, stock, truth, dtype)
    assert unpatch(model) == 1 and patched(model) is None
    again = _step(model, ids, labels)
    assert again[1] is not None
    _compare(again, stock, truth, dtype)


@needs_hf
def test_the_route_never_computes_logits(monkeypatch):
    model = tiny("llama").train()
    ids, labels = _batch()
    patch(model)
    calls = []
    monkeypatch.setattr(lm_head_loss, "linear_cross_entropy",
                        lambda *a, **k: calls.append(a[0].shape) or tiered_ops.linear_cross_entropy(*a, **k))
    model.lm_head.register_forward_hook(lambda *a: pytest.fail("the LM head ran: logits were materialized"))
    model(ids, labels=labels).loss.backward()
    assert calls == [torch.Size([ids.numel(), 64])]


@needs_hf
def test_without_labels_or_in_eval_the_model_runs_as_before():
    model = tiny("qwen2").train()
    ids, labels = _batch()
    want = model(ids).logits
    with torch.no_grad():
        want_eval = model.eval()(ids, labels=labels)
    patch(model)
    model.train()
    assert torch.equal(model(ids).logits, want)  # no labels: the stock forward, logits and all
    with torch.no_grad():
        got = model.eval()(ids, labels=labels)  # eval with labels: logits for the caller's metrics
    assert got.logits is not None and torch.equal(got.logits, want_eval.logits)
    assert rel(got.loss, want_eval.loss) < 1e-6


@needs_hf
def test_num_items_in_batch_shift_labels_and_return_dict():
    model = tiny("mistral").train()
    ids, labels = _batch()
    shifted = torch.roll(labels, 1, dims=1)
    for kw in [{"num_items_in_batch": torch.tensor(11)}, {"num_items_in_batch": 11}, {"shift_labels": shifted}]:
        unpatch(model)
        stock = _step(model, ids, labels, **kw)
        patch(model, ops=["linear_cross_entropy"])
        got = _step(model, ids, labels, **kw)
        assert rel(got[0], stock[0]) < 1e-6 and rel(_flat(got[2]), _flat(stock[2])) < 1e-5, kw
    out = model(ids, labels=labels, return_dict=False)
    # (loss, ...): the tuple skips the None logits
    assert isinstance(out, tuple) and torch.equal(out[0], model(ids, labels=labels).loss)
    every = torch.full_like(labels, -100)
    assert model(ids, labels=every).loss.isnan()  # every target ignored: NaN, as transformers gives


@needs_hf
def test_every_ignored_matches_stock_and_labels_shift():
    model = tiny("llama").train()
    ids = torch.randint(0, 128, (1, 6))
    labels = torch.full_like(ids, -100)
    labels[0, 3] = 7
    stock = _step(model, ids, labels)
    patch(model)
    got = _step(model, ids, labels)
    assert rel(got[0], stock[0]) < 1e-6 and rel(_flat(got[2]), _flat(stock[2])) < 1e-5


@needs_hf
def test_soft_capped_logits_stay_on_the_logits_route():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, head_dim=16, final_logit_softcapping=30.0)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).train()
    report = patch(model)
    assert not any(ROUTE in s.replacement for s in report.swapped)
    left = [x.reason for x in report.left if x.path == ""]
    assert any("soft-capped" in r for r in left), str(report)
    assert any("cross_entropy" in s.replacement for s in report.swapped if s.path == "")  # the loss is still routed
    ids, labels = _batch()
    assert model(ids, labels=labels).logits is not None


@needs_hf
def test_only_linear_cross_entropy_in_ops_is_asked_for():
    model = tiny("gemma").train()
    report = patch(model, ops=["rms_norm"])
    assert any("linear_cross_entropy not in ops" in x.reason for x in report.left if x.path == ""), str(report)
    assert "linear_cross_entropy" in tiered_ops.models.patching.PATCHABLE_OPS


@needs_hf
def test_the_route_at_the_triton_tier_matches_stock(monkeypatch):
    force_tier(monkeypatch, "triton")
    model = tiny("qwen3").train()
    ids, labels = _batch()
    stock = _step(model, ids, labels)
    patch(model, ops=["linear_cross_entropy"])
    got = _step(model, ids, labels)
    assert got[1] is None
    _compare(got, stock, None, torch.float32)


# ---- each known form of the causal-LM forward (lm_head_loss.FORMS) ------------------------------------------------

def _gemma3(**cfg):
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return t.Gemma3ForCausalLM(t.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                  head_dim=16, **cfg))


def _as_517(monkeypatch, model):
    """``model``'s class given transformers 5.17's forward (tests/hf517_causal_lm.py): it then runs, and reads to the
    syntax check, as it does under 5.17."""
    import hf517_causal_lm

    soft = hasattr(model.config, "final_logit_softcapping")  # Gemma2/Gemma3: the soft-capping form
    monkeypatch.setattr(type(model), "forward", hf517_causal_lm.Gemma2ForCausalLM.forward if soft else
                        hf517_causal_lm.LlamaForCausalLM.forward)
    return model


@needs_hf
@pytest.mark.parametrize("version,family,dtype", [
    ("5.17", "llama", torch.float32), ("5.17", "llama", torch.bfloat16), ("5.17", "qwen3", torch.float32),
    ("5.17", "gemma", torch.float32), ("5.17", "gemma3", torch.float32), ("installed", "gemma3", torch.float32),
    ("installed", "gemma3", torch.bfloat16)], ids=str)
def test_each_known_form_fuses_and_matches_stock(version, family, dtype, monkeypatch):
    """The installed transformers' forms and 5.17's (its forward's code run on the installed model classes): the
    fused loss and every gradient against the same model's own forward. Gemma3 without soft-capping (its default)
    takes the Gemma2/3 form."""
    model = (_gemma3() if family == "gemma3" else tiny(family)).to(dtype).train()
    if version == "5.17":
        _as_517(monkeypatch, model)
    form = lm_head_loss.head_form(type(model))
    assert form is not None and (version != "5.17" or "5.17" in form.name), form
    ids, labels = _batch()
    truth = _step(copy.deepcopy(model).double(), ids, labels)
    stock = _step(model, ids, labels)
    assert stock[1] is not None
    with torch.no_grad():
        want = model.eval()(ids).logits
    model.train()
    report = patch(model, ops=["linear_cross_entropy"])
    assert [s.path for s in report.swapped if ROUTE in s.replacement] == [""], str(report)
    got = _step(model, ids, labels)
    assert got[1] is None and got[0].dtype == torch.float32
    _compare(got, stock, truth, dtype)
    with torch.no_grad():  # eval: the form's own forward, logits and all
        assert torch.equal(model.eval()(ids).logits, want)
    assert unpatch(model) == 1
    _compare(_step(model.train(), ids, labels), stock, truth, dtype)


@needs_hf
def test_an_unknown_form_is_refused_with_why(monkeypatch):
    """A forward that is neither form (here 5.17's with one more line) is left, with the reason it always had."""
    import hf517_causal_lm

    def other(self, input_ids=None, labels=None, **kwargs):
        out = hf517_causal_lm.LlamaForCausalLM.forward(self, input_ids, labels=labels, **kwargs)
        return out

    model = tiny("mistral").train()
    monkeypatch.setattr(type(model), "forward", other)
    report = patch(model, ops=["linear_cross_entropy"])
    assert not any(ROUTE in s.replacement for s in report.swapped)
    reason = "LM head + loss not fused: its forward is not the causal-LM code this rewrite reproduces"
    assert [x.reason.split("; ")[0] for x in report.left if x.path == ""] == [reason], str(report)


@needs_hf
@pytest.mark.parametrize("version", ["5.17", "installed"])
def test_soft_capping_switched_on_after_the_patch_runs_the_original_tail(version, monkeypatch):
    model = _gemma3().train()
    if version == "5.17":
        _as_517(monkeypatch, model)
    patch(model, ops=["linear_cross_entropy"])
    model.config.final_logit_softcapping = 3.0
    ids, labels = _batch()
    got = _step(model, ids, labels)
    assert got[1] is not None  # the logits route: the head, the cap, then the loss
    unpatch(model)
    stock = _step(model, ids, labels)
    assert got[1].abs().max() <= 3.0 and torch.equal(got[1], stock[1])
    assert rel(got[0], stock[0]) < 1e-6 and rel(_flat(got[2]), _flat(stock[2])) < 1e-6
