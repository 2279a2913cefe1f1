"""patch's model-level rewrites: the decoder layer's residual add + post-attention RMSNorm through
tiered_ops.fused_add_rms_norm (fuse_residual=True), and the causal-LM loss through tiered_ops.cross_entropy.

Tiny transformers models (hidden 64, 2 layers, weights off their init): outputs, losses and gradients of the patched
model against the stock one, in fp32 to a few ulps, in bf16 no farther from the float64 model than 2x the stock
model is (its matmuls round too)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from helpers import rel
from test_patch import force_tier, needs_hf, tiny

import tiered_ops
from tiered_ops.models.patch_layers import causal_lm_loss
from tiered_ops.models.patching import patch, patched, unpatch
from tiered_ops.registry import rel_error

DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma"]


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, n), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored targets
    return ids, labels


def train_step(model, ids, labels, **kw) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, logits, parameter gradients) of one training step on the model's own loss."""
    model.zero_grad()
    out = model(ids, labels=labels, **kw)
    out.loss.backward()
    logits = out.logits.detach() if out.logits is not None else None  # None: the fused LM head + loss in training
    return out.loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for g in grads.values()])


def _compare(got, stock, truth, dtype) -> None:
    assert set(got[2]) == set(stock[2])
    if dtype == torch.float32:
        assert rel(got[0], stock[0]) < 1e-5 and rel(got[1], stock[1]) < 1e-5
        scale = max(g.double().norm().item() for g in stock[2].values())
        for name in stock[2]:
            assert rel_error(got[2][name], stock[2][name], floor=scale) < 1e-5, name
        return
    # the loss is one number: stock's error on it is one draw of the half-precision rounding and can land near 0
    # (9.3e-6 for a tiny bf16 Gemma on one CPU, where the patched step's 1.4e-4 is the rounding's usual size), so the
    # bound adds a sixteenth of the dtype's epsilon; the logits and gradients, many numbers each, keep stock's error
    # as their scale (bf16 here: 5.6e-3 to 1.3e-2, so the floor loosens them by a tenth at most)
    floor = torch.finfo(dtype).eps / 16
    for what, g, s, t in [("loss", got[0], stock[0], truth[0]), ("logits", got[1], stock[1], truth[1]),
                          ("gradients", _flat(got[2]), _flat(stock[2]), _flat(truth[2]))]:
        assert rel(g, t) <= 2 * rel(s, t) + floor, f"{what}: patched {rel(g, t):.2e} vs stock {rel(s, t):.2e}"


@needs_hf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", DECODERS)
def test_fused_residual_and_routed_loss_match_stock(family, dtype):
    model = tiny(family).to(dtype)
    ids, labels = _batch()
    truth = train_step(copy.deepcopy(model).double(), ids, labels)
    stock = train_step(model, ids, labels)
    report = patch(model, fuse_residual=True)
    layers = [s for s in report.swapped if "fused_add_rms_norm" in s.replacement]
    assert [s.path for s in layers] == ["model.layers.0", "model.layers.1"], str(report)
    assert any("cross_entropy" in s.replacement for s in report.swapped)
    _compare(train_step(model, ids, labels), stock, truth, dtype)
    assert unpatch(model) == len(report.swapped)
    _compare(train_step(model, ids, labels), stock, truth, dtype)  # unpatched: the stock model again
    assert all(patched(m) is None for m in model.modules()) and "_loss_function" not in model.__dict__


@needs_hf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_residual_runs_the_kernels(dtype, monkeypatch):
    """With the Triton tier forced (the interpreter here), the fused layer still matches stock."""
    force_tier(monkeypatch, "triton")
    model = tiny("llama").to(dtype)
    ids, labels = _batch()
    truth = train_step(copy.deepcopy(model).double(), ids, labels)
    stock = train_step(model, ids, labels)
    patch(model, fuse_residual=True)
    _compare(train_step(model, ids, labels), stock, truth, dtype)


@needs_hf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family, form", [("qwen3", {"cast_before_weight": True}), ("gemma", {"weight_offset": 1.0})])
def test_the_fused_layer_calls_fused_add_rms_norm(monkeypatch, family, form, dtype):
    """One call per layer, the norm's weight and its Hugging Face form passed to it (no multiply after it, no upcast
    before it), in bf16 as in fp32."""
    from tiered_ops.models import patch_layers

    seen = []
    real = patch_layers.fused_add_rms_norm
    monkeypatch.setattr(patch_layers, "fused_add_rms_norm",
                        lambda *a, **k: seen.append((a[0].shape, a[3] is not None, k)) or real(*a, **k))
    model = tiny(family).to(dtype)
    patch(model, fuse_residual=True)
    with torch.no_grad():
        model(_batch()[0])
    assert seen == [(torch.Size([2, 8, 64]), True, form)] * 2  # once per layer


@needs_hf
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_decoding_with_the_kv_cache_matches_stock(family):
    """generate (a prefill, then one step per token through the model's KV cache, under whichever name this
    transformers gives the cache argument) through the fused layers gives the stock model's tokens and logits."""
    model = tiny(family)
    ids = _batch()[0]
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    with torch.no_grad():
        stock = model.generate(ids, **kw)
        report = patch(model, fuse_residual=True)
        assert sum("fused_add_rms_norm" in s.replacement for s in report.swapped) == 2, str(report)
        got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, stock.sequences)
    for g, s in zip(got.logits, stock.logits, strict=True):
        assert rel(g, s) < 1e-5


@needs_hf
def test_a_decoder_layer_whose_forward_does_more_is_left():
    """A layer class whose forward is not the code the rewrite reproduces (here: one more step) is left, with why."""
    import transformers.models.llama.modeling_llama as ml

    from tiered_ops.models.patch_layers import decoder_plan, layer_form

    class OtherLayer(ml.LlamaDecoderLayer):
        __module__ = ml.__name__

        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                              position_ids=position_ids, past_key_values=past_key_values,
                                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
            hidden_states = residual + 0.5 * hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    model = tiny("llama")
    layer = model.model.layers[0]
    assert layer_form(type(layer)) in ("past_key_values", "cache")
    layer.__class__ = OtherLayer
    assert layer_form(OtherLayer) is None
    assert "not the Llama decoder layer's code" in decoder_plan(layer)


@needs_hf
def test_an_rms_norm_whose_code_differs_is_left(monkeypatch):
    """An RMSNorm class named as transformers' but whose forward (or Gemma's _norm) computes anything else is left,
    with why, even where it is transformers' own class (another version); the stock classes are taken."""
    import transformers.models.gemma.modeling_gemma as mg
    import transformers.models.llama.modeling_llama as ml

    from tiered_ops.models.patch_layers import norm_form

    class LlamaRMSNorm(ml.LlamaRMSNorm):
        __module__ = ml.__name__

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + 2 * self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class GemmaRMSNorm(mg.GemmaRMSNorm):
        __module__ = mg.__name__

        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) + 1

    assert (norm_form(ml.LlamaRMSNorm), norm_form(mg.GemmaRMSNorm)) == ("llama", "gemma")
    assert norm_form(LlamaRMSNorm) is None and norm_form(GemmaRMSNorm) is None
    model = tiny("llama")
    model.model.norm.__class__ = LlamaRMSNorm
    report = patch(model)
    assert "model.norm" not in [s.path for s in report.swapped]
    assert [x.reason for x in report.left if x.path == "model.norm"] == [
        "its forward is not the Llama/Gemma RMSNorm code this patch reproduces (another transformers version)"]
    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", LlamaRMSNorm.forward)  # as a transformers that changed it
    assert norm_form(ml.LlamaRMSNorm) is None


@needs_hf
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_add_rms_norm_is_the_hf_add_and_norm_bit_for_bit(family, dtype, wdtype):
    """The fused call (eager tier: nothing stored, tuning off) gives the stock norm of the stock sum exactly, output
    dtype included: the form's roundings are the module's."""
    from tiered_ops.models.patch_layers import add_rms_norm

    layer = tiny(family).model.layers[0]
    norm = layer.post_attention_layernorm.to(dtype if wdtype == "same" else torch.float32)
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(3, 5, 64, generator=g).to(dtype) for _ in range(2))
    with torch.no_grad():
        y, h = add_rms_norm(norm, x, r, gemma=family == "gemma")
        want_h = r + x
        want_y = norm(want_h)
    assert torch.equal(h, want_h)
    assert y.dtype == want_y.dtype and torch.equal(y, want_y)


@needs_hf
def test_a_traced_fused_pair_adds_in_the_originals_order():
    """Traced (the eager tier's code inlined), the fused pair's sum is ``residual + x`` as in the layer it replaces:
    the same bits either way, but Inductor plans kernels and buffers by the graph, and ``x + residual`` gave another
    plan (one more kernel, another training peak)."""
    from tiered_ops.models.patch_layers import add_rms_norm

    norm = tiny("llama").model.layers[0].post_attention_layernorm
    x, r = torch.randn(2, 5, 64), torch.randn(2, 5, 64)

    def adds(fn) -> list[tuple[str, ...]]:
        graphs = []
        fn(x, r)  # the decision, made outside the trace as a user's first call makes it
        torch._dynamo.reset()
        torch.compile(fn, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(x, r)
        return [tuple(a.name for a in n.args) for g in graphs for n in g.graph.nodes  # the adds of two inputs
                if n.op == "call_function" and n.target in (operator.add, torch.add)
                and all(isinstance(a, torch.fx.Node) and a.op == "placeholder" for a in n.args)]

    def fused(x, residual):
        return add_rms_norm(norm, x, residual)

    def original(x, residual):
        h = residual + x
        return norm(h), h

    assert adds(fused) == adds(original) == [("l_residual_", "l_x_")]


@needs_hf
def test_fuse_residual_is_off_by_default_and_reports_the_boundary_pairs():
    model = tiny("llama")
    assert not any("fused_add" in s.replacement for s in patch(model).swapped)
    unpatch(model)
    report = patch(model, fuse_residual=True)
    assert [x.path for x in report.left] == ["model.layers.1.input_layernorm"]
    assert "layer boundary" in report.left[0].reason


@needs_hf
def test_gradient_checkpointing_runs_the_class_forward():
    model = tiny("llama").train()
    model.gradient_checkpointing_enable()
    ids, labels = _batch()
    stock = train_step(model, ids, labels)
    patch(model, fuse_residual=True)
    got = train_step(model, ids, labels)
    assert rel(got[0], stock[0]) < 1e-6 and rel(_flat(got[2]), _flat(stock[2])) < 1e-5


@needs_hf
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_num_items_in_batch_and_shift_labels(family):
    model = tiny(family)
    ids, labels = _batch()
    n = torch.tensor(11)
    stock = train_step(model, ids, labels, num_items_in_batch=n)
    patch(model, ops=["cross_entropy"])
    got = train_step(model, ids, labels, num_items_in_batch=n)
    assert rel(got[0], stock[0]) < 1e-6 and rel(_flat(got[2]), _flat(stock[2])) < 1e-5


def test_causal_lm_loss_against_transformers():
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[1, 2] = -100
    shifted = torch.randint(0, 7, (2, 5), generator=g)
    for kw in [{}, {"num_items_in_batch": 6}, {"num_items_in_batch": torch.tensor(6)}, {"shift_labels": shifted},
               {"ignore_index": 3}]:
        lab = labels.clamp(min=0) if "ignore_index" in kw else labels
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        ref, got = ForCausalLMLoss(a, lab, 7, **kw), causal_lm_loss(b, lab, 7, **kw)
        ref.backward()
        got.backward()
        assert got.dtype == torch.float32 and rel(got, ref) < 1e-6 and rel(b.grad, a.grad) < 1e-6, kw
    every = torch.full((2, 5), -100)
    assert causal_lm_loss(logits, every, 7).isnan() and ForCausalLMLoss(logits, every, 7).isnan()


def test_the_loss_is_in_the_public_ops():
    assert "cross_entropy" in tiered_ops.models.patching.PATCHABLE_OPS
