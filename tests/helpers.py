"""One helper per kind of check, so each test case in tests/test_<op>.py is one line.

The truth is float64 math, written here independently of the package: ``truth64`` evaluates each op's formula in
float64 with torch's elementwise primitives (exp, erf, tanh, sqrt, mean), never the op itself (F.gelu, softmax,
F.rms_norm, F.layer_norm). The kernel tiers go through the product's own gate (``check_one``, whose reference is
the eager function run in float64); the eager tier, which is that reference, is checked against ``truth64``.

Non-finite inputs. Elementwise (gelu): the value at +-inf is the limit of the function there, which exists (gelu:
+inf -> +inf, -inf -> 0, for both approximations); NaN -> NaN. muladd: IEEE 754 (inf * 0 is NaN, inf - inf is NaN).
Row ops (softmax, rms_norm, layer_norm): the IEEE 754 evaluation in float64 of the formula torch documents:
softmax = exp(x - max) / sum, so a row holding +inf is NaN everywhere (inf / inf) and an all -inf row is NaN
(0 / 0), a single -inf is 0 there; rms_norm = x / sqrt(mean(x^2) + eps) * w, so in a row holding +-inf the
infinite entries are NaN (inf / inf) and the finite ones 0; layer_norm = (x - mean) / sqrt(var + eps) * w + b, so a
row holding +-inf is NaN everywhere (its mean is infinite, its variance NaN). A NaN makes its whole row NaN.
(The continuous extension of a row op at a row with one infinity exists, e.g. one-hot for softmax, but not at a
row with two, and neither torch nor any tier computes it: the IEEE evaluation is one rule for every row.)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
from typing import Any, Iterator, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.gate import arg_names, check_one, grad_norm, grad_output, output_names, with_grad
from tiered_ops.registry import DTYPE_NAMES, Problem, as_outputs, rel_error
from tiered_ops.tiers.catalog import all_ops, get_op

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Tiers checked against the reference at every problem x dtype. The compile tier has its own smaller
# list per op: every new shape costs a CPU compile of several seconds.
IMPLS = ["eager", "triton", pytest.param("cuda", marks=gpu)]


# On the Triton interpreter (no GPU) one big problem costs seconds per dtype, and the dtype and the shape are
# independent axes: there the Triton tier runs each shape named here in float32 at full size, and the other dtypes at
# its small twin, which keeps what the shape is there for (odd in both dims: masked tails and several rows a program;
# one column). On a GPU every dtype runs at full size.
SMALL_TWINS = {(1823, 781): (37, 129), (4096, 1): (37, 1)}


def small_twin(op: str, problem: Problem) -> Problem | None:
    """``problem`` at the small twin of its shape (its other parameters kept), or None where it has none."""
    shape = SMALL_TWINS.get(problem.shape)
    if shape is None:
        return None
    kw = problem.kw
    if "normalized_shape" in kw:  # the trailing dims of the new shape, as many as before
        kw["normalized_shape"] = shape[len(shape) - len(kw["normalized_shape"]):]
    return get_op(op).problem(shape, **kw)


def tier_dtype_problems(op: str, impl: str, problems: Sequence[Problem], dtypes: Sequence[torch.dtype] = DTYPES
                        ) -> list[tuple[torch.dtype, Problem]]:
    """The ``(dtype, problem)`` cases of ``impl`` over ``problems`` x ``dtypes``: every pair, except that the Triton
    tier on the interpreter runs a shape of SMALL_TWINS in float32 only and the other dtypes at its twin."""
    if impl != "triton" or HAS_CUDA:
        return [(d, p) for p in problems for d in dtypes]
    out = []
    for p in problems:
        twin = small_twin(op, p)
        out += [(d, p if twin is None or d == torch.float32 else twin) for d in dtypes]
    return list(dict.fromkeys(out))  # a twin already in the list runs once


def tier_cases(op: str, problems: Sequence[Problem], impls: Sequence[Any] = IMPLS,
               dtypes: Sequence[torch.dtype] = DTYPES) -> list[Any]:
    """``pytest.param(impl, dtype, problem)`` for ``impl,dtype,problem`` parametrization: each tier of ``impls`` the
    op has (with its marks) at ``tier_dtype_problems``; the id ``impl-dtype-problem``."""
    return [pytest.param(name, d, p, marks=marks, id=f"{name}-{d}-{p}")
            for name, marks in map(name_and_marks, impls_of(op, impls))
            for d, p in tier_dtype_problems(op, name, problems, dtypes)]


def name_and_marks(impl: Any) -> tuple[str, tuple]:
    """An entry of an implementation list: a name, or a ``pytest.param`` of one name with its marks."""
    return (impl.values[0], tuple(impl.marks)) if hasattr(impl, "values") else (impl, ())


def impls_of(op: str, impls: Sequence[Any] = IMPLS) -> list[Any]:
    """The entries of ``impls`` (names, or ``pytest.param`` of one name with its marks) that ``op`` has: a tier an op
    does not have (muladd has no cuda) gets no test case of it."""
    have = get_op(op).impls
    return [i for i in impls if name_and_marks(i)[0] in have]


def op_impls(ops: Sequence[str], impls: Sequence[Any]) -> list[Any]:
    """``(op, impl)`` cases, one per op and each of ``impls`` that it has (``impls_of``), with the impl's marks; the id
    ``op-impl``."""
    return [pytest.param(op, name, marks=marks, id=f"{op}-{name}")
            for op in ops for name, marks in map(name_and_marks, impls_of(op, impls))]


def builtin_ops() -> list:
    """The ops declared in tiered_ops/ops: a test's planted op (tests/plants), registered when a test imports it,
    is not one of them, whatever order the tests run in."""
    return [s for s in all_ops() if s.reference.__module__.startswith("tiered_ops.ops.")]


def cpp_node_name(op: str) -> str:
    """The name of the C++ autograd node an op's CUDA wrapper records where it declares one (cuda_src/<op>.cpp's
    State::kName: rms_norm -> RmsNormNode)."""
    return "".join(w.title() for w in op.split("_")) + "Node"


def device_for(impl: str) -> torch.device:
    return torch.device("cuda") if HAS_CUDA or impl == "cuda" else torch.device("cpu")


def versions(device: torch.device) -> str:
    """The versions a result depends on, for failure messages (a new Triton or torch can change results)."""
    fp = fingerprint(device)
    return f"torch {fp.torch}, triton {fp.triton}, cuda {fp.cuda}"


# ---- the float64 truth ------------------------------------------------------------------------------------------

def truth_of(op: str) -> Any:
    """``tests/truths/<op>.py``'s ``truth``: each op's float64 math lives in its own file (adding an op adds one)."""
    return importlib.import_module(f"truths.{op}").truth


def float64_args(args: Sequence[Any], grad_args: Sequence[int] = ()) -> list[Any]:
    """An op's arguments in float64: each floating tensor a float64 leaf (requiring grad at the positions
    ``grad_args``); an integer tensor (indices, offsets) and every other argument as it is."""
    return [a.detach().double().requires_grad_(i in grad_args) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for i, a in enumerate(args)]


def truth64(op: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The op's float64 math at the candidate's inputs (floating tensors are taken to float64; a float64 leaf
    that requires grad stays in the graph). ``dtype=`` names the candidate's dtype where the op's defaults depend
    on it (rms_norm's eps); by default the first tensor's."""
    dtype = kwargs.pop("dtype", None) or next(a.dtype for a in args if isinstance(a, torch.Tensor))
    conv = [a.to(torch.float64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    fn = truth_of(op)
    if "dtype" in inspect.signature(fn).parameters:
        kwargs["dtype"] = dtype
    return fn(*conv, **kwargs)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return rel_error(out, ref)


def assert_like_truth(out: torch.Tensor, truth: torch.Tensor, rtol: float, what: str = "output") -> None:
    """``out`` is NaN and +-inf exactly where ``truth`` is, and its finite part within ``rtol`` (relative norm);
    the failure lists the first disagreeing elements and the versions."""
    err = rel_error(out, truth)
    if err <= rtol:
        return
    o, t = out.detach().cpu().double().reshape(-1), truth.detach().cpu().reshape(-1)
    bad = ~((o == t) | (torch.isnan(o) & torch.isnan(t)) | (torch.isfinite(o) & torch.isfinite(t)))
    if not bad.any():
        bad = (o - t).abs() > rtol * t.abs().clamp_min(1e-30)
    idx = bad.nonzero().reshape(-1)[:6].tolist()
    shown = ", ".join(f"[{i}] got {o[i].item():.6g} want {t[i].item():.6g}" for i in idx)
    raise AssertionError(f"{what}: rel error {err:.2e} > {rtol:.1e}; {shown} ({versions(out.device)})")


def assert_trains_like_truth(op: str, out: torch.Tensor, args: Sequence[Any], rtol: float, grad_rtol: float) -> None:
    """``out``, the op's output at ``args`` (whose floating tensors require grad), and the gradients of those tensors
    for a random output gradient, against float64 autograd of ``truth64``."""
    leaves = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    args64 = float64_args(args, leaves)
    want = truth64(op, *args64)
    assert_like_truth(out, want, rtol)
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, [args[i] for i in leaves], dy)
    ref = torch.autograd.grad(want, [args64[i] for i in leaves], dy.double())
    names = arg_names(get_op(op))
    for i, g, r in zip(leaves, got, ref):
        assert_like_truth(g, r, grad_rtol, f"grad of {names[i]}")


# ---- one case of a tier at one problem ---------------------------------------------------------------------------

def torch_grad_exemptions(op: str, problem: Problem, dtype: torch.dtype) -> dict[str, str]:
    """Gradients of torch's own kernels (the eager tier) that are not held to the dtype's bound, with why; they must
    still be finite where the truth is. The product's gate does not hold eager's gradients to the bound either."""
    if op != "layer_norm":
        return {}
    why = {}
    if dtype != torch.float32:
        for name in ("weight", "bias"):
            why[name] = f"torch's CPU layer_norm accumulates its {DTYPE_NAMES[dtype]} {name} gradient in that dtype"
    n = math.prod(problem.kw["normalized_shape"])
    if n <= 2:  # y is 0 (one element) or +-1 (two) whatever x: the exact x-gradient is 0 or O(eps / var)
        why["x"] = f"over {n} element(s) the exact x-gradient is ~0 and torch's is the roundoff of a cancellation"
    if n == 1:
        why["weight"] = "over one element x - mean is 0: the exact weight gradient is 0 and torch's is roundoff"
    return why


def _eager_vs_truth(op: str, problem: Problem, dtype: torch.dtype, device: torch.device, seed: int, grad: bool
                    ) -> float:
    """The eager tier's output (and with ``grad`` every input gradient) against float64 autograd of ``truth64``."""
    spec = get_op(op)
    inp = spec.make_inputs(problem, dtype, device, seed)
    pos: list[int] = []
    if grad:
        inp, pos = with_grad(spec, inp)
    with torch.set_grad_enabled(grad):
        out = spec.impls["eager"].fn(*inp.args, **inp.kwargs)
    outs = as_outputs(out)
    assert len(outs) == len(spec.outputs), f"{op}/eager at {problem}: {len(outs)} outputs, expected {spec.outputs}"
    for o, name in zip(outs, output_names(spec)):
        assert o.dtype == dtype, f"{op}/eager at {problem}: {name} dtype {o.dtype}, expected {dtype}"
    leaves = float64_args(inp.args, pos)
    with torch.set_grad_enabled(grad):
        ref = truth64(op, *leaves, dtype=dtype, **inp.kwargs)
    refs_out = as_outputs(ref)
    where = f"{op}/eager {DTYPE_NAMES[dtype]} at {problem} seed {seed}"
    err = 0.0
    for o, r, name in zip(outs, refs_out, output_names(spec)):
        assert_like_truth(o, r, spec.rtol[dtype], f"{where}: {name}")
        err = max(err, rel_error(o, r))
    if grad:
        dy = grad_output(out, seed)
        dy64 = tuple(d.to(torch.float64) for d in dy) if isinstance(dy, tuple) else dy.to(torch.float64)
        grads = torch.autograd.grad(out, [inp.args[i] for i in pos], dy, allow_unused=True)
        refs = torch.autograd.grad(ref, [leaves[i] for i in pos], dy64, allow_unused=True)
        floor = 1e-6 * grad_norm(dy)  # a gradient below this counts as zero
        exempt, names = torch_grad_exemptions(op, problem, dtype), arg_names(spec)
        for i, g, r in zip(pos, grads, refs):
            r = torch.zeros_like(leaves[i]) if r is None else r
            assert g is not None, f"{where}: grad of {names[i]} missing"
            bound = math.inf if names[i] in exempt else spec.grad_rtol[dtype]
            e = rel_error(g, r, floor)
            if not e <= bound:
                assert_like_truth(g, r, bound, f"{where}: grad of {names[i]}")
            err = max(err, e)
    return err


def assert_matches(op: str, impl_name: str, problem: Problem, dtype: torch.dtype, seed: int = 0, grad: bool = False
                   ) -> float:
    """The implementation's output (and with ``grad`` every input gradient, for a random output gradient) is within
    the dtype's bound of the float64 truth (NaN never passes): the product's gate for every candidate but eager,
    which is that gate's reference and is checked against ``truth64`` instead."""
    spec = get_op(op)
    impl = spec.impls[impl_name]
    dev = device_for(impl_name)
    why = impl.why_not(dev, dtype)
    assert why is None, f"{op}/{impl_name} cannot run on {dev}: {why}"
    if impl_name == "eager":
        return _eager_vs_truth(op, problem, dtype, dev, seed, grad)
    err, fail = check_one(spec, impl, problem, dtype, dev, seed, grad=grad)
    assert fail is None, f"{op}/{impl_name} {DTYPE_NAMES[dtype]}: {fail} ({versions(dev)})"
    return err


# ---- torch's own deviations from the math, detected on this machine ----------------------------------------------

@functools.lru_cache(maxsize=None)
def torch_gelu_deviation(device: str, approximate: str, value: float) -> str | None:
    """Why torch's F.gelu disagrees with the math at ``value`` on this device, or None. A 17-element fp32 tensor
    takes the vectorized CPU path; the reason names what shows."""
    x = torch.ones(17, device=device)
    x[0] = value
    got = torch.nn.functional.gelu(x, approximate=approximate)[0].item()
    want = truth_of("gelu")(torch.tensor([value], dtype=torch.float64), None, approximate).item()
    if got == want or (math.isnan(got) and math.isnan(want)):
        return None
    if value > 0 and device == "cpu":
        return "torch's vectorized CPU gelu returns NaN for +inf (x86 AVX-512 path)"
    return f"torch's {device} gelu returns {got} for {value} (0.5 * x * (1 + ...) is inf * 0), the limit is {want}"


@functools.lru_cache(maxsize=None)
def torch_rms_norm_deviation(device: str, n: int) -> str | None:
    """Why torch's F.rms_norm (with a weight) disagrees with the IEEE evaluation at a row of n holding +inf on this
    device, or None. The probe makes the caller's call: torch's path (fused kernel or composite) depends on the
    weight and the row, and only some paths deviate."""
    x = torch.ones(1, n, device=device)
    x[0, n - 1] = math.inf
    got = torch.nn.functional.rms_norm(x, (n,), torch.ones(n, device=device))[0, 0].item()
    return None if got == 0.0 else f"torch's {device} rms_norm makes the whole row {got} when it holds an Inf"


def xfail_if(request: pytest.FixtureRequest, reason: str | None) -> None:
    """Mark the running test as an expected failure (strict: a fix shows as XPASS and fails) when ``reason``."""
    if reason:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))


@contextlib.contextmanager
def aten_ops() -> Iterator[list[str]]:
    """The names of the ops torch dispatches inside the block, in order (a list filled as they run)."""
    seen: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        yield seen


def default_sigint() -> None:
    """``preexec_fn`` of a CLI child that a test interrupts as Ctrl-C at a terminal would: SIGINT at its default, so
    Python raises KeyboardInterrupt there. A shell's background job (``cmd &`` without job control) starts with SIGINT
    ignored, and a child inherits that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
