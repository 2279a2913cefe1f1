"""The eager fast path of the Triton tier (tiered_ops.tiers.fastpath, triton_src/*_fast) against float64 math:
outputs and gradients at odd, non-contiguous, empty and multi-block shapes, and equal to the registered triton_op it
stands in for. On the CPU the kernels run on the Triton interpreter; the direct launch itself is checked on a GPU."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import triton
from helpers import HAS_CUDA, assert_like_truth, builtin_ops, gpu, truth64

from tiered_ops.tiers.catalog import get_op
from tiered_ops.tiers.fastpath import fast_callable, tier_fast
from triton_src import launch

DEV = torch.device("cuda" if HAS_CUDA else "cpu")


def _t(*shape: int, seed: int = 0, t: bool = False) -> torch.Tensor:
    """Random fp32 values; ``t``: the transpose of a contiguous (shape reversed) tensor, so not contiguous."""
    g = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    if t:
        return torch.randn(*reversed(shape), generator=g).to(DEV).t()
    return torch.randn(*shape, generator=g).to(DEV)


def _w(n: int, seed: int) -> torch.Tensor:
    return 1 + 0.5 * _t(n, seed=seed)


def _ids(n: int, v: int, ignored: int = 0, ignore_index: int = -100) -> torch.Tensor:
    """Class indices [n] in [0, v), the first ``ignored`` of them ignore_index."""
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(n + v))
    t[:ignored] = ignore_index
    return t.to(DEV)


def _offsets(rows: int, inner: list[int]) -> torch.Tensor:
    """Segment boundaries 0, *inner, rows."""
    return torch.tensor([0, *inner, rows], dtype=torch.int64, device=DEV)


# (op, args, first_output, what it covers). Shapes: 37x129 fits no block; 2x20003 and 2x40009 are rows longer than
# the backward's / the forward's register-resident rows (looped kernels; layer_norm splits few long rows).
CASES = [
    ("softmax", (_t(37, 129), -1), "odd shape"),
    ("softmax", (_t(37, 129), 0), "non-last dim (moved last and back)"),
    ("softmax", (_t(3, 37, 5), 1), "middle dim of three"),
    ("softmax", (_t(37, 129, t=True), -1), "non-contiguous x"),
    ("softmax", (_t(2, 40009), -1), "looped kernels"),
    ("softmax", (_t(0, 16), -1), "empty"),
    ("rms_norm", (_t(37, 129), [129], _w(129, 1), 1e-6), "odd shape, weight"),
    ("rms_norm", (_t(37, 129, t=True), [129], None, 1e-6), "non-contiguous x, no weight"),
    ("rms_norm", (_t(4, 6, 33), [6, 33], _w(6 * 33, 2).view(6, 33), 1e-5), "two normalized dims"),
    ("rms_norm", (_t(2, 40009), [40009], _w(40009, 3), 1e-6), "looped kernels"),
    ("rms_norm", (_t(0, 16), [16], _w(16, 4), 1e-6), "empty"),
    ("layer_norm", (_t(37, 129), [129], _w(129, 1), _t(129, seed=5), 1e-5), "odd shape, weight and bias"),
    ("layer_norm", (_t(37, 129, t=True), [129], None, None, 1e-5), "non-contiguous x, no parameters"),
    ("layer_norm", (_t(2, 20003), [20003], _w(20003, 2), None, 1e-5), "backward splits few long rows"),
    ("layer_norm", (_t(2, 40009), [40009], None, _t(40009, seed=6), 1e-5), "forward splits few long rows"),
    ("layer_norm", (_t(5, 1), [1], _w(1, 3), _t(1, seed=4), 1e-5), "one element per row (dx is 0)"),
    ("layer_norm", (_t(0, 16), [16], _w(16, 4), _t(16, seed=4), 1e-5), "empty"),
    ("gelu", (_t(37, 129), _t(129, seed=1), "tanh"), "odd shape, bias, tanh"),
    ("gelu", (_t(37, 129, t=True), None, "none"), "non-contiguous x, erf"),
    ("gelu", (_t(0, 16), _t(16, seed=2), "none"), "empty"),
    ("muladd", (_t(37, 129), _t(37, 129, seed=1), _t(37, 129, seed=2)), "odd shape"),
    ("muladd", (_t(37, 1), _t(1, 129, seed=1), _t(37, 129, seed=2)), "broadcast operands"),
    ("muladd", (_t(37, 129, t=True), _t(37, 129, seed=1), _t(37, 129, seed=2, t=True)), "non-contiguous"),
    ("muladd", (_t(0, 16), _t(0, 16, seed=1), _t(0, 16, seed=2)), "empty"),
    ("cross_entropy", (_t(37, 129), _ids(37, 129), -100, "mean", 0.0), "odd shape, mean"),
    ("cross_entropy", (_t(16, 100), _ids(16, 100, ignored=4), -100, "sum", 0.1), "ignored rows, sum, smoothing"),
    ("cross_entropy", (_t(9, 33, t=True), _ids(9, 33, ignored=3, ignore_index=5), 5, "none", 0.0),
     "non-contiguous logits, per-row losses, ignore_index 5"),
    ("cross_entropy", (_t(64, 256)[::2], _ids(32, 256), -100, "mean", 0.0), "logits with a row stride (read in place)"),
    ("cross_entropy", (_t(2, 20003), _ids(2, 20003), -100, "mean", 0.2), "rows longer than one block"),
    ("cross_entropy", (_t(0, 16), _ids(0, 16), -100, "sum", 0.0), "empty"),
    ("fused_add_rms_norm", (_t(37, 129), _t(37, 129, seed=1), [129], _w(129, 1), 1e-6), "odd shape, weight"),
    ("fused_add_rms_norm", (_t(37, 129, t=True), _t(37, 129, seed=2), [129], None, 1e-6),
     "non-contiguous x, no weight"),
    ("fused_add_rms_norm", (_t(4, 6, 33), _t(4, 6, 33, seed=3), [6, 33], _w(6 * 33, 2).view(6, 33), 1e-5),
     "two normalized dims"),
    ("fused_add_rms_norm", (_t(2, 20003), _t(2, 20003, seed=4), [20003], _w(20003, 3), 1e-6), "looped backward"),
    ("fused_add_rms_norm", (_t(2, 40009), _t(2, 40009, seed=5), [40009], None, 1e-6), "looped kernels"),
    ("fused_add_rms_norm", (_t(0, 16), _t(0, 16, seed=6), [16], _w(16, 4), 1e-6), "empty"),
    ("segment_sum", (_t(301, 33), _offsets(301, [0, 5, 5, 40, 300])), "odd D, an empty segment"),
    ("segment_sum", (_t(1000, 16), _offsets(1000, [])), "one giant segment (row ranges, combine)"),
    ("segment_sum", (_t(3001, 24, t=True), _offsets(3001, [1, 2, 700, 2500, 2501])),
     "non-contiguous values, long segments sharing row ranges"),
    ("segment_sum", (_t(0, 8), _offsets(0, [0, 0])), "no rows: every segment empty"),
]


FAST_OPS = sorted({c[0] for c in CASES})  # every op whose fast path has test cases here


def test_every_op_with_a_triton_fast_path_has_cases_here():
    import importlib

    have = [s.name for s in builtin_ops() if hasattr(importlib.import_module(f"triton_src.{s.name}"), f"{s.name}_fast")]
    assert sorted(have) == FAST_OPS


def _fast(op: str):
    spec = get_op(op)
    impl = spec.impls["triton"]
    why = impl.why_not(DEV, torch.float32)
    assert why is None, f"{op}/triton cannot run on {DEV}: {why}"
    fast = tier_fast(spec, "triton", first_output=spec.first_output)
    assert fast is not None, f"{op}: no Triton fast path"
    return spec, _registered(spec), fast


def _registered(spec):
    """The registered Triton op (torch.ops.tiered_ops.<op>_triton) on the op's signature: what torch.compile traces,
    and the reference the fast path must equal bit for bit (the Impl's fn is the fast path itself in eager code)."""
    kernel = getattr(torch.ops.tiered_ops, f"{spec.name}_triton")
    n_out = len(spec.outputs)

    def call(*a, **k):
        out = kernel(*spec.kernel_args(*a, **k))
        if not spec.first_output:
            return out
        return out[0] if n_out == 1 else tuple(out[:n_out])

    return call


def _leaves(args: tuple) -> tuple[tuple, list[torch.Tensor]]:
    """Fresh copies of the arguments, the floating tensors leaves requiring grad (indices and offsets as they are)."""
    out = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                for a in args)
    return out, [a for a in out if isinstance(a, torch.Tensor) and a.requires_grad]


def _outs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where the other is NaN (a mean over no targets)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _dy(out: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _truth(op: str, args: tuple) -> list[torch.Tensor]:
    return _outs(truth64(op, *args, dtype=torch.float32))


@pytest.mark.parametrize("op,args,what", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_fast_path_matches_float64_and_the_registered_op(op, args, what):
    spec, registered, fast = _fast(op)
    rtol, grad_rtol = spec.rtol[torch.float32], spec.grad_rtol[torch.float32]
    fargs, fleaves = _leaves(args)
    outs = _outs(fast(*fargs))
    rargs, rleaves = _leaves(args)
    ref_outs = _outs(registered(*rargs))
    targs, tleaves = _leaves(tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                   for a in args))
    truths = _truth(op, targs)
    assert len(outs) == len(ref_outs) == len(truths) == len(spec.outputs), f"{op} ({what}): {len(outs)} outputs"
    for j, (out, ref_out, truth) in enumerate(zip(outs, ref_outs, truths)):
        assert out.shape == truth.shape and out.dtype == torch.float32, f"{op} ({what}): {out.shape} {out.dtype}"
        assert_like_truth(out, truth, rtol, f"{op} fast path ({what}): output {j}")
        assert _same(out, ref_out), f"{op} ({what}): output {j} of the fast path and the registered op differ"
        assert out.grad_fn is not None, f"{op} ({what}): inputs require grad but output {j} has no grad_fn"

    dys = [_dy(out, 11 + j) for j, out in enumerate(outs)]
    grads = torch.autograd.grad(outs, fleaves, dys, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_outs, rleaves, dys, allow_unused=True)
    truth_grads = torch.autograd.grad(truths, tleaves, [d.double() for d in dys], allow_unused=True)
    floor = 1e-6 * max(sum(torch.linalg.vector_norm(d.double()).item() for d in dys), 1e-30)
    for i, (g, r, t) in enumerate(zip(grads, ref_grads, truth_grads)):
        assert g is not None and r is not None, f"{op} ({what}): gradient {i} missing"
        t = torch.zeros_like(tleaves[i]) if t is None else t
        assert g.shape == tleaves[i].shape, f"{op} ({what}): gradient {i} of shape {g.shape}"
        if t.numel() and t.abs().max().item() > floor:
            assert_like_truth(g, t, grad_rtol, f"{op} fast path ({what}): gradient {i}")
        elif g.numel():  # an exact gradient of ~0 (layer_norm over one element): roundoff is all there is
            assert g.abs().max().item() <= 1e-4, f"{op} ({what}): gradient {i} not ~0"
        assert _same(g, r), f"{op} ({what}): gradient {i} of fast path and registered op differ"


@pytest.mark.parametrize("used", [0, 1])
def test_several_outputs_each_carry_their_gradient(used):
    """An op of several outputs (fused_add_rms_norm's y and new_residual): a loss of one of them alone gives the
    gradients of that one (the other's gradient is None in the backward, not a stale or missing term), equal to the
    registered op's and to float64 math."""
    args = next(c[1] for c in CASES if c[0] == "fused_add_rms_norm")
    spec, registered, fast = _fast("fused_add_rms_norm")
    fargs, fleaves = _leaves(args)
    rargs, rleaves = _leaves(args)
    targs, tleaves = _leaves(tuple(a.double() if isinstance(a, torch.Tensor) else a for a in args))
    out, ref, truth = fast(*fargs)[used], registered(*rargs)[used], _truth("fused_add_rms_norm", targs)[used]
    dy = _dy(out, 5)
    grads = torch.autograd.grad(out, fleaves, dy)
    ref_grads = torch.autograd.grad(ref, rleaves, dy)
    truth_grads = torch.autograd.grad(truth, tleaves, dy.double(), allow_unused=True)
    for i, (g, r, t) in enumerate(zip(grads, ref_grads, truth_grads)):
        t = torch.zeros_like(tleaves[i]) if t is None else t
        if t.abs().max().item() > 0:
            assert_like_truth(g, t, spec.grad_rtol[torch.float32], f"gradient {i} of output {used}")
        else:
            assert not g.any(), f"gradient {i} of output {used} should be 0"
        assert _same(g, r), f"gradient {i} of output {used}: fast path and registered op differ"


@pytest.mark.parametrize("op", FAST_OPS)
def test_no_graph_without_grad(op):
    """With no input requiring grad, or under no_grad, the fast path records no autograd node."""
    _, _, fast = _fast(op)
    args = next(c[1] for c in CASES if c[0] == op)
    assert all(o.grad_fn is None for o in _outs(fast(*args)))
    gargs, _ = _leaves(args)
    with torch.no_grad():
        outs = _outs(fast(*gargs))
    assert all(o.grad_fn is None and not o.requires_grad for o in outs)
    truths = _truth(op, tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in args))
    assert len(outs) == len(truths)
    for out, truth in zip(outs, truths):
        assert_like_truth(out, truth, get_op(op).rtol[torch.float32], f"{op} fast path under no_grad")
    with torch.no_grad():
        only, impl = _outs(fast.forward_only(*args)), _outs(get_op(op).impls["triton"].fn(*args))
        assert len(only) == len(impl) and all(map(_same, only, impl)), f"{op}: forward_only"


def test_bad_input_is_named():
    _, _, fast = _fast("rms_norm")
    with pytest.raises(ValueError, match="normalized_shape"):
        fast(_t(4, 8), [7])
    with pytest.raises(TypeError, match="x must be float32"):
        fast(torch.ones(4, 8, dtype=torch.int32, device=DEV), [8], None, 1e-6)


def test_fast_callable_uses_the_fallback_inside_a_transform():
    """Under a functorch transform the registered op (the fallback) runs, not the direct launch."""
    calls = []
    fast = fast_callable(lambda x: calls.append("fwd") or x * 2, lambda g: g * 2, lambda ctx, i, o: None,
                         lambda bwd: (lambda ctx, g: (bwd(g),)), lambda x: (x,),
                         fallback=lambda x: calls.append("fallback") or x * 2)
    x = torch.randn(3, dtype=torch.float64)
    torch.func.grad(lambda v: fast(v).sum())(x)
    assert calls == ["fallback"]
    xs = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(fast(xs).sum(), [xs])
    assert calls == ["fallback", "fwd"] and torch.equal(gx, torch.full_like(x, 2.0))


def test_key_follows_triton_specialization():
    """The direct launcher's cache key changes with everything Triton specializes on."""
    key = launch._key_function("tio")
    base = torch.empty(64)
    k = key(0, base, 32, 1.5)
    assert key(0, base[1:], 32, 1.5) != k  # data pointer no longer 16-byte aligned
    assert key(0, base.to(torch.float64), 32, 1.5) != k  # dtype
    assert key(0, base, 33, 1.5) != k  # not a multiple of 16
    assert key(0, base, 1, 1.5) != key(0, base, 2, 1.5)  # 1 is a constexpr to Triton
    assert key(0, base, 2**31, 1.5) != key(0, base, 2**4, 1.5)  # i64 instead of i32
    assert key(1, base, 32, 1.5) != k  # another device
    assert key(0, base, 32, 2.5) == k  # float values are not specialized
    assert key(0, base, 32, 2) != k  # an int where a float was: another type


def test_direct_kernel_checks_its_constexprs():
    from triton_src import softmax as ts

    with pytest.raises(TypeError, match="constexprs"):
        launch.direct(ts._softmax_rows, 4, BLOCK_N=128)


@gpu
def test_direct_launch_on_gpu():
    """The compiled kernel's launcher, called directly after the first launch, computes what torch does, on
    aligned and unaligned pointers and on a side stream."""
    from triton_src import softmax as ts

    for x in (torch.randn(33, 1000, device="cuda"), torch.randn(33 * 1000 + 1, device="cuda")[1:].view(33, 1000)):
        for _ in range(3):  # first launch through the JITFunction, then the direct ones
            torch.testing.assert_close(ts.softmax_fast(x, -1), torch.softmax(x, -1))
    s = torch.cuda.Stream()
    x = torch.randn(64, 4096, device="cuda")
    with torch.cuda.stream(s):
        y = ts.softmax_fast(x, -1)
    s.synchronize()
    assert math.isclose(y.sum().item(), 64, rel_tol=1e-4)


@gpu
@pytest.mark.parametrize("op,args,what", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_kept_kernel_launch_equals_the_registered_op_on_gpu(op, args, what):
    """On a GPU the fast path's later calls go through the kept compiled kernel (the C launcher), not Triton's
    launch: every call, forward and backward, equals the registered op bit for bit."""
    _, registered, fast = _fast(op)
    ref_outs = _outs(registered(*args))
    for _ in range(3):  # the first launch through the JITFunction, then the kept kernel
        outs = _outs(fast(*args))
        assert all(map(_same, outs, ref_outs)), f"{op} ({what}): fast path and registered op differ"
    rargs, rleaves = _leaves(args)
    ref_outs = _outs(registered(*rargs))
    dys = [_dy(o, 3 + j) for j, o in enumerate(ref_outs)]
    ref_grads = torch.autograd.grad(ref_outs, rleaves, dys, allow_unused=True)
    for _ in range(3):
        fargs, fleaves = _leaves(args)
        grads = torch.autograd.grad(_outs(fast(*fargs)), fleaves, dys, allow_unused=True)
        assert all(map(_same, grads, ref_grads)), f"{op} ({what}): gradients differ"


class _FakeCompiled:
    """What a first launch returns: a CompiledKernel's launcher, handle and metadata, recording the launches."""

    def __init__(self, calls: list) -> None:
        self.function, self.packed_metadata, self.calls = "cufunction", "packed", calls
        self.run = lambda *a: calls.append(("run", a))

    def launch_metadata(self, grid, stream, *args):  # only called with a launch hook set
        return ("meta", grid, stream)


class _FakeJIT:
    """A JITFunction's launch surface: params (name, is_constexpr), fn, and kernel[grid](...) returning the kernel."""

    def __init__(self, calls: list, consts: tuple[str, ...] = ("BLOCK",)) -> None:
        import types

        names = ("x_ptr", "y_ptr", "n", *consts)
        self.params = [types.SimpleNamespace(name=k, is_constexpr=k in consts) for k in names]
        self.fn = types.SimpleNamespace(__module__=__name__, __name__=f"_fake_{len(consts)}")
        self.calls, self.compiled = calls, _FakeCompiled(calls)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(("jit", grid, args, kw))
            return self.compiled
        return launch


def test_direct_launch_calls_the_compiled_launcher(monkeypatch):
    """After the first launch (through the JIT), a launch calls the compiled kernel's launcher with grid, stream,
    function, packed metadata, launch metadata, hooks, then every argument in signature order (constexprs too);
    a pointer that is not 16-byte aligned goes through the JIT again (another specialization)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234 + d, raising=False)
    calls: list = []
    kern = _FakeJIT(calls)
    b = launch.Bound(launch.DirectKernel(kern, {"num_warps": 4}, {"BLOCK": 64}), (3, 1, 1))
    x, y = torch.empty(64), torch.empty(64)
    b(x, y, 64)
    assert calls == [("jit", (3, 1, 1), (x, y, 64), {"BLOCK": 64, "num_warps": 4})]
    b(x, y, 64)  # the pointers go as ints
    assert calls[-1] == ("run", (3, 1, 1, 1234, "cufunction", "packed", None, None, None, x.data_ptr(), y.data_ptr(),
                                 64, 64))
    xs, ys = x[1:], y[1:]
    b(xs, ys, 63)  # not aligned: the full key, another specialization, a first launch through the JIT
    assert calls[-1][0] == "jit"
    b(xs, ys, 63)
    assert calls[-1] == ("run", (3, 1, 1, 1234, "cufunction", "packed", None, None, None, xs, ys, 63, 64))
    assert len(calls) == 4
    import types

    hook = object()  # a launch hook set (a profiler): the launch metadata and the tensors go to the launcher
    monkeypatch.setattr(launch, "_HOOKS", types.SimpleNamespace(launch_enter_hook=hook, launch_exit_hook=None))
    b(x, y, 64)
    assert calls[-1] == ("run", (3, 1, 1, 1234, "cufunction", "packed", ("meta", (3, 1, 1), 1234), hook, None, x, y,
                                 64, 64))


def test_direct_launch_merges_constexprs_before_runtime_arguments(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    calls: list = []
    kern = _FakeJIT(calls, consts=("A",))
    kern.params = [kern.params[3], *kern.params[:3]]  # A first
    dk = launch.DirectKernel(kern, {"num_warps": 1}, {"A": 5})
    x = torch.empty(16)
    dk((1, 1, 1), x, x, 16)
    dk((1, 1, 1), x, x, 16)
    assert calls[-1] == ("run", (1, 1, 1, 7, "cufunction", "packed", None, None, None, 5, x, x, 16))


def test_installed_triton_has_a_known_launcher():
    """The Triton installed here is one whose kernel launcher the fast path knows (triton_src.launch.LAUNCH_FORMS):
    another one would run every Triton kernel through Triton's own launch, correct but slower. Read its
    triton/backends/nvidia/driver.py (CudaLauncher, its C launch) and add it to the table."""
    version = launch.triton_version()
    assert launch.LAUNCH_FORM is not None, (
        f"Triton {triton.__version__} ({version}) is not in triton_src.launch.LAUNCH_FORMS "
        f"{sorted(launch.LAUNCH_FORMS)}: the Triton fast path launches its kernels the slow way on it")
    assert launch.LAUNCH_FORMS[version] == launch.LAUNCH_FORM


def test_triton_version_reads_major_and_minor():
    assert launch.triton_version("3.6.0") == (3, 6)
    assert launch.triton_version("3.9.0+git1a2b3c") == (3, 9)
    assert launch.triton_version("3.10.0.dev0") == (3, 10)
    assert launch.triton_version("nightly") is None


class CudaLauncher:
    """A fake of Triton's CudaLauncher (its name and attributes, as the fast path reads them), in one version's form:
    its C launch records its arguments; calling the launcher itself records that instead."""

    def __init__(self, calls: list, form: str) -> None:
        self.launch = lambda *a: calls.append(("c", a))
        self.calls, self.global_scratch_size, self.profile_scratch_size = calls, 0, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        if form == launch.PACKED:
            self.arg_annotations, self.kernel_signature, self.gsan_enabled = ("annotations",), b"sig", False

    def __call__(self, *args):
        self.calls.append(("run", args))


def _patch_gpu(monkeypatch, stream: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: stream, raising=False)


@pytest.mark.parametrize("form", [launch.SPREAD, launch.PACKED])
def test_c_launch_is_called_in_the_versions_form(monkeypatch, form):
    """Under a CudaLauncher of a kernel without scratch memory, a plan's launch calls the C launch with the arguments
    the launcher of that Triton version passes it (3.6: the kernel's arguments spread at the end; 3.7-3.9: after the
    scratch buffers, the annotations and the signature, as one tuple), pointers as ints, constexprs included."""
    _patch_gpu(monkeypatch, 99)
    monkeypatch.setattr(launch, "LAUNCH_FORM", form)
    calls: list = []
    kern = _FakeJIT(calls)
    kern.compiled.run = CudaLauncher(calls, form)
    b = launch.Bound(launch.DirectKernel(kern, {"num_warps": 4}, {"BLOCK": 64}), (2, 3, 1))
    x = torch.empty(32)
    b(x, x, 32)
    assert calls[-1][0] == "jit"
    b(x, x, 32)
    p = x.data_ptr()
    if form == launch.SPREAD:
        want = (2, 3, 1, 99, "cufunction", False, True, None, None, "packed", None, None, None, p, p, 32, 64)
    else:
        want = (2, 3, 1, 99, "cufunction", False, True, "packed", None, None, None, None, None, ("annotations",),
                b"sig", (p, p, 32, 64))
    assert calls[-1] == ("c", want)
    assert launch.c_launch_args(b.entry[-1], (2, 3, 1), 99, "cufunction", "packed", (p, p, 32, 64)) == want
    assert len(calls) == 2  # the launcher itself was never called


@pytest.mark.parametrize("form", [launch.SPREAD, launch.PACKED])
def test_launchers_the_c_launch_does_not_serve_are_called_as_they_are(form):
    """Another launcher class, a kernel needing scratch memory (its launcher allocates it), a sanitizer build, a
    launcher missing an attribute of its version's, an unknown Triton: no C launch, the launcher is called."""
    calls: list = []
    assert launch.c_launch(CudaLauncher(calls, form), form) is not None
    assert launch.c_launch(lambda *a: None, form) is None
    for attr, value in (("global_scratch_size", 128), ("profile_scratch_size", 64), ("gsan_enabled", True)):
        odd = CudaLauncher(calls, form)
        setattr(odd, attr, value)
        assert launch.c_launch(odd, form) is None, attr
    bare = CudaLauncher(calls, form)
    del bare.launch_pdl
    assert launch.c_launch(bare, form) is None
    if form == launch.PACKED:
        spread = CudaLauncher(calls, launch.SPREAD)  # a 3.6-shaped launcher under a 3.9 form: no signature to pass
        assert launch.c_launch(spread, form) is None


def test_unknown_triton_warns_once_and_launches_the_triton_way(monkeypatch, caplog):
    """On a Triton missing from LAUNCH_FORMS the first direct launch logs one WARNING naming the version, and every
    launch then goes through Triton's own (``kernel[grid](...)``): no kept kernel, no C launch."""
    _patch_gpu(monkeypatch, 5)
    monkeypatch.setattr(launch, "LAUNCH_FORM", None)
    monkeypatch.setattr(launch, "_warned", [])
    calls: list = []
    kern = _FakeJIT(calls)
    kern.compiled.run = CudaLauncher(calls, launch.PACKED)
    x = torch.empty(32)
    with caplog.at_level("WARNING", logger=launch.__name__):
        for _ in range(3):
            launch.Bound(launch.DirectKernel(kern, {"num_warps": 4}, {"BLOCK": 64}), (1, 1, 1))(x, x, 32)
        b = launch.Bound(launch.DirectKernel(kern, {"num_warps": 2}, {"BLOCK": 32}), (1, 1, 1))
        b(x, x, 32)
        b(x, x, 32)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and triton.__version__ in warnings[0].getMessage()
    assert [c[0] for c in calls] == ["jit"] * 5 and b.entry is None


@gpu
def test_the_c_launch_is_the_one_taken_on_this_gpus_triton(monkeypatch):
    """On the GPU's Triton the fast path's later launches call Triton's C launch directly: the compiled kernel's
    launcher (CudaLauncher.__call__) is not called once the first launch has kept the kernel, and the results are
    right."""
    from triton_src import softmax as ts
    from triton_src.common import row_settings

    assert launch.LAUNCH_FORM is not None, f"Triton {triton.__version__} not in LAUNCH_FORMS"
    spec = get_op("softmax")
    fast = tier_fast(spec, "triton")
    x = torch.randn(64, 1000, device="cuda")
    fast(x, -1)  # the first launch of this shape: through the JIT, the kernel kept
    block, per, warps = row_settings(1000, ts.MAX_FUSED_FWD)
    b = launch.bound(ts._softmax_rows, (triton.cdiv(64, per), 1, 1), warps, BLOCK_N=block, ROWS=per)
    y = torch.empty_like(x)
    b(x, y, 64, 1000)
    run = b.entry[0]
    assert type(run).__name__ == "CudaLauncher" and b.entry[-1] is not None, (type(run), b.entry[-1])
    launched = []
    cls = type(run)
    original = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a: launched.append(1) or original(self, *a))
    for _ in range(3):
        y.zero_()
        b(x, y, 64, 1000)
        torch.testing.assert_close(y, torch.softmax(x, -1))
        torch.testing.assert_close(fast(x, -1), torch.softmax(x, -1))
    assert not launched, f"the launcher was called {len(launched)} times: the C launch was not the one taken"


@pytest.mark.parametrize("op", FAST_OPS)
def test_a_resolved_fast_path_still_traces_as_the_registered_op(op):
    """After an eager call has resolved the Triton tier to its fast path, dynamo still traces the registered op:
    one graph, no break (the fast path hands a traced call over; the tier checks for compiling only before it
    resolves)."""
    from tiered_ops.measure.meta import explain

    spec = get_op(op)
    args = next(a for o, a, _ in CASES if o == op)
    impl = spec.impls["triton"]
    impl.fn(*args)
    assert explain(impl.fn, args) == dict(graphs=1, breaks=0, reasons=[], error=None)


def test_every_implementation_takes_the_ops_defaults():
    """A hit of ``tiered_ops.<op>``'s C fast path passes the caller's arguments on as given, so every callable a call
    reaches with them (each implementation, the declaration's hooks) binds a left-out argument to the reference's
    default. A wrapper of ``*args, **kwargs`` passes them on to one of these."""
    for spec in builtin_ops():  # (the suite's planted ops declare no hooks)
        name = spec.name
        ref = inspect.signature(spec.reference).parameters
        hooks = dict(eager=spec.eager, kernel_args=spec.kernel_args, validate=spec.validate,
                     check_values=spec.check_values, result_dtype=spec.result_dtype, takes_mixed=spec.takes_mixed,
                     **{f"impl {k}": impl.unchecked for k, impl in spec.impls.items()})
        checked = 0
        for what, fn in hooks.items():
            if fn is None:
                continue
            params = inspect.signature(fn).parameters
            if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
                continue
            assert list(params)[:len(ref)] == list(ref), (name, what, list(params))
            for n, p in ref.items():
                assert params[n].default == p.default, (name, what, n, params[n].default, p.default)
            checked += 1
        assert checked >= 3, (name, checked)  # eager, kernel_args, validate at least
