"""Every Triton and CUDA entry point, every op: bad input is a clear error naming the argument, never garbage or a
CUDA fault; NaN and Inf propagate exactly as in eager. Generic over the registry (the per-op files test the
op-specific arguments: normalized_shape, dim, approximate, bias shape)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import HAS_CUDA, builtin_ops, device_for, gpu, op_impls

import tiered_ops
from tiered_ops.decide import decide, seam
from tiered_ops.measure.gate import arg_names
from tiered_ops.registry import Tier, as_outputs
from tiered_ops.tiers.catalog import get_op

OPS = [s.name for s in builtin_ops()]
KERNEL_TIERS = ["triton", pytest.param("cuda", marks=gpu)]


MASKS = (torch.isnan, torch.isposinf, torch.isneginf)


def _dev(impl: str) -> torch.device:
    return torch.device("cuda") if HAS_CUDA or impl == "cuda" else torch.device("cpu")


def _inputs(op: str, dev: torch.device, **params):
    spec = get_op(op)
    problem = spec.problem((5, 37), **params)
    return spec, spec.make_inputs(problem, torch.float32, dev, 0)


def _each_tensor_replaced(spec, inp, how):
    """(argument name, args) for each tensor argument of ``inp`` in turn replaced by ``how(tensor)``."""
    names = arg_names(spec)
    for i, a in enumerate(inp.args):
        if isinstance(a, torch.Tensor):
            args = list(inp.args)
            args[i] = how(a)
            yield names[i], args


@pytest.mark.parametrize("op,impl", op_impls(OPS, KERNEL_TIERS))  # eager against the math: tests/test_<op>.py
def test_nan_and_inf_propagate_like_eager(op, impl):
    dev = _dev(impl)
    for params in get_op(op).variants:  # a few rows of an odd length at each of the op's parameter variants
        spec, inp = _inputs(op, dev, **params)
        x = inp.args[0].clone()
        rows = x.view(-1, x.shape[-1]) if x.dim() > 2 else x  # an op whose first input has more dims: its rows
        rows[0, 3], rows[1, 5], rows[2, 7], rows[3, 0] = float("nan"), float("inf"), -float("inf"), 1e30
        args = (x, *inp.args[1:])
        gots = as_outputs(spec.impls[impl].fn(*args, **inp.kwargs))
        # torch's own CPU and CUDA kernels disagree at some non-finite inputs (CUDA's rms_norm makes a whole row NaN
        # when it holds an Inf, the CPU's only that element; CUDA's gelu(-inf) is NaN): either eager is accepted.
        wants = [as_outputs(spec.reference(*args, **inp.kwargs)),
                 as_outputs(spec.reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args),
                                           **inp.kwargs))]
        assert len(gots) == len(wants[0])
        for k, got in enumerate(gots):  # each output of the op
            got = got.cpu()
            want = next((w[k].cpu() for w in wants if all(torch.equal(m(got), m(w[k].cpu())) for m in MASKS)),
                        wants[0][k].cpu())
            fin = torch.isfinite(want)
            torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


def _other_kind(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.int32) if a.is_floating_point() else a.to(torch.float32)


@pytest.mark.parametrize("op,impl", op_impls(OPS, KERNEL_TIERS))
def test_integer_input_names_the_argument(op, impl):
    """A floating argument given as int32, or an integer one (class indices) given as float32: a dtype error."""
    dev = _dev(impl)
    spec, inp = _inputs(op, dev)
    wrong_kind = lambda a: a.to(torch.int32) if a.is_floating_point() else a.to(torch.float32)  # noqa: E731
    for name, args in _each_tensor_replaced(spec, inp, wrong_kind):
        with pytest.raises((TypeError, ValueError, RuntimeError), match=rf"\b{name}\b.*(dtype|float)"):
            spec.impls[impl].fn(*args, **inp.kwargs)


@gpu
@pytest.mark.parametrize("op,impl", op_impls(OPS, ["triton", "cuda"]))
def test_a_tensor_on_the_wrong_device_names_the_argument(op, impl):
    spec, inp = _inputs(op, torch.device("cuda"))
    for name, args in _each_tensor_replaced(spec, inp, lambda a: a.cpu()):
        with pytest.raises((TypeError, ValueError, RuntimeError), match=rf"\b{name}\b.*(CUDA|cuda|device)"):
            spec.impls[impl].fn(*args, **inp.kwargs)
    torch.cuda.synchronize()  # and the context is still healthy: no kernel ran on a host pointer


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grad", [False, True])
def test_public_op_names_an_argument_that_is_not_a_tensor(op, grad):
    """``tiered_ops.<op>``'s hot path reads ``.requires_grad`` of each tensor argument: a list in their place is a
    TypeError naming it, with grad mode on or off (not an AttributeError from inside the package)."""
    import tiered_ops

    spec, inp = _inputs(op, torch.device("cpu"))
    for name, args in _each_tensor_replaced(spec, inp, lambda a: a.tolist()):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match=rf"'{name}' must be a torch.Tensor"):
            getattr(tiered_ops, op)(*args, **inp.kwargs)


# ---- the op's contract: validated once, before any tier runs, on every path ---------------------------------------

CPU_TIERS = ["eager", "compile", "triton"]  # triton: on the interpreter here
ALL_TIERS = [*CPU_TIERS, pytest.param("cuda", marks=gpu)]


def force(monkeypatch, tier: str) -> None:
    """Every tiered_ops.<op> call and every select_backend runs ``tier``."""
    def chosen(spec, problem, dtype, device, *args, **kwargs):
        impl = spec.impls[tier]
        return decide.Selection(impl.fn, impl, {"op": spec.name, "chosen": impl.name, "reason": "forced by the test"})

    monkeypatch.setattr(seam, "select_problem", chosen)
    monkeypatch.setattr(decide, "select_problem", chosen)
    decide.clear_cache()


@pytest.mark.parametrize("impl", ["eager", "compile"])
@pytest.mark.parametrize("op", OPS)
def test_integer_input_names_the_argument_at_the_torch_tiers(op, impl):
    """The torch tiers hold the same contract as the kernel tiers (the compile tier once returned zeros)."""
    test_integer_input_names_the_argument(op, impl)


@pytest.mark.parametrize("tier", CPU_TIERS)
def test_select_backend_callable_validates(monkeypatch, tier):
    force(monkeypatch, tier)
    sel = tiered_ops.select_backend("softmax", (4, 8))
    with pytest.raises(TypeError, match=r"\bx\b must be a floating tensor.*got dtype torch.int64"):
        sel(torch.ones(4, 8, dtype=torch.int64))


def _bad_cases() -> list:
    """(op, case, tier) for every bad input each op declares (``OpSpec.bad_inputs``) at each of its implementations
    (the CUDA tier where there is a GPU; a case refused on the host only at the tiers that run there)."""
    cases = []
    for spec in builtin_ops():
        for case in spec.bad_inputs:
            for impl in spec.impls.values():
                if impl.tier == Tier.PEER or not set(impl.devices) & set(case.devices):
                    continue
                if HAS_CUDA and impl.tier == Tier.TRITON and "cuda" not in case.devices:
                    continue  # where there is a GPU the Triton tier runs there, not on the interpreter
                marks = gpu if impl.devices == ("cuda",) else ()
                cases.append(pytest.param(spec.name, case, impl.name, marks=marks,
                                          id=f"{spec.name}-{case.what}-{impl.name}"))
    return cases


@pytest.mark.parametrize("op,case,tier", _bad_cases())
def test_declared_bad_input_is_a_clear_error_on_every_path(monkeypatch, op, case, tier):
    """Each declared bad input is refused with its error, naming the argument: by the implementation, by
    ``tiered_ops.<op>`` with that tier decided and, after a good call of the same shapes where the case has one (the
    per-call path's key holds no values), by that path again and by ``select_backend``'s callable."""
    spec = get_op(op)
    dev = torch.device("cpu") if case.devices == ("cpu",) else device_for(tier)
    args, kwargs = case.call(dev)
    force(monkeypatch, tier)
    calls = [spec.impls[tier].fn, getattr(tiered_ops, op)]
    if case.good is not None:
        good_args, good_kwargs = case.good(dev)
        getattr(tiered_ops, op)(*good_args, **good_kwargs)
        p = spec.problem_of(*good_args, **good_kwargs)
        dtype = next(a.dtype for a in good_args if isinstance(a, torch.Tensor))
        calls.append(tiered_ops.select_backend(op, p.shape, dtype, dev, **p.kw))
    for fn in calls:
        with pytest.raises(case.error, match=case.match):
            fn(*args, **kwargs)


@pytest.mark.parametrize("tier", CPU_TIERS + ["eager_segment_reduce"])
def test_segment_sum_without_segments_stays_in_the_graph(tier):
    """S = 0 (offsets [0], E = 0): an empty output that backward runs through (dvalues empty), at every tier."""
    dev = device_for(tier)
    v = torch.zeros(0, 4, device=dev, requires_grad=True)
    out = get_op("segment_sum").impls[tier].fn(v, torch.zeros(1, dtype=torch.int64, device=dev))
    assert out.shape == (0, 4) and out.requires_grad
    out.sum().backward()
    assert v.grad is not None and v.grad.shape == (0, 4)


def test_op_arguments_name_what_is_wrong():
    with pytest.raises(TypeError, match=r"shapes: dim 0 must be an integer, got 8.5"):
        tiered_ops.select_backend("softmax", (8.5, 64))
    with pytest.raises(TypeError, match=r"rms_norm: normalized_shape: dim 0 must be an integer, got 64.5"):
        tiered_ops.select_backend("rms_norm", (8, 64), normalized_shape=(64.5,))
    with pytest.raises(TypeError, match=r"rms_norm: normalized_shape: dim 0 must be an integer, got 64.5"):
        tiered_ops.rms_norm(torch.randn(8, 64), (64.5,))
    with pytest.raises(TypeError, match=r"select_backend: op 'softmax' takes no parameter 'foo' \(its parameters: dim"):
        tiered_ops.select_backend("softmax", (4, 8), foo=1)
    with pytest.raises(TypeError, match=r"tiered_ops.softmax: x must be float32, bfloat16 or float16.*float64"):
        tiered_ops.softmax(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"softmax at .*: measuring it needs at least .* GiB .* more than the"):
        tiered_ops.select_backend("softmax", (1 << 40, 1 << 20), tune=True)


@pytest.mark.skipif(HAS_CUDA, reason="names a CUDA device on a machine without one")
def test_a_cuda_device_without_cuda_is_a_clear_error():
    for dev in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=r"device: cuda.* asked for, but torch"):
            tiered_ops.select_backend("softmax", (4, 8), device=dev)


# ---- one answer whichever tier is decided ------------------------------------------------------------------------

MIXED = {  # op -> (call(x, p), torch's answer(x, p)): p is the op's floating parameter of another dtype
    "rms_norm": (lambda x, p: tiered_ops.rms_norm(x, (x.shape[-1],), p), lambda x, p: F.rms_norm(x, (16,), p)),
    "fused_add_rms_norm": (lambda x, p: tiered_ops.fused_add_rms_norm(x, x * 0.5, (16,), p),
                           lambda x, p: (F.rms_norm(x + x * 0.5, (16,), p), x + x * 0.5)),
    "gelu": (lambda x, p: tiered_ops.gelu(x, p), lambda x, p: F.gelu(x + p)),
    "layer_norm": (lambda x, p: tiered_ops.layer_norm(x, (16,), p, p * 0.1),
                   lambda x, p: F.layer_norm(x, (16,), p, p * 0.1)),
}
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("tier", ALL_TIERS)
@pytest.mark.parametrize("x_dtype,p_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("op", sorted(MIXED))
def test_mixed_dtypes_give_torchs_answer_at_every_tier(monkeypatch, op, x_dtype, p_dtype, tier):
    """A parameter of another dtype than x: torch's dtype and values (within the output dtype's bound), and
    gradients of each input's dtype, whichever tier is decided; where torch refuses the mix (layer_norm's float32 x
    with a bfloat16 weight), every tier refuses it too, naming the parameter."""
    if op == "layer_norm" and not (x_dtype != torch.float32 and p_dtype == torch.float32):
        force(monkeypatch, tier)
        with pytest.raises(TypeError, match=r"layer_norm: weight must have x's dtype"):
            MIXED[op][0](torch.randn(4, 16, dtype=x_dtype), torch.randn(16, dtype=p_dtype))
        return
    dev = device_for(tier)
    force(monkeypatch, tier)
    call, want_fn = MIXED[op]
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 16, generator=g).to(x_dtype).to(dev)
    p0 = (1 + 0.5 * torch.randn(16, generator=g)).to(p_dtype).to(dev)
    for train in (False, True):
        x, p = x0.clone().requires_grad_(train), p0.clone().requires_grad_(train)
        # torch's answer from its CPU kernels, which take every such mix (its CUDA layer_norm refuses a bfloat16 x
        # with float32 parameters: "expected scalar type BFloat16 but found Float")
        xr, pr = x0.cpu().clone().requires_grad_(train), p0.cpu().clone().requires_grad_(train)
        got, want = as_outputs(call(x, p)), as_outputs(want_fn(xr, pr))
        for o, w in zip(got, want):
            assert o.dtype == w.dtype, (op, tier, o.dtype, w.dtype)
            assert (o.cpu().double() - w.double()).norm() <= 2 * BOUND[w.dtype] * w.double().norm()
        if train:
            sum(o.float().sum() for o in got).backward()
            sum(w.float().sum() for w in want).backward()
            bound = 4 * max(BOUND[x_dtype], BOUND[p_dtype])  # each gradient carries the roundings of both dtypes
            for a, b in ((x, xr), (p, pr)):
                assert a.grad.dtype == b.grad.dtype == a.dtype
                assert (a.grad.cpu().double() - b.grad.double()).norm() <= bound * b.grad.double().norm() + 1e-6


@pytest.mark.parametrize("tier", ALL_TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm"])
def test_eps_none_is_torchs_default_at_every_tier(monkeypatch, op, dtype, tier):
    """eps=None is torch's default, the compute dtype's eps (float32's), not x's dtype's: rows of mean square 1e-6
    are 100x apart between the two."""
    dev = device_for(tier)
    force(monkeypatch, tier)
    x = (1e-3 * torch.randn(4, 64)).to(dtype).to(dev)
    got = as_outputs(tiered_ops.rms_norm(x, (64,)) if op == "rms_norm"
                     else tiered_ops.fused_add_rms_norm(x, x, (64,)))[0]
    want = F.rms_norm(x if op == "rms_norm" else x + x, (64,))
    assert (got.double() - want.double()).norm() <= 2 * BOUND[dtype] * want.double().norm()


CE_ROWS = [[float("nan"), 1.0, 2.0, 3.0], [float("inf"), 1.0, 2.0, 3.0], [-float("inf"), 1.0, 2.0, 3.0],
           [-float("inf")] * 4, [0.5, 1.0, 2.0, 3.0]]


@pytest.mark.parametrize("tier", ALL_TIERS)
@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.0), ("none", 0.0), ("mean", 0.1),
                                                 ("none", 0.2)])
def test_cross_entropy_ignored_row_with_non_finite_logits_is_torchs(tier, reduction, smoothing):
    """An ignored row's loss is 0 whatever its logits; its gradient is torch's 0 * softmax: NaN across the row where
    its log-sum-exp is not finite (a NaN, a +inf, every entry -inf), else 0."""
    dev = device_for(tier)
    spec = get_op("cross_entropy")
    for row in CE_ROWS:
        logits = torch.tensor([row, [0.0, 1.0, 2.0, 3.0], [3.0, -1.0, 0.0, 2.0]], device=dev)
        target = torch.tensor([-100, 1, 3], device=dev)
        x, xr = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        got = spec.impls[tier].fn(x, target, -100, reduction, smoothing)
        want = F.cross_entropy(xr, target, reduction=reduction, label_smoothing=smoothing)
        torch.testing.assert_close(got, want, equal_nan=True)
        g = torch.full_like(want, 3.0)
        got.backward(g)
        want.backward(g)
        torch.testing.assert_close(x.grad, xr.grad, equal_nan=True, msg=lambda m: f"row {row}: {m}")
