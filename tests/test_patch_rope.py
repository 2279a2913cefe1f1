"""patch's rotary-embedding routes: each transformers attention's apply_rotary_pos_emb through
tiered_ops.rotary_embedding (tiered_ops/models/patch_rope.py), and Qwen3's q_norm/k_norm + RoPE through one
tiered_ops.qk_norm_rope (tiered_ops/models/patch_qk_norm.py).

Tiny models (hidden 64, 2 layers, weights off their init) of the five decoder families, and GPT-NeoX with a partial
rotary (rotary_pct 0.25): logits, loss and every parameter gradient of the patched model against the stock one
(fp32: a few ulps; bf16: no farther from the float64 model than 2x the stock model is), at the eager tier and the
Triton kernels (the interpreter here)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from test_patch import force_tier, needs_hf, tiny, transformers
from test_patch_layers import DECODERS, _batch, _compare, train_step

from tiered_ops.models import patch_rope
from tiered_ops.models.patching import patch, patched, unpatch


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")


def _neox(rotary_pct: float = 0.25):
    t = transformers
    torch.manual_seed(0)
    model = t.GPTNeoXForCausalLM(t.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, vocab_size=128, rotary_pct=rotary_pct,
                                                 max_position_embeddings=64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _model(family: str):
    return _neox() if family == "neox" else tiny(family)


def _counted(monkeypatch) -> list[tuple]:
    """The shapes each tiered_ops.rotary_embedding call of the route gets (q, k, cos)."""
    seen: list[tuple] = []
    real = patch_rope.rotary_embedding

    def counting(q, k, cos, sin):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(cos.shape)))
        return real(q, k, cos, sin)

    monkeypatch.setattr(patch_rope, "rotary_embedding", counting)
    return seen


@needs_hf
@pytest.mark.parametrize("tier", ["eager", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", [*DECODERS, "neox"])
def test_routed_rope_trains_like_stock(family, dtype, tier, monkeypatch):
    force_tier(monkeypatch, tier)
    model = _model(family).to(dtype)
    ids, labels = _batch()
    truth = train_step(copy.deepcopy(model).double(), ids, labels)
    stock = train_step(model, ids, labels)
    report = patch(model, ops=["rotary_embedding"])
    routed = [s for s in report.swapped if "rotary_embedding" in s.replacement]
    prefix = "gpt_neox.layers" if family == "neox" else "model.layers"
    assert [s.path for s in routed] == [f"{prefix}.0.attention" if family == "neox" else f"{prefix}.0.self_attn",
                                        f"{prefix}.1.attention" if family == "neox" else f"{prefix}.1.self_attn"]
    assert all(("partial" if family == "neox" else "full") in s.replacement for s in routed), str(report)
    seen = _counted(monkeypatch)
    _compare(train_step(model, ids, labels), stock, truth, dtype)
    assert len(seen) == 2, seen  # one call per layer
    if family == "neox":
        assert seen[0][2][-1] == 4 and seen[0][0][-1] == 16  # rotary_dim 4 of head_dim 16: the rest passes through
    assert unpatch(model) == len(report.swapped)
    assert all(patched(m) is None for m in model.modules())
    seen.clear()
    _compare(train_step(model, ids, labels), stock, truth, dtype)  # unpatched: the stock model again
    assert seen == []


@needs_hf
def test_the_route_is_in_the_default_patch_and_pickles():
    model = tiny("qwen3")
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        want = model(ids).logits
    report = patch(model)
    assert sum("tiered_ops.qk_norm_rope" in s.replacement for s in report.swapped) == 2, str(report)
    copy_ = pickle.loads(pickle.dumps(model))
    assert patched(copy_.model.layers[0].self_attn) == patched(model.model.layers[0].self_attn)
    with torch.no_grad():
        torch.testing.assert_close(copy_(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert patch(model).swapped == []  # patching twice: no-op
    unpatch(model)


@needs_hf
def test_a_call_the_op_does_not_take_runs_the_original(monkeypatch):
    """float64 (no tier takes it): transformers' own function, the same bits as the stock model."""
    model = tiny("llama").double()
    stock = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 8))
    patch(model, ops=["rotary_embedding"])
    seen = _counted(monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock(ids).logits)
    assert seen == []


@needs_hf
def test_an_apply_rotary_pos_emb_whose_code_differs_is_left(monkeypatch):
    from transformers.models.llama import modeling_llama

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # interleaved pairs: not rotate-half
        return q * cos.unsqueeze(1), k * cos.unsqueeze(1)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    patch_rope._routed.cache_clear()
    try:
        report = patch(tiny("llama"), ops=["rotary_embedding"])
    finally:
        patch_rope._routed.cache_clear()
    assert report.swapped == []
    reasons = [x.reason for x in report.left if "rotary embedding not routed" in x.reason]
    assert reasons == ["rotary embedding not routed: its apply_rotary_pos_emb is not transformers' rotate-half code "
                       "this rewrite reproduces"] * 2


def _hub_wrapped(func):
    """A function as the ``kernels`` package's ``use_kernel_forward_from_hub`` turns it into: an instance of a module
    class whose forward calls it, a variable of its closure."""
    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


@needs_hf
def test_an_apply_rotary_pos_emb_under_a_hub_kernel_wrapper_is_routed(monkeypatch):
    """transformers 5.25 with ``kernels`` installed holds apply_rotary_pos_emb (and could hold rotate_half) as such a
    module: its function is the code compared, and the routed attention runs the op."""
    from transformers.models.llama import modeling_llama

    plain = patch_rope.plain_function(modeling_llama.apply_rotary_pos_emb)
    wrapped = _hub_wrapped(plain)
    assert patch_rope.plain_function(wrapped) is plain
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", wrapped)
    monkeypatch.setattr(modeling_llama, "rotate_half", _hub_wrapped(modeling_llama.rotate_half))
    patch_rope._routed.cache_clear()
    try:
        model = tiny("llama")
        stock = copy.deepcopy(model)
        report = patch(model, ops=["rotary_embedding"])
        seen = _counted(monkeypatch)
        ids = torch.randint(0, 128, (2, 8))
        with torch.no_grad():
            out, ref = model(ids).logits, stock(ids).logits
    finally:
        patch_rope._routed.cache_clear()
    assert len([x for x in report.swapped if "rotary" in x.replacement]) == 2, str(report)
    assert len(seen) == 2
    torch.testing.assert_close(out, ref)


@needs_hf
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_attention_whose_rotary_kernelize_replaced_is_left(family):
    """Where ``kernels.kernelize`` gave an attention's own wrapper of apply_rotary_pos_emb (``_kernel_funcs``, which
    the global function dispatches to while that attention runs) a hub kernel's forward, the caller chose that
    kernel: neither route takes the attention, and the report says why."""
    model = tiny(family)
    for layer in model.model.layers:
        own = _hub_wrapped(lambda *a, **k: None)
        own.forward = lambda *a, **k: None  # what kernelize leaves on the wrapper: a hub kernel's forward
        layer.self_attn.__dict__["_kernel_funcs"] = {"apply_rotary_pos_emb": own}
    report = patch(model)
    assert not [x for x in report.swapped if x.path.endswith("self_attn")], str(report)
    why = [x.reason for x in report.left if x.path.endswith("self_attn")]
    routes = 2 if family == "qwen3" else 1  # Qwen3's q_norm/k_norm route, then the plain one, each says why
    assert len(why) == 2 * routes and all("kernels.kernelize chose" in w for w in why), why


@needs_hf
def test_the_routed_forward_reads_its_modules_own_globals(monkeypatch):
    """The routed forward runs in its modeling module's own globals (apply_rotary_pos_emb alone bound apart, in its
    closure): a global of the module rebound after the patch is read, as stock's forward reads it (a copy of the
    globals made at patch time did not see it)."""
    from transformers.models.llama import modeling_llama

    model = tiny("llama")
    patch(model, ops=["rotary_embedding"])
    real, asked = modeling_llama.ALL_ATTENTION_FUNCTIONS, []

    class Counting:
        def get_interface(self, name, default):
            asked.append(name)
            return real.get_interface(name, default)

    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", Counting())
    seen = _counted(monkeypatch)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 8)))
    assert len(asked) == 2 and len(seen) == 2, (asked, seen)


@needs_hf
def test_ops_without_the_route_leave_the_attention_with_why():
    report = patch(tiny("mistral"), ops=["rms_norm"])
    assert [x.path for x in report.left if "rotary_embedding not in ops" in x.reason] == [
        "model.layers.0.self_attn", "model.layers.1.self_attn"]


@needs_hf
def test_decoding_with_the_kv_cache_matches_stock():
    """Generation: positions past the prompt (cos and sin of one token), the cache's keys rotated once."""
    model = tiny("llama")
    stock = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 5))
    want = stock.generate(ids, max_new_tokens=4, do_sample=False)
    patch(model)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)


@needs_hf
@pytest.mark.parametrize("tier", ["eager", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qwen3_qk_norm_and_rope_fused_trains_like_stock(dtype, tier, monkeypatch):
    from tiered_ops.models import patch_qk_norm

    force_tier(monkeypatch, tier)
    model = tiny("qwen3").to(dtype)
    ids, labels = _batch()
    truth = train_step(copy.deepcopy(model).double(), ids, labels)
    stock = train_step(model, ids, labels)
    report = patch(model, ops=["qk_norm_rope", "rotary_embedding"])
    assert [s.path for s in report.swapped] == ["model.layers.0.self_attn", "model.layers.1.self_attn"], str(report)
    assert all("tiered_ops.qk_norm_rope" in s.replacement for s in report.swapped)
    seen = []
    real = patch_qk_norm.qk_norm_rope
    monkeypatch.setattr(patch_qk_norm, "qk_norm_rope", lambda *a: seen.append(a[0].shape) or real(*a))
    monkeypatch.setattr(patch_rope, "rotary_embedding", lambda *a: pytest.fail("the plain route ran"))
    _compare(train_step(model, ids, labels), stock, truth, dtype)
    assert seen == [torch.Size([2, 4, 8, 16])] * 2, seen  # q [batch, heads, seq, head_dim], one call per layer
    assert unpatch(model) == 2
    _compare(train_step(model, ids, labels), stock, truth, dtype)


@needs_hf
def test_qwen3_without_the_fused_op_takes_the_plain_route():
    report = patch(tiny("qwen3"), ops=["rotary_embedding"])
    assert [x.reason for x in report.left if x.reason.startswith("q_norm/k_norm")] == [
        "q_norm/k_norm + RoPE not fused: qk_norm_rope not in ops=['rotary_embedding']"] * 2
    assert sum("tiered_ops.rotary_embedding" in s.replacement for s in report.swapped) == 2


@needs_hf
def test_an_attention_whose_lines_differ_is_not_fused(monkeypatch):
    """A forward that normalizes k but not q (another code than Qwen3's): the fused rewrite leaves it, with why."""
    from transformers.models.qwen3 import modeling_qwen3

    from tiered_ops.models import patch_qk_norm

    class Other(modeling_qwen3.Qwen3Attention):
        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
            hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)  # noqa: F821
            return query_states, key_states

    Other.__module__ = modeling_qwen3.__name__
    for name in ("apply_rotary_pos_emb", "rotate_half"):  # this module's globals hold transformers' rope, as Qwen3's do
        monkeypatch.setitem(globals(), name, getattr(modeling_qwen3, name))
    model = tiny("qwen3")
    model.model.layers[0].self_attn.__class__ = Other
    patch_qk_norm._routed.cache_clear()
    report = patch(model, ops=["qk_norm_rope"])
    assert [(x.path, x.reason) for x in report.left if "not fused" in x.reason][0] == (
        "model.layers.0.self_attn", "q_norm/k_norm + RoPE not fused: its forward does not hold Qwen3's "
        "q_norm/k_norm and apply_rotary_pos_emb lines")
    assert [s.path for s in report.swapped] == ["model.layers.1.self_attn"]


@needs_hf
def test_both_routes_of_one_modeling_module_compile_in_one_process():
    """Qwen3 routed plainly (ops without qk_norm_rope) and fused, in one process: each route's forward binds its own
    name (apply_rotary_pos_emb, the fused call) in its closure; a copy of the module's globals shared by name once made
    one route read the other's."""
    from torch._dynamo.utils import counters

    ids = torch.randint(0, 128, (2, 8))
    plain, fused = tiny("qwen3"), tiny("qwen3")
    with torch.no_grad():
        want = plain(ids).logits
    patch(plain, ops=["rotary_embedding"])
    patch(fused)
    for model in (plain, fused):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
        assert dict(counters["graph_break"]) == {}
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
