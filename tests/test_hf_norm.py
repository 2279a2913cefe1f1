"""The Hugging Face norm forms of rms_norm and fused_add_rms_norm (weight_offset, cast_before_weight) against
transformers' own modules: LlamaRMSNorm, Qwen3RMSNorm (cast to the input dtype, then the weight) and GemmaRMSNorm
((1 + w) in fp32, then the cast).

What equality can hold. The modules and the kernels do the same fp32 operations in the same order, except the sum of
squares, whose order is each implementation's own: a row whose partial sums are all exact (the inputs below of the
form k/8, rows of 64) gives the same rstd everywhere, so the output must be bit-equal (fp32, and fp16/bf16 on a GPU).
On random rows rstd may differ in its last bit, so a bf16/fp16 output may differ by an ulp where the product sits
near a rounding boundary, and an fp32 one by a few (measured: 3 at rows of 1000; bound 4). The Triton interpreter
rounds fp32 -> bf16 toward zero (numpy has no bf16; a GPU rounds to nearest even), so on the CPU a bf16 output is
held to 3 ulps (a truncation at each of Llama's two roundings, each ulp of the first scaled by the weight). An fp32
output over bf16/fp16 x (an fp32 weight in Llama's form) is compared in x's dtype: its error is that rounding's.
"""

from __future__ import annotations

import pytest
import torch
from helpers import HAS_CUDA, gpu

import tiered_ops

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

EPS = 1e-6
LOW = [torch.bfloat16, torch.float16]
FORMS = {  # module class, its kwargs in tiered_ops, the weight as the module's init would hold it (+ noise)
    "llama": (LlamaRMSNorm, dict(cast_before_weight=True), 1.0),
    "qwen3": (Qwen3RMSNorm, dict(cast_before_weight=True), 1.0),
    "gemma": (GemmaRMSNorm, dict(weight_offset=1.0), 0.0),
}

# Triton runs on the interpreter on the CPU and compiled on a GPU: there it is one of the GPU script's (-m gpu) tests.
TRITON = pytest.param("triton", marks=gpu) if HAS_CUDA else "triton"


def _module(form: str, n: int, wdtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    cls, _, base = FORMS[form]
    m = cls(n, eps=EPS).to(device)
    g = torch.Generator().manual_seed(seed)
    m.weight.data = (base + 0.5 * torch.randn(n, generator=g)).to(device=device, dtype=wdtype)
    return m


def _exact_rows(rows: int, n: int, dtype: torch.dtype, device: torch.device, seed: int = 1) -> torch.Tensor:
    """Values k/8 (|k| <= 24): every square and partial sum over a row of 64 is exact in fp32, whatever the order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-24, 25, (rows, n), generator=g).float() / 8).to(device=device, dtype=dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place of a's dtype between a and b (same dtype, finite)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ia, ibb = a.contiguous().view(ib).long(), b.contiguous().view(ib).long()
    # sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF if ib == torch.int32 else ia & 0x7FFF), ia)
    ibb = torch.where(ibb < 0, -(ibb & 0x7FFFFFFF if ib == torch.int32 else ibb & 0x7FFF), ibb)
    return int((ia - ibb).abs().max().item()) if a.numel() else 0


def _ours(impl: str, form: str, m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    fn = tiered_ops.get_op("rms_norm").impls[impl].fn
    return fn(x, (x.shape[-1],), m.weight, EPS, **FORMS[form][1])


def _dev(impl: str) -> torch.device:
    return torch.device("cuda" if HAS_CUDA or impl == "cuda" else "cpu")


# ---- forward: bit-equal where the sum is exact, an ulp otherwise --------------------------------------------------

@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("impl", ["eager", TRITON, pytest.param("cuda", marks=gpu)])
def test_forward_matches_hf_module(impl, form, dtype, wdtype):
    dev = _dev(impl)
    wdt = dtype if wdtype == "same" else torch.float32
    m = _module(form, 64, wdt, dev)
    with torch.no_grad():
        x = _exact_rows(37, 64, dtype, dev)
        want, got = m(x), _ours(impl, form, m, x)
        assert got.dtype == want.dtype, f"{form}: output dtype {got.dtype}, the module's {want.dtype}"
        interp_bf16 = dev.type == "cpu" and impl != "eager" and dtype == torch.bfloat16
        # the interpreter's truncation at each of the form's roundings (two in Llama's) drifts an ulp or two more
        trunc = 3 if interp_bf16 else 0
        if interp_bf16:  # an fp32 output (fp32 weight) carries the bf16 rounding's error: compared in bf16
            got, want = got.to(dtype), want.to(dtype)
        assert _ulps(got, want) <= trunc, f"{impl}/{form} {dtype} exact rows: not bit-equal"
        x = torch.randn(37, 1000, generator=torch.Generator().manual_seed(2)).to(device=dev, dtype=dtype) * 3
        m = _module(form, 1000, wdt, dev, seed=3)
        want, got = m(x), _ours(impl, form, m, x)
        # an fp32 output over bf16/fp16 x (fp32 weight, Llama) holds x's dtype's rounding of x * r: an ulp there is
        # |w| ulps after it; compared in x's dtype, a few ulps
        mixed = got.dtype != dtype
        got, want = got.to(dtype), want.to(dtype)
        # fp32: rstd an ulp off (the sum's order), then two roundings (x * r, the weight): a few ulps
        bound = 0 if impl == "eager" else 4 if dtype == torch.float32 else max(3 if mixed else 1, trunc)
        assert _ulps(got, want) <= bound, f"{impl}/{form} {dtype} random rows: > {bound} ulp"


@pytest.mark.parametrize("form", FORMS)
def test_triton_long_rows_match_hf_module(form):
    # rows longer than the register-resident forward: the looped kernels take the same flags
    dev = _dev("triton")
    m = _module(form, 40009, torch.float16, dev)
    x = torch.randn(2, 40009, generator=torch.Generator().manual_seed(4)).to(device=dev, dtype=torch.float16)
    with torch.no_grad():
        assert _ulps(_ours("triton", form, m, x), m(x)) <= 1


# ---- backward: HF's autograd, within the dtype's gradient bound ---------------------------------------------------

GRAD_RTOL = {torch.float32: 5e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("impl", [TRITON, pytest.param("cuda", marks=gpu)])
def test_backward_matches_hf_autograd(impl, form, dtype, wdtype):
    dev = _dev(impl)
    wdt = dtype if wdtype == "same" else torch.float32
    m = _module(form, 300, wdt, dev)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(24, 300, generator=g).to(device=dev, dtype=dtype)
    dy = None
    outs = []
    for run in ("hf", "ours"):
        x = x0.clone().requires_grad_(True)
        m.weight.grad = None
        y = m(x) if run == "hf" else _ours(impl, form, m, x)
        dy = torch.randn(y.shape, generator=g).to(device=dev, dtype=y.dtype) if dy is None else dy
        y.backward(dy)
        outs.append((x.grad, m.weight.grad.clone()))
    (dx_hf, dw_hf), (dx, dw) = outs
    assert dx.dtype == dx_hf.dtype and dw.dtype == dw_hf.dtype
    # HF rounds g = dy * w to x's dtype before its fp32 backward and each dw product to the weight's dtype; ours does
    # not: the bound of the less precise of the two dtypes involved
    bound = max(GRAD_RTOL[dtype], GRAD_RTOL[wdt])
    assert _rel(dx, dx_hf) < bound, f"{impl}/{form} {dtype}: dx off HF's by {_rel(dx, dx_hf):.2e}"
    assert _rel(dw, dw_hf) < bound, f"{impl}/{form} {dtype}: dw off HF's by {_rel(dw, dw_hf):.2e}"


# ---- the op's checks --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["eager", TRITON])
def test_form_argument_errors(impl):
    fn = tiered_ops.get_op("rms_norm").impls[impl].fn
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="weight_offset"):
        fn(x, (8,), w, EPS, weight_offset=1.0, cast_before_weight=True)
    with pytest.raises(ValueError, match="needs a weight"):
        fn(x, (8,), None, EPS, weight_offset=1.0)
    with pytest.raises(TypeError, match="weight"):
        fn(x.bfloat16(), (8,), w.half(), EPS, cast_before_weight=True)


def test_public_op_takes_the_forms_by_keyword_only(monkeypatch):
    # nothing measured, nothing stored: the eager tier, bit-equal to the module (a tuned choice, compile or the
    # interpreted Triton tier, is within the dtype's bound, not bit-equal)
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(TypeError):
        tiered_ops.rms_norm(x, (8,), w, EPS, 1.0)  # the torch signature ends at eps
    y = tiered_ops.rms_norm(x.bfloat16(), (8,), w, EPS, cast_before_weight=True)
    assert y.dtype == torch.float32  # promote(weight, x), as the Llama module gives
    m = _module("llama", 8, torch.float32, torch.device("cpu"))
    m.weight.data = w
    assert _ulps(y, m(x.bfloat16())) <= 1


# ---- the fused residual form: HF's `residual = residual + x`, then the norm of it ---------------------------------

@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("form", ["llama", "gemma"])
@pytest.mark.parametrize("impl", ["eager", TRITON, pytest.param("cuda", marks=gpu)])
def test_fused_add_matches_hf_sum_then_module(impl, form, dtype, wdtype):
    dev = _dev(impl)
    wdt = dtype if wdtype == "same" else torch.float32
    fn = tiered_ops.get_op("fused_add_rms_norm").impls[impl].fn
    m = _module(form, 64, wdt, dev)
    g = torch.Generator().manual_seed(6)
    x = _exact_rows(29, 64, dtype, dev, seed=7)
    res = _exact_rows(29, 64, dtype, dev, seed=8)  # sums of k/8 stay exact: bit-equality as for rms_norm
    x0, r0 = x.clone(), res.clone()
    s_hf = r0 + x0
    want = m(s_hf)
    with torch.no_grad():
        y, s = fn(x, res, (64,), m.weight, EPS, **FORMS[form][1])
    assert torch.equal(s, s_hf)
    assert y.dtype == want.dtype
    interp_bf16 = dev.type == "cpu" and impl != "eager" and dtype == torch.bfloat16
    yy, ww = (y.to(dtype), want.to(dtype)) if interp_bf16 else (y, want)
    assert _ulps(yy, ww.detach()) <= (3 if interp_bf16 else 0)
    # gradients: HF's autograd of the sum and the module, for both outputs used downstream
    outs = []
    for run in ("hf", "ours"):
        xa, ra = x0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
        m.weight.grad = None
        if run == "hf":
            s2 = ra + xa
            y2 = m(s2)
        else:
            y2, s2 = fn(xa, ra, (64,), m.weight, EPS, **FORMS[form][1])
        if not outs:
            dy = torch.randn(y2.shape, generator=g).to(device=dev, dtype=y2.dtype)
            ds = torch.randn(s2.shape, generator=g).to(device=dev, dtype=s2.dtype)
        torch.autograd.backward([y2, s2], [dy, ds])
        outs.append((xa.grad, ra.grad, m.weight.grad.clone()))
    bound = max(GRAD_RTOL[dtype], GRAD_RTOL[wdt])
    for a, b, what in zip(outs[1], outs[0], ("dx", "dresidual", "dw")):
        assert a.dtype == b.dtype and _rel(a, b) < bound, f"{impl}/{form} {dtype}: {what} off HF's by {_rel(a, b):.2e}"


# ---- tiered_ops.patch: one call of the one-launch form, bit-equal to the module's own forward ----------------------

@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tier", ["eager", TRITON])
def test_patched_module_is_one_call_bit_equal(tier, form, dtype, wdtype, monkeypatch):
    from tiered_ops.decide import decide as select
    from tiered_ops.decide import seam
    from tiered_ops.models import patch_modules

    def chosen(spec, problem, dt, device, *args, **kwargs):
        impl = spec.impls[tier]
        return select.Selection(impl.fn, impl, {"op": spec.name, "chosen": impl.name, "reason": "forced by the test"})

    monkeypatch.setattr(seam, "select_problem", chosen)
    select.clear_cache()
    calls = []
    real = patch_modules.rms_norm
    monkeypatch.setattr(patch_modules, "rms_norm", lambda *a, **k: calls.append(k) or real(*a, **k))
    dev = torch.device("cuda" if tier == "triton" and HAS_CUDA else "cpu")  # the Triton tier compiled where it can be
    m = _module(form, 64, dtype if wdtype == "same" else torch.float32, dev)
    x = _exact_rows(16, 64, dtype, dev, seed=9)
    with torch.no_grad():
        want = m(x)
        report = tiered_ops.patch(m)
        assert [s.path for s in report.swapped] == [""], str(report)
        got = m(x)
    assert calls == [FORMS[form][1]], f"{form}: {calls}"  # one tiered_ops.rms_norm in the HF form, nothing around it
    assert got.dtype == want.dtype and torch.equal(got, want), f"{tier}/{form} {dtype}: not bit-equal"
    select.clear_cache()
