"""linear_cross_entropy's kernel tiers in training: a compiled step traced once per grad mode, and the forward's
gradients of a half-precision head with its dlogits written over the chunk's logits."""

import pytest
import torch
from helpers import assert_like_truth, device_for, gpu, truth64

import tiered_ops

OP = "linear_cross_entropy"


def _kernel_op(impl: str):
    return getattr(torch.ops.tiered_ops, f"{OP}_{impl}")


def _step_matches_float64(step, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, reduction: str) -> None:
    """A compiled ``fn(h, w, t, None, -100, reduction, 0.1) * 3.0``: its loss, gradients and inference forward against
    float64."""
    loss = step(h, w, t)
    g = torch.randn(loss.shape, device=loss.device)
    got = torch.autograd.grad(loss, (h, w), g)
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    want = truth64(OP, h64, w64, t, None, -100, reduction, 0.1) * 3.0
    assert_like_truth(loss, want, 1e-5)
    for name, d, x in zip(("hidden", "weight"), got, torch.autograd.grad(want, (h64, w64), g.double())):
        assert_like_truth(d, x, 1e-5, f"d{name}")
    with torch.no_grad():
        assert_like_truth(step(h, w, t), want, 1e-5, "the inference forward")


@pytest.mark.parametrize("impl", ["triton", "triton_c1024"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_compiled_step_traces_once_per_grad_mode(impl, reduction):
    # the kernel op traced (dynamo, fullgraph) and called again and again, in training and under no_grad, with fresh
    # inputs of the same shapes: one graph per grad mode (the grads argument is fixed from it at trace time), no
    # other recompile; and the cases of one test, one code object, fit under dynamo's recompile limit
    from torch._dynamo.utils import counters

    dev = device_for(impl)  # the interpreter's CPU here, the GPU where there is one (Triton takes no CPU tensor there)
    tiered_ops.get_op(OP).impls[impl].why_not(dev)  # loads the tier's ops
    fn = tiered_ops.get_op(OP).impls[impl].fn
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda h, w, t: fn(h, w, t, None, -100, reduction, 0.1) * 3.0, fullgraph=True,
                         backend="eager")
    for _ in range(3):
        h = torch.randn(12, 16, device=dev, requires_grad=True)
        w = (torch.randn(40, 16, device=dev) / 4).requires_grad_()
        t = torch.randint(0, 40, (12,), device=dev)
        t[::4] = -100
        _step_matches_float64(step, h, w, t, reduction)
    assert counters["stats"]["unique_graphs"] == 2, (dict(counters["stats"]), dict(counters["recompiles"]))


@gpu
@pytest.mark.parametrize("impl", ["triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_compiled_training_step_matches_float64(impl, reduction):
    # the kernel op traced into a torch.compile graph with its backward: the gradients made in the forward for a
    # scalar loss (the grads argument fixed at trace time from grad mode and requires_grad), recomputed for "none"
    # dynamo keeps its graphs per code object: the lambda below is one code object for every case of this test, each
    # case adding two graphs (grad mode on, off), so a process running five cases passed the recompile limit (8)
    torch._dynamo.reset()
    chosen = tiered_ops.get_op(OP).impls[impl]
    # the availability check the dispatch makes before it picks a tier loads it (registers its op): without it, a worker
    # process whose earlier tests never loaded the Triton tier traced a call to an op not registered yet
    assert chosen.why_not(torch.device("cuda")) is None
    fn = chosen.fn
    h = torch.randn(300, 64, device="cuda", requires_grad=True)
    w = (torch.randn(1000, 64, device="cuda") / 8).requires_grad_()
    t = torch.randint(0, 1000, (300,), device="cuda")
    t[::4] = -100
    step = torch.compile(lambda h, w, t: fn(h, w, t, None, -100, reduction, 0.1) * 3.0, fullgraph=True)
    _step_matches_float64(step, h, w, t, reduction)


@pytest.mark.parametrize("impl", ["triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("v", [1000, 1001])
def test_half_dlogits_written_over_the_logits_match_float64(impl, dtype, v):
    # the forward's gradients of a half-precision head: a vocabulary of a multiple of 8 has each chunk's dlogits
    # written over its float32 logits (a view of row stride 2 V) and dweight's product made in slices; an odd one a
    # chunk of its own. Chunks of 7 rows (a short last chunk), ignored rows, label smoothing, a bias
    tiered_ops.get_op(OP).impls[impl].why_not(device_for(impl))  # loads the tier's ops
    dev = device_for(impl)
    h = torch.randn(30, 40, device=dev).to(dtype).requires_grad_()
    w = (torch.randn(v, 40, device=dev) / 5).to(dtype).requires_grad_()
    b = (torch.randn(v, device=dev) / 2).to(dtype).requires_grad_()
    t = torch.randint(0, v, (30,), device=dev)
    t[::6] = -100
    loss = _kernel_op(impl)(h, w, t, b, -100, "mean", 0.1, None, 7, True)[0]
    g = torch.tensor(1.5, device=dev, dtype=loss.dtype)
    got = torch.autograd.grad(loss, (h, w, b), g)
    l64 = [x.detach().double().requires_grad_() for x in (h, w, b)]
    want = truth64(OP, l64[0], l64[1], t, l64[2], -100, "mean", 0.1)
    spec = tiered_ops.get_op(OP)
    assert_like_truth(loss, want, spec.rtol[dtype])
    for name, d, x in zip(("hidden", "weight", "bias"), got, torch.autograd.grad(want, l64, g.double())):
        assert_like_truth(d, x, spec.grad_rtol[dtype], f"d{name}")


def test_the_forwards_half_dlogits_lie_over_the_logits():
    from triton_src.linear_cross_entropy import _dlogits_over

    logits = torch.randn(5, 16)
    over = _dlogits_over(logits, torch.bfloat16)
    assert over.shape == (5, 16) and over.stride() == (32, 1) and over.data_ptr() == logits.data_ptr()
    assert _dlogits_over(logits, torch.float32) is logits
    odd = torch.randn(5, 12)  # V % 8 != 0: a chunk of its own
    assert _dlogits_over(odd, torch.bfloat16).untyped_storage().data_ptr() != odd.untyped_storage().data_ptr()


def _allocations(fn) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor ``fn`` allocates through torch (an output whose storage no input of its op has)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made = []

    class Allocations(TorchDispatchMode):
        # on a GPU a Triton launch under a dispatch mode is a higher-order op (triton_kernel_wrapper_mutation): it is
        # run as it is and allocates nothing itself
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen and t.numel():
                    made.append((tuple(t.shape), t.dtype))
            return out

    with Allocations():
        fn()
    return made


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_forwards_gradients_hold_one_chunk_buffer_and_no_whole_product(dtype):
    # the accounting of the forward's gradients (the GPU's peak: the float32 dweight accumulator and dhidden, plus,
    # per chunk, its float32 logits and the dweight product): no half dlogits chunk beside the logits and no float32
    # [V, H] product but the accumulator, only slices of V / DW_PARTS rows; the recomputing backward, for contrast,
    # allocates a dlogits chunk of its own
    import triton_src.linear_cross_entropy as lce

    n, hd, v, chunk = 40, 32, 64, 16
    dev = device_for("triton")
    h, w = torch.randn(n, hd, device=dev).to(dtype), (torch.randn(v, hd, device=dev) / 4).to(dtype)
    t = torch.randint(0, v, (n,), device=dev)
    fwd = _allocations(lambda: lce.linear_cross_entropy_launch(h, w, t, None, -100, "mean", 0.1, None, chunk, True))
    assert ((chunk, v), torch.float32) in fwd  # the chunk's logits
    assert ((chunk, v), dtype) not in fwd, fwd  # written over them
    assert fwd.count(((v, hd), torch.float32)) == 1, fwd  # the accumulator alone
    assert ((8, hd), torch.float32) in fwd  # a slice of the product: V / DW_PARTS rows, a multiple of 8
    lse, one = torch.rand(n, device=dev), torch.tensor(1.0, device=dev)
    bwd = _allocations(lambda: lce.linear_cross_entropy_bwd_launch(one, h, w, t, None, lse, -100, "mean", 0.1, chunk))
    assert ((chunk, v), dtype) in bwd and bwd.count(((v, hd), torch.float32)) >= 2, bwd


def _most_alive(fn, chunk: int, v: int) -> int:
    """The most float32 [rows <= chunk, V] tensors (a chunk's logits, a sum of them; not the CPU's float32 copy of
    weight.T, [H, V] with H > chunk) alive at once while ``fn`` runs: counted
    at each one's allocation, over the storages of those allocated before it that are not yet freed. Garbage is
    collected first: the CPU's Triton interpreter leaves a launch's arguments in reference cycles (a GPU launch frees
    them with their last name), so that only what the code still names is counted."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made: list[StorageWeakRef] = []
    most = 0

    class Alive(TorchDispatchMode):
        supports_higher_order_operators = True  # a Triton launch on a GPU: run as it is

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal most
            out = func(*args, **(kwargs or {}))
            seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == v
                        and t.shape[0] <= chunk and t.untyped_storage().data_ptr() not in seen):
                    made.append(StorageWeakRef(t.untyped_storage()))
                    gc.collect()
                    most = max(most, sum(not r.expired() for r in made))
            return out

    with Alive():
        fn()
    return most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_one_chunks_float32_logits_alive_at_a_time(dtype, with_bias):
    # the chunk loops (the inference forward, the forward with the gradients, the recomputing backward) hold one
    # chunk's float32 logits at a time: each freed before the next chunk's GEMM allocates, the bias added into the
    # GEMM's own buffer (on a GPU a second one would be that much more peak memory)
    import triton_src.linear_cross_entropy as lce

    n, hd, v, chunk = 40, 32, 64, 16  # three chunks, the last short; H > chunk
    dev = device_for("triton")
    h, w = torch.randn(n, hd, device=dev).to(dtype), (torch.randn(v, hd, device=dev) / 4).to(dtype)
    b = torch.randn(v, device=dev).to(dtype) if with_bias else None
    t = torch.randint(0, v, (n,), device=dev)
    lse, one = torch.rand(n, device=dev), torch.tensor(1.0, device=dev)
    calls = {
        "inference forward": lambda: lce.linear_cross_entropy_launch(h, w, t, b, -100, "mean", 0.0, None, chunk, False),
        "forward with gradients": lambda: lce.linear_cross_entropy_launch(h, w, t, b, -100, "mean", 0.0, None, chunk,
                                                                          True),
        "recomputing backward": lambda: lce.linear_cross_entropy_bwd_launch(one, h, w, t, b, lse, -100, "mean", 0.0,
                                                                            chunk),
    }
    assert {name: _most_alive(call, chunk, v) for name, call in calls.items()} == dict.fromkeys(calls, 1)


@pytest.mark.parametrize("grads", [True, False], ids=["grads_in_forward", "recomputing"])
def test_the_backward_makes_no_zeros_for_the_outputs_without_a_gradient(grads):
    # lse, dhidden, dweight and dbias are outputs of the op that take no gradient: autograd must not build zeros
    # shaped like them for the backward (with the gradients in the forward, dweight's float32 [V, H] zeros would sit
    # beside the accumulator at the step's peak)
    from torch.utils._python_dispatch import TorchDispatchMode

    n, hd, v = 24, 16, 40
    dev = device_for("triton")
    tiered_ops.get_op(OP).impls["triton"].why_not(dev)
    h = torch.randn(n, hd, device=dev, requires_grad=True)
    w = (torch.randn(v, hd, device=dev) / 4).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    loss = _kernel_op("triton")(h, w, t, None, -100, "mean", 0.0, None, 16, grads)[0]
    made: list[tuple] = []

    class Zeros(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            aten = torch.ops.aten
            if func in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.fill_.Scalar,
                        aten.zero_.default):
                made.append((func.__name__, tuple(out.shape), out.dtype))
            return out

    with Zeros():
        dh, dw = torch.autograd.grad(loss, (h, w))
    assert not [m for m in made if m[1] in ((v, hd), (n, hd), (n,))], made
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    for got, want in zip((dh, dw), torch.autograd.grad(truth64(OP, h64, w64, t), (h64, w64))):
        assert_like_truth(got, want, 1e-5)
