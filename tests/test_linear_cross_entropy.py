import pytest
import torch
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, device_for, gpu, impls_of, truth64

import tiered_ops
from tiered_ops.ops.linear_cross_entropy import _problem as P

OP = "linear_cross_entropy"
PROBLEMS = [
    P((1, 64), 1000),  # one token
    P((3, 33), 1001),  # odd H and V: masked tails
    P((2, 16), 20003),  # a row longer than one Triton block: the looped path
    P((64, 32), 256, head_bias=True),  # many tokens, a head with a bias
    P((9, 16), 64, ignored=1.0),  # every target ignored: NaN mean, zero gradients
    P((16, 32), 100, ignored=0.25),  # some targets ignored
    P((7, 16), 129, label_smoothing=0.1, ignored=0.25),  # label smoothing with ignored rows
    P((6, 16), 33, reduction="none", ignored=0.25, head_bias=True),  # per-row losses, ignored rows 0
    P((6, 16), 33, reduction="sum", label_smoothing=0.2),  # summed
    P((9, 16), 64, reduction="sum", ignored=1.0),  # every target ignored: the sum is 0
]
# the op has no CUDA tier (docs/territories.md): its tiers of IMPLS only
TIERS = impls_of(OP, IMPLS)
KERNEL_IMPLS = ["triton", "triton_c1024", pytest.param("triton_c16384", marks=gpu)]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", TIERS)
def test_matches_float64(impl, dtype, problem):
    assert_matches(OP, impl, problem, dtype)


@pytest.mark.parametrize("problem", [P((7, 16), 129, label_smoothing=0.1, ignored=0.25, head_bias=True),
                                     P((6, 16), 33, reduction="none"), P((6, 16), 33, reduction="sum", head_bias=True),
                                     P((9, 16), 64, ignored=1.0, head_bias=True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", TIERS)
def test_gradients_match_float64(impl, dtype, problem):
    # hidden, weight and bias
    assert_matches(OP, impl, problem, dtype, seed=5, grad=True)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_variants_are_candidates_of_their_tier(impl):
    spec = tiered_ops.get_op(OP)
    assert spec.impls[impl].tier == spec.impls[impl.split("_")[0]].tier
    assert_matches(OP, impl, P((5, 16), 40, head_bias=True, ignored=0.25), torch.float32, grad=True)


def _kernel_op(impl: str):
    return getattr(torch.ops.tiered_ops, f"{OP}_{impl}")


@pytest.mark.parametrize("impl", ["triton"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
@pytest.mark.parametrize("reduction,grads", [("mean", True), ("mean", False), ("sum", True), ("sum", False),
                                             ("none", False)])
def test_chunks_of_any_size_match_float64(impl, chunk, reduction, grads):
    # chunks that divide N, leave a short last chunk, or hold all of N: the loss and every gradient as one pass's,
    # the gradients made in the forward (grads) or by the backward from recomputed logits
    tiered_ops.get_op(OP).impls[impl].why_not(device_for(impl))  # loads the tier's ops
    dev = device_for(impl)
    h = torch.randn(11, 24, device=dev, requires_grad=True)
    w = (torch.randn(37, 24, device=dev) / 3).requires_grad_()
    b = torch.randn(37, device=dev, requires_grad=True)
    t = torch.randint(0, 37, (11,), device=dev)
    t[[2, 9]] = -100
    loss = _kernel_op(impl)(h, w, t, b, -100, reduction, 0.1, None, chunk, grads)[0]
    g = torch.randn(loss.shape, device=dev)
    got = torch.autograd.grad(loss, (h, w, b), g)
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    want = truth64(OP, h64, w64, t, b64, -100, reduction, 0.1)
    assert_like_truth(loss, want, 1e-5, f"chunk {chunk}")
    for name, d, x in zip(("hidden", "weight", "bias"), got, torch.autograd.grad(want, (h64, w64, b64), g.double())):
        assert_like_truth(d, x, 1e-5, f"d{name}, chunk {chunk}")


@pytest.mark.parametrize("impl", TIERS)
def test_gradients_are_scaled_by_any_output_gradient(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op(OP).impls[impl].fn
    h, w = torch.randn(6, 16, device=dev), torch.randn(50, 16, device=dev) / 2
    t = torch.tensor([3, -100, 0, 49, 7, -100], device=dev)
    for reduction, g in [("mean", torch.tensor(0.0)), ("mean", torch.tensor(-3.5)), ("sum", torch.tensor(1e4)),
                         ("none", torch.tensor([1.0, 2.0, -1.0, 0.0, 5.0, 3.0]))]:
        hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
        got = torch.autograd.grad(fn(hl, wl, t, None, -100, reduction), (hl, wl), g.to(dev))
        h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
        want = torch.autograd.grad(truth64(OP, h64, w64, t, None, -100, reduction), (h64, w64), g.double().to(dev))
        for d, x in zip(got, want):
            assert_like_truth(d, x, 1e-5, f"{OP}/{impl} gradient, {reduction}, output gradient {g}")


@pytest.mark.parametrize("impl", TIERS)
def test_ignore_index_may_be_a_class_and_inputs_non_contiguous(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op(OP).impls[impl].fn
    h = torch.randn(24, 8, device=dev).t()  # (8, 24), column-major
    w = torch.randn(30, 48, device=dev)[:, ::2] / 3  # (30, 24), a column stride of 2
    t = torch.tensor([0, 1, 2, 0, 5, 0, 29, 3], device=dev)
    for reduction in ("mean", "none"):
        assert_like_truth(fn(h, w, t, None, 0, reduction, 0.1), truth64(OP, h, w, t, None, 0, reduction, 0.1), 1e-5)
    # training on the same strided views: the gradients of a scalar loss, made in the forward, for every reduction
    for reduction in ("mean", "sum", "none"):
        hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
        got = torch.autograd.grad(fn(hl, wl, t, None, 0, reduction, 0.1).sum(), (hl, wl))
        h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
        want = torch.autograd.grad(truth64(OP, h64, w64, t, None, 0, reduction, 0.1).sum(), (h64, w64))
        for name, d, x in zip(("hidden", "weight"), got, want):
            assert_like_truth(d, x, 1e-5, f"d{name}, {reduction}")


@pytest.mark.parametrize("impl", ["triton"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float32_loss_from_half_inputs(impl, reduction):
    # dtype=torch.float32 at the kernel tiers: float32 logits and loss, no bfloat16 rounding anywhere (eager rounds its
    # materialized logits to bfloat16, as the model's own LM head does)
    dev = device_for(impl)
    fn = tiered_ops.get_op(OP).impls[impl].fn
    h, w = torch.randn(6, 32, device=dev).bfloat16(), (torch.randn(300, 32, device=dev) / 3).bfloat16()
    t = torch.randint(0, 300, (6,), device=dev)
    t[2] = -100
    got = fn(h, w, t, None, -100, reduction, dtype=torch.float32)
    assert got.dtype == torch.float32
    want = truth64(OP, h, w, t, None, -100, reduction)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_public_op_trains():
    h = torch.randn(6, 20, requires_grad=True)
    w = torch.randn(30, 20, requires_grad=True)
    b = torch.randn(30, requires_grad=True)
    t = torch.tensor([1, 2, -100, 4, 5, 29])
    loss = tiered_ops.linear_cross_entropy(h, w, t, b, label_smoothing=0.1)
    loss.backward()
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    want = truth64(OP, h64, w64, t, b64, -100, "mean", 0.1)
    want.backward()
    assert_like_truth(loss, want, 1e-5)
    for got, x in ((h.grad, h64), (w.grad, w64), (b.grad, b64)):
        assert_like_truth(got, x.grad, 1e-5, "gradient")


@gpu
@pytest.mark.parametrize("impl", ["triton", "triton_c1024"])
@pytest.mark.parametrize("problem", [P((5000, 256), 32000, ignored=0.25), P((2100, 128), 128256, label_smoothing=0.1),
                                     P((1100, 96), 50257, reduction="none", head_bias=True)], ids=str)
def test_model_sized_vocabularies_over_several_chunks(impl, problem):
    assert_matches(OP, impl, problem, torch.bfloat16, grad=True)


@gpu
@pytest.mark.parametrize("impl", ["triton"])
def test_a_target_out_of_range_makes_its_row_nan_on_the_gpu(impl):
    fn = tiered_ops.get_op(OP).impls[impl].fn
    h = torch.randn(4, 64, device="cuda", requires_grad=True)
    w = torch.randn(1000, 64, device="cuda") / 8
    t = torch.tensor([1, 1000, -100, -3], device="cuda")
    loss = fn(h, w, t, None, -100, "none")
    assert loss[[1, 3]].isnan().all() and loss[0].isfinite() and loss[2].item() == 0.0
    (dh,) = torch.autograd.grad(loss, h, torch.ones(4, device="cuda"))
    assert dh[[1, 3]].isnan().all() and dh[0].isfinite().all() and (dh[2] == 0).all()


@gpu
def test_peak_memory_follows_the_chunk_and_the_memory_policy_sees_it():
    # the measurement's peak (timing.peak_bytes, what the memory policy reads) of a training step: chunks of 1024 <
    # 4096 < 16384 rows, and the eager tier's materialized logits above the default chunk
    from tiered_ops.measure.timing import peak_bytes

    spec = tiered_ops.get_op(OP)
    dev = torch.device("cuda")
    h = torch.randn(16384, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32000, 1024, device=dev) / 32).bfloat16().requires_grad_()
    t = torch.randint(0, 32000, (16384,), device=dev)

    def step(impl: str):
        def call():
            h.grad = w.grad = None
            spec.impls[impl].fn(h, w, t).backward()
        return call

    peaks = {impl: peak_bytes(step(impl), dev) for impl in ("triton_c1024", "triton", "triton_c16384", "eager")}
    assert peaks["triton_c1024"] < peaks["triton"] < peaks["triton_c16384"], peaks
    assert peaks["eager"] > peaks["triton"], peaks


@pytest.mark.parametrize("impl", ["triton"])
@pytest.mark.parametrize("grads", [True, False])
def test_odd_sizes_over_several_chunks(impl, grads):
    # 1823 tokens in chunks of 500 (a short last chunk), V = 781 and H = 67 (no multiple of any block), a bias, a
    # hidden read with a row stride: every gradient as the float64 math's
    tiered_ops.get_op(OP).impls[impl].why_not(device_for(impl))  # loads the tier's ops
    dev = device_for(impl)
    h = torch.randn(1823, 80, device=dev)[:, :67].requires_grad_()
    w = (torch.randn(781, 67, device=dev) / 8).requires_grad_()
    b = torch.randn(781, device=dev, requires_grad=True)
    t = torch.randint(0, 781, (1823,), device=dev)
    t[::7] = -100
    loss = _kernel_op(impl)(h, w, t, b, -100, "mean", 0.0, None, 500, grads)[0]
    got = torch.autograd.grad(loss, (h, w, b))
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    want = truth64(OP, h64, w64, t, b64)
    assert_like_truth(loss, want, 1e-5)
    for name, d, x in zip(("hidden", "weight", "bias"), got, torch.autograd.grad(want, (h64, w64, b64))):
        assert_like_truth(d, x, 1e-5, f"d{name}")


@pytest.mark.parametrize("impl", ["triton", "triton_c1024"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gradients_made_in_the_forward_match_float64(impl, dtype, reduction, bias):
    # a scalar loss in training: the forward makes the gradients, the backward scales them by an output gradient
    # other than 1 (each rounded once to the dtype); ignored targets and label smoothing
    spec = tiered_ops.get_op(OP)
    dev = device_for(impl)
    h = torch.randn(37, 48, device=dev).to(dtype).requires_grad_()
    w = (torch.randn(300, 48, device=dev) / 7).to(dtype).requires_grad_()
    leaves = [h, w] + ([(torch.randn(300, device=dev) / 2).to(dtype).requires_grad_()] if bias else [])
    t = torch.randint(0, 300, (37,), device=dev)
    t[::5] = -100
    loss = spec.impls[impl].fn(h, w, t, leaves[2] if bias else None, -100, reduction, 0.1)
    g = torch.tensor(-2.5, device=dev, dtype=loss.dtype)
    got = torch.autograd.grad(loss, leaves, g)
    l64 = [x.detach().double().requires_grad_() for x in leaves]
    want = truth64(OP, l64[0], l64[1], t, l64[2] if bias else None, -100, reduction, 0.1)
    assert_like_truth(loss, want, spec.rtol[dtype])
    for name, d, x in zip(("hidden", "weight", "bias"), got, torch.autograd.grad(want, l64, g.double())):
        assert d.dtype == dtype, name
        assert_like_truth(d, x, spec.grad_rtol[dtype], f"d{name}, {reduction}, output gradient -2.5")


def test_the_forward_makes_the_gradients_only_for_a_scalar_loss_in_training():
    from tiered_ops.ops.linear_cross_entropy import _kernel_args

    def grads(*a, **k) -> bool:
        return _kernel_args(*a, **k)[-1]

    h, w, b, t = torch.randn(4, 8), torch.randn(10, 8), torch.randn(10), torch.tensor([1, 2, -100, 9])
    assert not grads(h, w, t, b)  # nothing requires grad: the inference forward
    assert grads(h.requires_grad_(), w, t) and grads(h, w, t, reduction="sum")
    assert grads(h.detach(), w, t, b.requires_grad_())  # the bias alone
    assert not grads(h, w, t, reduction="none")  # a loss per row: the backward's output gradient is a vector
    with torch.no_grad():
        assert not grads(h, w, t)
    with torch.inference_mode():
        assert not grads(h, w, t)


@pytest.mark.parametrize("impl", ["triton"])
def test_the_forward_holds_gradients_only_when_asked(impl):
    # grads: dhidden in hidden's dtype, float32 dweight and dbias accumulators, of an output gradient of 1; without it
    # (inference, "none") three empty tensors: nothing more computed or held than the loss and the lse
    tiered_ops.get_op(OP).impls[impl].why_not(device_for(impl))  # loads the tier's ops
    dev = device_for(impl)
    h, w, b = torch.randn(9, 16, device=dev), torch.randn(40, 16, device=dev) / 3, torch.randn(40, device=dev)
    t = torch.randint(0, 40, (9,), device=dev)
    t[4] = -100
    with torch.no_grad():
        for reduction in ("mean", "sum", "none"):
            assert [o.numel() for o in _kernel_op(impl)(h, w, t, b, -100, reduction, 0.0, None, 4, False)[2:]] == \
                [0, 0, 0]
        loss, _, dh, dw, db = _kernel_op(impl)(h, w, t, b, -100, "mean", 0.1, None, 4, True)
    assert (dh.dtype, dw.dtype, db.dtype) == (torch.float32,) * 3 and dw.shape == w.shape and db.shape == b.shape
    l64 = [x.double().requires_grad_() for x in (h, w, b)]
    want = truth64(OP, l64[0], l64[1], t, l64[2], -100, "mean", 0.1)
    assert_like_truth(loss, want, 1e-5)
    for name, d, x in zip(("hidden", "weight", "bias"), (dh, dw, db), torch.autograd.grad(want, l64)):
        assert_like_truth(d, x, 1e-5, f"the forward's d{name}")


@pytest.mark.parametrize("impl", ["triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empty_input_trains(impl, reduction):
    # no token: mean NaN, sum 0, and gradients of the inputs' shapes (dweight and dbias zeros), as torch's
    fn = tiered_ops.get_op(OP).impls[impl].fn
    dev = device_for(impl)
    h, w = torch.randn(0, 16, device=dev, requires_grad=True), torch.randn(20, 16, device=dev, requires_grad=True)
    b = torch.randn(20, device=dev, requires_grad=True)
    loss = fn(h, w, torch.zeros(0, dtype=torch.int64, device=dev), b, -100, reduction)
    assert loss.isnan().item() if reduction == "mean" else loss.item() == 0.0
    dh, dw, db = torch.autograd.grad(loss, (h, w, b), torch.tensor(2.0, device=dev))
    assert dh.shape == h.shape and (dw == 0).all() and (db == 0).all()


@pytest.mark.parametrize("impl", ["triton"])
def test_double_backward_is_refused(impl):
    fn = tiered_ops.get_op(OP).impls[impl].fn
    dev = device_for(impl)
    h, w = torch.randn(5, 8, device=dev, requires_grad=True), torch.randn(11, 8, device=dev, requires_grad=True)
    (dh,) = torch.autograd.grad(fn(h, w, torch.randint(0, 11, (5,), device=dev)), h, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        dh.sum().backward()


@gpu
@pytest.mark.parametrize("n,h,v", [(16384, 1024, 32000), (8192, 4096, 128256)])  # the second: the default GPU problem
def test_gradients_in_the_forward_hold_no_more_memory_than_recomputing_them(n, h, v):
    # a training step's peak (timing.peak_bytes) with the gradients made in the forward (dhidden and the float32
    # dweight accumulator held from the forward to the backward) is no higher than with the backward recomputing the
    # logits; the inference forward's peak stays below both by at least that accumulator
    from tiered_ops.measure.timing import peak_bytes

    tiered_ops.get_op(OP).impls["triton"].why_not(torch.device("cuda"))  # loads the Triton tier's ops
    dev = torch.device("cuda")
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device=dev) / h ** 0.5).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)

    def step(grads: bool):
        def call():
            _kernel_op("triton")(hidden, w, t, None, -100, "mean", 0.0, None, 4096, grads)[0].backward()
        return call

    def infer():
        with torch.no_grad():
            _kernel_op("triton")(hidden, w, t, None, -100, "mean", 0.0, None, 4096, False)

    def peak(call) -> int:
        # each step measured alike: warmed once (one-time allocations fall outside), then from a baseline of the
        # inputs alone (an earlier step's gradients freed inside the measured call made its peak read that much low)
        call()
        hidden.grad = w.grad = None
        return peak_bytes(call, dev)

    fwd_grads, recompute, inference = peak(step(True)), peak(step(False)), peak(infer)
    assert fwd_grads <= recompute + 2 ** 20, (fwd_grads, recompute)  # slack: the allocator's blocks of the scalars
    assert inference + v * h * 4 <= min(fwd_grads, recompute), (inference, fwd_grads, recompute)


def test_a_scalar_loss_makes_each_chunks_logits_once(monkeypatch):
    # the gradients made in the forward: one logits GEMM a chunk in all, the backward only scales; reduction "none"
    # (and a forward without a gradient wanted) keeps the recomputing backward: the logits made twice a chunk
    import triton_src.linear_cross_entropy as launcher
    from tiered_ops.ops.linear_cross_entropy import _kernel_args

    dev = device_for("triton")
    tiered_ops.get_op(OP).impls["triton"].why_not(dev)  # loads the tier's ops
    made, real = [], launcher._logits
    monkeypatch.setattr(launcher, "_logits", lambda *a: made.append(a[0].shape[0]) or real(*a))
    h = torch.randn(10, 8, device=dev, requires_grad=True)
    w = torch.randn(12, 8, device=dev, requires_grad=True)
    t = torch.randint(0, 12, (10,), device=dev)
    for reduction, rows in (("mean", [4, 4, 2]), ("sum", [4, 4, 2]), ("none", [4, 4, 2] * 2)):
        made.clear()
        _kernel_op("triton")(*_kernel_args(h, w, t, None, -100, reduction, chunk=4))[0].sum().backward()
        assert made == rows, (reduction, made)

