"""tiered_ops.patch / unpatch on torch modules and tiny transformers models of each supported family.

Every family (hidden 64, 2 layers, random weights) patched gives the outputs and gradients of the stock model:
in fp32 to a few ulps, in bf16 with an error against the float64 model no larger than 2x the stock model's own
(its matmuls round too). The tier is forced (eager, or the Triton kernels on the interpreter) so the swapped
forwards run real kernels, not only torch's function under another name.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import rel
from torch import nn

import tiered_ops
from tiered_ops.decide import decide as select
from tiered_ops.decide import seam
from tiered_ops.models.patching import PATCHABLE_OPS, patch, patched, unpatch
from tiered_ops.registry import rel_error

try:
    import transformers
except ImportError:
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e '.[hf]')")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "bert"]


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    """Calls decide without measuring (eager when nothing is stored), unless a test forces a tier."""
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")


def tiny(family: str) -> nn.Module:
    """A transformers model of ``family`` at hidden 64, 2 layers, random weights, in eval mode (no dropout)."""
    t = transformers
    make = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**SMALL)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**SMALL)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**SMALL)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**SMALL, head_dim=16)),
        "gemma": lambda: t.GemmaForCausalLM(t.GemmaConfig(**SMALL, head_dim=16)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                                       n_positions=64, bos_token_id=0, eos_token_id=0)),
        "bert": lambda: t.BertModel(t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=128, vocab_size=128, max_position_embeddings=64)),
    }[family]
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # weights off their init (norm weights of 1 or 0 would hide a wrong weight formula)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def force_tier(monkeypatch: pytest.MonkeyPatch, tier: str, device: str = "cpu") -> None:
    """Every tiered_ops call runs ``tier`` (skipped where it cannot run on ``device``)."""
    why = tiered_ops.get_op("rms_norm").impls[tier].why_not(torch.device(device))
    if why:
        pytest.skip(f"{tier} tier unavailable here: {why}")

    def chosen(spec, problem, dtype, device, *args, **kwargs):
        impl = spec.impls[tier]
        return select.Selection(impl.fn, impl, {"op": spec.name, "chosen": impl.name, "reason": "forced by the test"})

    monkeypatch.setattr(seam, "select_problem", chosen)  # the per-call slow path decides through it
    select.clear_cache()


def _out(o):
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and parameter gradients of one forward/backward with a fixed random cotangent."""
    model.zero_grad()
    out = _out(model(ids))
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * cot).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for g in grads.values()])


@needs_hf
@pytest.mark.parametrize("tier", ["eager", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_patched_matches_stock(family, dtype, tier, monkeypatch):
    force_tier(monkeypatch, tier)
    model = tiny(family).to(dtype)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    truth = step(copy.deepcopy(model).double(), ids)
    stock = step(model, ids)
    report = patch(model)
    assert report.swapped and not report.left, str(report)
    got = step(model, ids)
    assert set(got[1]) == set(stock[1])
    if dtype == torch.float32:
        assert rel(got[0], stock[0]) < 1e-5, "output"
        # a gradient that is 0 in exact arithmetic (BERT's key bias: softmax ignores a shift) is roundoff: each
        # parameter's error is measured against the larger of its own gradient and the largest one
        scale = max(g.double().norm().item() for g in stock[1].values())
        for name in stock[1]:
            assert rel_error(got[1][name], stock[1][name], floor=scale) < 1e-5, name
    else:
        for what, g, s, t in [("output", got[0], stock[0], truth[0]),
                              ("gradients", _flat(got[1]), _flat(stock[1]), _flat(truth[1]))]:
            assert rel(g, t) <= 2 * rel(s, t), f"{what}: patched {rel(g, t):.2e} vs stock {rel(s, t):.2e}"


@needs_hf
@pytest.mark.parametrize("family,n_rms,n_ln,n_gelu", [
    ("llama", 5, 0, 0), ("qwen3", 9, 0, 0), ("gemma", 5, 0, 2), ("gpt2", 0, 5, 2), ("bert", 0, 5, 2)])
def test_family_report_lists_each_swap(family, n_rms, n_ln, n_gelu):
    model = tiny(family)
    report = patch(model)
    ops = [s.replacement.split()[0] for s in report.swapped]
    assert (ops.count("tiered_ops.rms_norm"), ops.count("tiered_ops.layer_norm"), ops.count("tiered_ops.gelu")) == (
        n_rms, n_ln, n_gelu), str(report)
    modules = dict(model.named_modules())
    assert all(patched(modules[s.path]) == s.replacement and type(modules[s.path]).__name__ == s.cls
               for s in report.swapped)


@needs_hf
def test_unpatch_restores_modules_and_outputs():
    model = tiny("gemma")
    ids = torch.randint(0, 128, (2, 8))
    before = {n: (type(m), m.forward.__func__) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    with torch.no_grad():
        stock = _out(model(ids))
    report = patch(model)
    assert list(model.state_dict()) == keys
    seen = []
    norm = model.model.layers[0].input_layernorm
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        model(ids)
    handle.remove()
    assert seen == [torch.Size([2, 8, 64])], "a forward hook on a swapped module still fires"
    assert patch(model).swapped == [] and len(patch(model).left) == len(report.swapped)  # patching twice: no-op
    assert unpatch(model) == len(report.swapped)
    for n, m in model.named_modules():
        assert (type(m), m.forward.__func__) == before[n] and "forward" not in m.__dict__ and patched(m) is None, n
    with torch.no_grad():
        assert torch.equal(_out(model(ids)), stock)
    assert unpatch(model) == 0


@needs_hf
def test_a_dtype_tiered_ops_does_not_take_runs_the_original_forward():
    model = tiny("llama")
    patch(model)
    x = torch.randn(3, 64, dtype=torch.float64)
    norm = model.model.norm
    want = norm.weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    out = norm(x)  # LlamaRMSNorm's own forward: it computes in fp32 whatever the input
    assert out.dtype == torch.float64 and rel(out, want) < 1e-6


@needs_hf
def test_ops_limits_the_swaps_and_the_rest_is_left_with_why():
    model = tiny("gemma")
    report = patch(model, ops=["gelu"])
    assert {s.replacement.split()[0] for s in report.swapped} == {"tiered_ops.gelu"}
    assert len(report.left) == 10, str(report)
    assert sum("rms_norm not in ops" in x.reason for x in report.left) == 5
    assert [x.path for x in report.left if "swiglu not in ops" in x.reason] == ["model.layers.0.mlp",
                                                                                "model.layers.1.mlp"]
    assert sum("rotary_embedding not in ops" in x.reason for x in report.left) == 2  # each layer's attention
    assert [x.path for x in report.left if "cross_entropy not in ops" in x.reason] == [""]  # the model's loss


@needs_hf
def test_hf_gelu_activations():
    from transformers import activations as A

    x = torch.randn(4, 33, dtype=torch.float64)
    erf, tanh = F.gelu(x), F.gelu(x, approximate="tanh")
    model = nn.ModuleDict(dict(
        erf=A.GELUActivation(), erf_py=A.GELUActivation(use_gelu_python=True), tanh=A.GELUTanh(),
        tanh_py=A.GELUTanh(use_gelu_tanh_python=True), new=A.NewGELUActivation(), fast=A.FastGELUActivation(),
        accurate=A.AccurateGELUActivation(), quick=A.QuickGELUActivation(), clipped=A.ClippedGELUActivation(-1, 1)))
    report = patch(model)
    assert sorted(s.path for s in report.swapped) == ["accurate", "erf", "erf_py", "fast", "new", "tanh", "tanh_py"]
    assert {x.path: x.reason.split()[0] for x in report.left} == {"quick": "x", "clipped": "GELU"}
    for name in ("erf", "erf_py"):
        assert rel(model[name](x.float()), erf) < 1e-6, name
    for name in ("tanh", "tanh_py", "new", "fast", "accurate"):
        assert rel(model[name](x.float()), tanh) < 1e-6, name


def _torch_modules() -> nn.ModuleDict:
    class OwnGELU(nn.GELU):
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(3)
    mods = nn.ModuleDict(dict(
        ln=nn.LayerNorm(33), ln_nobias=nn.LayerNorm(33, bias=False),
        ln_plain=nn.LayerNorm(33, elementwise_affine=False), ln_2d=nn.LayerNorm((4, 33)),
        rms=nn.RMSNorm(33, eps=1e-6), rms_plain=nn.RMSNorm(33, elementwise_affine=False),
        gelu=nn.GELU(), gelu_tanh=nn.GELU("tanh"), softmax=nn.Softmax(dim=1), softmax_implicit=nn.Softmax(),
        own_gelu=OwnGELU()))
    with torch.no_grad():
        for p in mods.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return mods


@pytest.mark.parametrize("tier", ["eager", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_modules_against_float64(dtype, tier, monkeypatch):
    force_tier(monkeypatch, tier)
    mods = _torch_modules()
    truth = {k: copy.deepcopy(m).double() for k, m in mods.items()}
    report = patch(mods.to(dtype))
    assert {x.path: x.reason.split(":")[0] for x in report.left} == {
        "softmax_implicit": "Softmax(dim=None)", "own_gelu": "subclass of GELU with its own forward"}
    assert len(report.swapped) == 9
    bound = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    x = (1 + 2 * torch.randn(2, 4, 33, generator=torch.Generator().manual_seed(4), dtype=torch.float64)).to(dtype)
    grad_bound = {torch.float32: 5e-5, torch.bfloat16: 2e-2}[dtype]
    for name in [s.path for s in report.swapped]:
        xi, xd = x.detach().requires_grad_(), x.double().requires_grad_()
        out, ref = mods[name](xi), truth[name](xd)
        assert out.dtype == dtype and rel(out, ref) <= bound, name
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        (out.double() * dy).sum().backward()
        (want,) = torch.autograd.grad((ref * dy).sum(), xd)
        assert rel(xi.grad, want) <= grad_bound, f"{name}: grad"


def test_a_copy_of_a_patched_model_stays_patched():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GELU())
    patch(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    x = torch.randn(2, 4)
    for copied in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert patched(copied[1]) == "tiered_ops.layer_norm" and type(copied[1]) is type(model[1])
        assert type(copied[1]) is not nn.LayerNorm and isinstance(copied[1], nn.LayerNorm)  # swapped, through its class
        assert torch.equal(copied(x), model(x))
        assert unpatch(copied) == 2 and patched(model[1]) and type(copied[1]) is nn.LayerNorm


def test_bad_arguments_say_which():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch("model")
    with pytest.raises(ValueError, match="ops must be a list of rms_norm"):
        patch(nn.LayerNorm(4), ops=["muladd"])
    with pytest.raises(ValueError, match="ops must be a list"):
        patch(nn.LayerNorm(4), ops="gelu")
    assert set(PATCHABLE_OPS) <= set(tiered_ops.OPS)


@needs_hf
@pytest.mark.parametrize("tier", [None, "triton"])
def test_compiled_patched_model_has_no_graph_break(tier, monkeypatch):
    if tier:
        force_tier(monkeypatch, tier)
    model = tiny("llama")
    patch(model)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        eager = _out(model(ids))  # decisions exist before tracing
        explained = torch._dynamo.explain(model)(ids)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        compiled = _out(torch.compile(model, fullgraph=True, backend="eager")(ids))
    assert rel(compiled, eager) < 1e-6
