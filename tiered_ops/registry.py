"""Op specs and implementations: the one place every tier of every op is declared.

An op (``OpSpec``) is declared once (one file per op in ``tiered_ops/ops``): its float64-capable reference (the
eager tier), an inputs factory, problem and bucket, bytes moved, fakes, the autograd formula its kernel tiers share,
per-dtype error bounds, edge problems and default benchmark problems. Each implementation
(``Impl``) declares its tier, the dtypes it supports and an availability check that says *why* it
cannot run here. The harness (correctness, timing, store, selection, CLI) is driven by these alone. This module is
the bottom layer: it imports only base modules (``environment``, ``method``, ``accuracy``);
``tiered_ops.catalog`` loads the ops.
"""

from __future__ import annotations

import enum
import hashlib
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .accuracy import as_outputs, rel_error  # noqa: F401  (imported from here by the layers above)
from .environment import environment
from .method import CONTEXT_METHODS, METHOD_VERSION


def package_dir(name: str) -> Path:
    """The directory of the importable package ``name`` (``triton_src``, ``cuda_src``: the kernel sources), wherever
    it is installed: a source tree, an editable install or site-packages."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {name!r} (kernel sources of tiered_ops) is not importable: reinstall "
                                  f"tiered_ops with its {name}/ folder", name=name)
    return Path(next(iter(spec.submodule_search_locations))).resolve()


class Tier(enum.IntEnum):
    """Implementation tiers, ordered by maintenance cost (cheapest first). ``PEER``: another library's kernel
    (``tiered_ops.peers``), measured and reported beside ours, never selected."""

    EAGER = 0
    COMPILE = 1
    TRITON = 2
    CUDA = 3
    PEER = 4

    @property
    def label(self) -> str:
        return self.name.lower()


DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Relative error ||out - ref|| / ||ref|| allowed per dtype against the float64 reference. The output
# of a low-precision op is rounded once to its dtype (2^-8 for bf16, 2^-11 for fp16), so the bound
# sits a few roundings above that; fp32 leaves room for a different summation order.
DEFAULT_RTOL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# Gradients: a reduction over rows (weight/bias grads) or a cancellation (dy - sum(dy * y)) in fp32 costs a few
# more ulps than the forward; each grad is still rounded once to its dtype.
DEFAULT_GRAD_RTOL: dict[torch.dtype, float] = {torch.float32: 5e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

# Benchmark / decision modes. fwd_nograd: the forward under torch.no_grad (inference). fwd: the forward with
# inputs that require grad (autograd records the graph and saves what backward needs). bwd: the backward alone,
# from a retained graph. fwd+bwd: one training step of the op.
MODES: tuple[str, ...] = ("fwd_nograd", "fwd", "bwd", "fwd+bwd")
GRAD_MODES: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")


class Context(str, enum.Enum):
    """Who launches the op. ``EAGER``: a Python caller (the launch path counts); ``COMPILED``: the op traced into a
    caller's torch.compile graph (Inductor launches it); ``GRAPHED``: inside CUDA-graph capture (replay launches
    nothing). A member is its text ("eager", ...): equal to it, hashed like it, stored and printed as it; its position
    in ``CONTEXTS`` is the small int the generated fast path of ``tiered_ops.<op>`` keys a call by."""

    EAGER = "eager"
    COMPILED = "compiled"
    GRAPHED = "graphed"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


CONTEXTS: tuple[Context, ...] = tuple(Context)  # in the order of the fast path's index: 0 eager, 1 compiled, 2 graphed


def check_context(context: Context | str, what: str = "context") -> Context:
    """``context`` (a ``Context`` or its text) as a ``Context``; a ValueError naming ``what`` and the allowed values
    for anything else."""
    try:
        return Context(context)
    except ValueError:
        raise ValueError(f"{what}: expected one of {', '.join(CONTEXTS)}, got {context!r}") from None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class Problem:
    """One concrete call of an op: the first input's shape plus the op's non-tensor parameters."""

    shape: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def kw(self) -> dict[str, Any]:
        return dict(self.params)

    def __str__(self) -> str:
        s = "x".join(str(d) for d in self.shape) or "scalar"
        return s + "".join(f",{k}={v}" for k, v in self.params)


# Whether dynamo, tracing, tells a static size's class from a symbolic one's: torch before 2.13 answers "not int" for
# both, which would take every size of a static trace for symbolic
_CLASS_TELLS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def symbolic_size(d: Any) -> bool:
    """Whether ``d`` is a size that torch.compile keeps symbolic. While dynamo traces, it answers isinstance(d, int)
    for one (its class is then not int). Where the class does not tell (``_CLASS_TELLS``), ``max(d, 0)`` does: Python's
    max returns a static size itself and a symbolic one as a new size (an unused node of dynamo's graph).
    Asking installs no guard."""
    return (isinstance(d, int) and d.__class__ is not int and not isinstance(d, bool) and torch.compiler.is_compiling()
            and (_CLASS_TELLS or max(d, 0) is not d))


def check_dims(what: str, dims: Any, positive: bool = False) -> tuple[int, ...]:
    """``dims`` (a shape) as a tuple of ints >= 0: a TypeError naming ``what`` for a dim that is no integer (8.5,
    "8"; a bool is no dim either), a ValueError for a negative one (``positive``: for one below 1, naming the shape)."""
    try:
        items = tuple(dims)
    except TypeError:
        raise TypeError(f"{what}: expected a sequence of integer dims, got {type(dims).__name__}") from None
    out = []
    for i, d in enumerate(items):
        if symbolic_size(d):  # a dynamic size while dynamo traces: kept symbolic (reading it would specialize it)
            out.append(d)
            continue
        try:
            if isinstance(d, bool):
                raise TypeError
            out.append(operator.index(d))
        except TypeError:
            raise TypeError(f"{what}: dim {i} must be an integer, got {d!r} ({type(d).__name__}) in "
                            f"{list(items)}") from None
        if out[-1] < 0 and not positive:
            raise ValueError(f"{what}: dim {i} must be >= 0, got {out[-1]} in {list(items)}")
    if positive and any(d < 1 for d in out):
        raise ValueError(f"{what}: dims must be positive, got {'x'.join(str(d) for d in out)}")
    return tuple(out)


def make_problem(shape: tuple[int, ...] | list[int], **params: Any) -> Problem:
    def freeze(v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    # sorted by name alone (names are unique): dynamo sorts strings while it traces, not tuples
    return Problem(check_dims("shape", shape), tuple((k, freeze(params[k])) for k in sorted(params)))


def pow2_ceil(n: int) -> int:
    """Smallest power of two >= n (0 stays 0): the bucket of a leading dimension. A symbolic size (a dimension that
    torch.compile keeps dynamic) is compared, never read: dynamo turns each comparison into a guard on its range, so
    the graph serves the whole bucket."""
    if symbolic_size(n) or isinstance(n, torch.SymInt):
        p = 1
        while p < n:
            p *= 2
        return 0 if n <= 0 else p
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclass
class Inputs:
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BadInput:
    """A call an op must refuse with a clear error: ``call(device)`` builds its (args, kwargs); ``error`` is the
    exception type (or types) and ``match`` a regex its message must contain (the argument it names, what came).
    ``good(device)``: a valid call of the same shapes and dtypes, made first through ``tiered_ops.<op>`` so that its
    per-call path holds the key (a check of values, or of an optional tensor, must not be skipped there).
    ``devices``: where the call is refused (a check of values reads the data on the host: CPU only)."""

    what: str
    call: Callable[[torch.device], tuple[tuple, dict[str, Any]]]
    error: type[Exception] | tuple[type[Exception], ...]
    match: str
    good: Callable[[torch.device], tuple[tuple, dict[str, Any]]] | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")


@dataclass
class OpSpec:
    """Everything op-specific the harness needs. See ``tiered_ops/ops/softmax.py`` for an example."""

    name: str
    reference: Callable[..., torch.Tensor]  # the eager tier; must also run on float64 inputs
    make_inputs: Callable[[Problem, torch.dtype, torch.device, int], Inputs]
    problem: Callable[..., Problem]  # (shape, **params) -> Problem with defaults filled in and checked
    problem_of: Callable[..., Problem]  # the op's call arguments -> Problem (per-call dispatch)
    bucket: Callable[[Problem], tuple]  # Problem -> decision key (documented per op)
    bytes_moved: Callable[[Problem, torch.dtype], int]
    edge_problems: Callable[[], list[Problem]]
    default_problems: Callable[[str], list[Problem]]  # device type -> problems to bench
    source: Path  # the op file (eager + compile tiers live here)
    # Shape/stride-only version of the op for torch.library.register_fake (the CUDA ops; the Triton ops on the
    # interpreter, where triton_op's own fake would run kernels on fake tensors).
    fake: Callable[..., torch.Tensor] | None = None
    # The eager tier (defaults to ``reference``) and the op's call arguments -> the kernel ops' schema arguments;
    # ``first_output``: the kernel ops return (outputs..., saved statistics...) and the op returns its outputs.
    eager: Callable[..., torch.Tensor] | None = None
    kernel_args: Callable[..., tuple] | None = None
    first_output: bool = False
    # Names of the op's outputs: one (the default) returns a tensor, several a tuple of tensors in this order.
    outputs: tuple[str, ...] = ("output",)
    rtol: dict[torch.dtype, float] = field(default_factory=lambda: dict(DEFAULT_RTOL))
    grad_rtol: dict[torch.dtype, float] = field(default_factory=lambda: dict(DEFAULT_GRAD_RTOL))
    # Backward: positions in Inputs.args of the differentiable inputs (floating tensors there get requires_grad),
    # bytes the backward must move, and the autograd formula of the kernel ops: (setup_context, backward_for)
    # where backward_for(bwd_op) is the backward calling that tier's backward kernel op. bwd_fake is the
    # backward kernel ops' fake.
    grad_args: tuple[int, ...] = (0,)
    bwd_bytes: Callable[[Problem, torch.dtype], int] | None = None
    autograd: tuple[Callable[..., None], Callable[[Callable[..., Any]], Callable[..., Any]]] | None = None
    bwd_fake: Callable[..., Any] | None = None
    # The op's contract, checked once before any implementation runs (``checked``): ``validate`` takes the op's call
    # arguments and raises a TypeError/ValueError naming the argument, what was expected and what came (types,
    # dtypes, shapes, devices, options); ``check_values`` checks what only the data says (sorted offsets, targets in
    # range), where reading it costs no device sync (CPU tensors outside a torch.compile trace), and is a no-op
    # elsewhere. ``result_dtype``: a call's output dtype where floating arguments of several dtypes meet (default:
    # the first argument's), as torch gives it.
    validate: Callable[..., None] | None = None
    check_values: Callable[..., None] | None = None
    result_dtype: Callable[..., torch.dtype] | None = None
    # ``takes_mixed``: whether a call's mix of floating dtypes is one every tier takes as it is (a Hugging Face norm
    # form's float32 weight over a bfloat16 x), not a promotion.
    takes_mixed: Callable[..., bool] | None = None
    # The generic tests' cases: ``bad_inputs``, calls every tier (and ``tiered_ops.<op>``) must refuse, each naming
    # its argument; ``variants``, the parameter sets the generic tests (NaN/Inf propagation, dtype errors) run the op
    # at (the defaults; more where a parameter changes the kernels' code path).
    bad_inputs: tuple[BadInput, ...] = ()
    variants: tuple[dict[str, Any], ...] = ({},)
    # More candidates of the kernel tiers: (suffix, keyword arguments of ``kernel_args``) each registers
    # ``triton_<suffix>`` and ``cuda_<suffix>``, the same kernels at another setting of a tuned parameter (a chunk
    # size).
    kernel_variants: tuple[tuple[str, dict[str, Any]], ...] = ()
    impls: dict[str, Impl] = field(default_factory=dict)

    def mode_bytes(self, problem: Problem, dtype: torch.dtype, mode: str) -> int:
        """Bytes a call in ``mode`` must move at least (forward, backward, or both)."""
        fwd = self.bytes_moved(problem, dtype)
        if mode in ("fwd_nograd", "fwd"):
            return fwd
        bwd = self.bwd_bytes(problem, dtype) if self.bwd_bytes else 0
        return bwd if mode == "bwd" else fwd + bwd

    def fresh_impl(self, row: dict, env: str | None = None) -> Impl | None:
        """The implementation a stored row measured, if it still exists with the same source, the row was measured
        with the current method of its context (``CONTEXT_METHODS``) and, for a failure stored with its build
        environment (``env``), that environment is still this process's (``env``: as the caller read it); else None."""
        impl = self.impls.get(row["impl"])
        if (impl is None or row["source_hash"] != impl.source_hash
                or row.get("method") != CONTEXT_METHODS.get(row.get("context"), METHOD_VERSION)):
            return None
        return None if row.get("env") and row["env"] != (env or environment()) else impl

    def freshness(self, rows: list[dict], env: str | None = None) -> tuple[dict[str, Impl], list[Impl]]:
        """(the implementation of each fresh row of ``rows`` by its name, the implementations of ours, no peer,
        without one): ``fresh_impl`` over one row per implementation (a bucket's newest), the environment read once
        (``env``: as the caller read it)."""
        env = env or (environment() if any(r.get("env") for r in rows) else None)
        fresh = {r["impl"]: impl for r in rows if (impl := self.fresh_impl(r, env)) is not None}
        return fresh, [i for i in self.impls.values() if i.name not in fresh and i.tier != Tier.PEER]

    def unmeasured(self, rows: list[dict]) -> list[Impl]:
        """The implementations of ours (no peer) without a fresh row among ``rows`` (``fresh_impl``)."""
        return self.freshness(rows)[1]

    def add(self, impl: Impl) -> Impl:
        if impl.name in self.impls:
            raise ValueError(f"{self.name}: implementation {impl.name!r} registered twice")
        self.impls[impl.name] = impl
        return impl


@dataclass
class Impl:
    """One implementation of an op at one tier."""

    name: str
    tier: Tier
    fn: Callable[..., torch.Tensor]
    sources: tuple[Path, ...]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    devices: tuple[str, ...] = ("cpu", "cuda")
    # Returns None when the implementation can run on this device, else the reason it cannot.
    available: Callable[[torch.device], str | None] = lambda device: None
    # Returns None when the implementation can be timed on this device, else why not.
    timeable: Callable[[torch.device], str | None] = lambda device: None
    # The same kernel reached without torch.library (raw Triton launcher, pybind11 function): measured for
    # contrast in the graph-break metadata, never selected. Returns None where it does not exist here.
    unregistered: Callable[[], Callable[..., torch.Tensor] | None] | None = None
    # Files whose non-comment lines are this implementation's own code (kernel + launcher + binding), and
    # the functions inside shared files that are its own (name of a C++/Python function).
    own_code: tuple[Path, ...] = ()
    own_functions: tuple[tuple[Path, str], ...] = ()
    # ``fn`` without the op's contract check (``checked``): for a caller that has validated this call signature
    # already (the hot path of ``tiered_ops.<op>``, a timed call of the harness's own inputs). None: ``fn`` itself.
    unchecked: Callable[..., Any] | None = None
    _hash: str | None = None

    def why_not(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        """Why this implementation cannot run for (device, dtype), or None when it can."""
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)} only, not {device.type}"
        if dtype is not None and dtype not in self.dtypes:
            return f"dtype {DTYPE_NAMES.get(dtype, dtype)} not supported"
        return self.available(device)

    @property
    def source_hash(self) -> str:
        """Hash of the files this implementation is built from: a stored result with another hash is stale."""
        if self._hash is None:
            h = hashlib.sha256()
            for p in sorted(set(self.sources)):
                h.update(p.name.encode())
                h.update(p.read_bytes())
            self._hash = h.hexdigest()[:16]
        return self._hash


OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    if spec.name in OPS:
        raise ValueError(f"op {spec.name!r} registered twice")
    OPS[spec.name] = spec
    return spec


def mixed_dtypes(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the floating tensors among a call's arguments have more than one dtype."""
    first = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            if first is None:
                first = a.dtype
            elif a.dtype != first:
                return True
    return False


def needs_promotion(spec: OpSpec, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a call mixes floating dtypes in a way torch promotes (``run_promoted``), rather than one its op
    takes as it is (``spec.takes_mixed``)."""
    return mixed_dtypes(args, kwargs) and not (spec.takes_mixed is not None and spec.takes_mixed(*args, **kwargs))


def run_promoted(spec: OpSpec, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """A call whose floating tensors have several dtypes, as torch promotes it: every floating tensor taken exactly
    to the widest of their dtypes (an upcast loses nothing), ``fn`` run there (one dtype, as every implementation
    takes it) and each output rounded once to the dtype torch returns (``spec.result_dtype``, default the first
    argument's). Autograd takes each gradient back to its input's dtype."""
    floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    wide = floats[0].dtype
    for t in floats[1:]:
        wide = torch.promote_types(wide, t.dtype)
    up = lambda a: a.to(wide) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
    out_dtype = spec.result_dtype(*args, **kwargs) if spec.result_dtype is not None else floats[0].dtype
    out = fn(*(up(a) for a in args), **{k: up(v) for k, v in kwargs.items()})
    if isinstance(out, tuple):
        return tuple(o.to(out_dtype) for o in out)
    return out.to(out_dtype)


def checked(spec: OpSpec, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an implementation of ``spec``) behind the op's contract: ``spec.validate`` and ``spec.check_values``
    once, before anything runs, then ``fn``; a call of mixed floating dtypes that the contract accepts (a bfloat16
    weight for a float32 x) runs through ``run_promoted``, so every tier gives torch's result dtype and values."""
    validate, values = spec.validate, spec.check_values

    def call(*args: Any, **kwargs: Any) -> Any:
        if validate is not None:
            validate(*args, **kwargs)
        if values is not None:
            values(*args, **kwargs)
        if needs_promotion(spec, args, kwargs):
            return run_promoted(spec, fn, args, kwargs)
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", spec.name)
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
