"""The tiers: the four standard implementations of an op, built from its declaration and its kernel files.

``standard_impls(spec)`` turns a declaration (``tiered_ops/ops/<op>.py``) into its eager, compile, triton and cuda
implementations (cuda where ``cuda_src`` has the op's files); the plumbing of each tier (lazy torch.compile, the
Triton interpreter, the CUDA extension's registrations, availability checks, source files for staleness) lives here
and nowhere else.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Callable

import torch

from ..registry import Impl, OpSpec, Tier, checked, package_dir
from . import cuda_ext, fastpath, native

TRITON_SRC = package_dir("triton_src")
log = logging.getLogger(__name__)


def _triton_module(op: str):
    import importlib

    return importlib.import_module(f"triton_src.{op}")


def register_kernel_ops(spec: OpSpec, tier: str, fakes: bool) -> None:
    """Autograd (and, when ``fakes``, fake) registrations of ``tiered_ops::<op>_<tier>`` and its backward op."""
    fwd, bwd = f"tiered_ops::{spec.name}_{tier}", f"tiered_ops::{spec.name}_bwd_{tier}"
    if fakes and spec.fake is not None:
        torch.library.register_fake(fwd)(spec.fake)
    if fakes and spec.bwd_fake is not None:
        torch.library.register_fake(bwd)(spec.bwd_fake)
    if spec.autograd is not None:
        setup, backward_for = spec.autograd
        torch.library.register_autograd(fwd, backward_for(_kernel_op(f"{spec.name}_bwd_{tier}")),
                                        setup_context=setup)


# Modules (and the class) whose Triton functions a kernel of triton_src calls: triton's library (tl.max, tl.sum, the
# tensor methods) and triton_src itself.
_TRITON_FUNCTION_MODULES = ("triton.language", "triton_src")
_late_interpreter: list[str | None] = []  # [] until checked on the interpreter, then [None] or [why not]


def _triton_function_holders() -> list[Any]:
    import sys

    import triton.language as tl

    mods = [m for n, m in list(sys.modules.items()) if m is not None
            and any(n == p or n.startswith(p + ".") for p in _TRITON_FUNCTION_MODULES)]
    return [*mods, tl.tensor]


def _interpreted_launch() -> str | None:
    """None when torch launches interpreted kernels through ``wrap_triton`` (torch >= 2.13), else why not."""
    from torch.library import wrap_triton
    from triton.runtime.interpreter import InterpretedFunction

    try:
        wrap_triton(InterpretedFunction(_triton_function_holders))  # checks the kernel's type only, launches nothing
    except RuntimeError as e:
        return (f"torch {torch.__version__} cannot launch Triton kernels on the interpreter ({e}); torch >= 2.13 "
                "can, or run the Triton tier on a GPU")
    return None


def _remake_for_interpreter() -> str | None:
    """Triton functions defined before TRITON_INTERPRET=1 was set, made again as interpreted ones; None or why not."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    remade: dict[int, Any] = {}
    for holder in _triton_function_holders():
        for name, value in list(vars(holder).items()):
            if isinstance(value, JITFunction):
                if id(value) not in remade:
                    remade[id(value)] = InterpretedFunction(value.fn)
                setattr(holder, name, remade[id(value)])
    if remade:
        log.info("TRITON_INTERPRET=1 was set after triton was imported: %d Triton functions made again for the "
                 "interpreter", len(remade))
    left = sorted(f"{getattr(h, '__name__', h)}.{n}" for h in _triton_function_holders()
                  for n, v in vars(h).items() if isinstance(v, JITFunction))
    return (f"triton was imported before TRITON_INTERPRET=1 was set and {', '.join(left[:3])} stay compiled-only; "
            "set TRITON_INTERPRET=1 before anything imports triton") if left else None


def interpreter_ready() -> str | None:
    """None when the Triton tier runs on the interpreter in this process, else why not (checked once per process).

    torch must launch interpreted kernels through ``wrap_triton``. And ``@triton.jit`` reads TRITON_INTERPRET when it
    defines a function: when triton was imported before the variable was set (by torch or a test suite before
    ``import tiered_ops``), triton's library functions are compiled-only and a kernel calling ``tl.max`` fails inside
    the interpreter with "Cannot call @triton.jit'd outside of the scope of a kernel". Those functions are made again
    as interpreted ones, as ``@triton.jit`` makes them when the variable is set first (the same Python source).
    """
    if not _late_interpreter:
        try:
            why = _interpreted_launch() or _remake_for_interpreter()
        except Exception as e:  # a triton whose internals differ: the tier says why instead of failing in a kernel
            why = (f"the Triton interpreter could not be set up ({type(e).__name__}: {e}); where triton was imported "
                   "first, set TRITON_INTERPRET=1 before anything imports triton")
        _late_interpreter.append(why)
    return _late_interpreter[0]


def _triton_load(spec: OpSpec) -> str | None:
    """Import triton_src/<op>.py (registers its triton_ops) and register autograd once; None or why it failed."""
    try:
        from triton_src import common

        why = interpreter_ready() if common.interpreted() else None
        if why:
            return why
        mod = _triton_module(spec.name)
    except Exception as e:  # triton missing or broken on this machine
        return f"triton unavailable: {type(e).__name__}: {e}"
    if not getattr(mod, "_registered", False):
        # On the interpreter triton_op's derived fake would run the kernel on fake tensors; the op's own fake
        # lets dynamo trace it (explain, fullgraph) on the CPU. On a GPU triton_op's own is used.
        register_kernel_ops(spec, "triton", fakes=common.interpreted())
        mod._registered = True
    return None


def _triton_available_for(spec: OpSpec) -> Callable[[torch.device], str | None]:
    def available(device: torch.device) -> str | None:
        why = _triton_load(spec)
        if why:
            return why
        from triton_src import common

        return common.available(device)

    return available


def _triton_timeable(device: torch.device) -> str | None:
    from triton_src import common

    return common.timeable(device)


def _kernel_op(name: str, load: Callable[[], str | None] | None = None) -> Callable[..., Any]:
    """torch.ops.tiered_ops.<name>, resolved on first call (loading its module or extension with ``load``)."""
    resolved: list[Callable[..., Any]] = []

    def call(*args: Any) -> Any:
        if not resolved:
            if torch.compiler.is_compiling():
                # A first call inside a trace: loading (imports, the extension's lock) would break the graph. The
                # availability check that chose this implementation has loaded it already.
                return getattr(torch.ops.tiered_ops, name)(*args)
            if load is not None:
                why = load()
                if why:
                    raise RuntimeError(f"tiered_ops::{name} is unavailable: {why}")
            resolved.append(getattr(torch.ops.tiered_ops, name))
        return resolved[0](*args)

    return call


class Compiled:
    """torch.compile of the eager function, created on first call, specialized per shape."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self._compiled: Callable[..., torch.Tensor] | None = None

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)  # inside a compiled region the caller's graph takes the op in
        if self._compiled is None:
            import torch._dynamo.config as dcfg

            # Benchmarks call one op at many shapes; past the default limit of 8 recompiles dynamo would
            # silently run eager instead, so the compile tier's timings would be eager's.
            dcfg.recompile_limit = max(dcfg.recompile_limit, 256)
            dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 4096)
            # dynamic=False: one specialized graph per shape, as a model with fixed shapes gets. With the
            # default, the first recompile turns dims dynamic and later shapes get generic, slower kernels.
            self._compiled = torch.compile(self.fn, dynamic=False, backend=_inductor_without_donated_buffers)
        return self._compiled(*args, **kwargs)


def _inductor_without_donated_buffers(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """Inductor with functorch's donated buffers off for this compile only. The bwd mode times a backward replayed
    from a retained graph, which a backward compiled with donated buffers refuses (retain_graph=True); set for the
    whole process, the flag also took from every model compiled later in it (a user's, after ``tune``) the backward's
    reuse of saved buffers that stock's compile has (the loss backward writing the logits' gradient over them)."""
    import torch._functorch.config as fcfg
    from torch._inductor.compile_fx import compile_fx

    with fcfg.patch(donated_buffer=False):
        return compile_fx(gm, example_inputs)


def _eager_fast(spec: OpSpec, tier: str, registered: Callable[..., Any], load: Callable[[], str | None]
                ) -> Callable[..., Any]:
    """The kernel tier as its callers run it: the registered op while torch.compile traces (the graph takes it in), and
    otherwise the eager fast path (``fastpath.tier_fast``: the launchers called directly, one Python autograd.Function
    when a gradient is needed; ``native.native_fast`` where the op's CUDA wrapper has that node in C++), made on the
    first call once ``load`` has brought the tier up; the registered op where the tier has no fast path."""
    resolved: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if resolved:  # the fast path hands a traced call to ``registered`` itself: one compile check per call
            return resolved[0](*args, **kwargs)
        if torch.compiler.is_compiling():
            return registered(*args, **kwargs)  # a first call inside a trace: loading would break the graph
        why = load()
        if why:
            raise RuntimeError(f"tiered_ops::{spec.name}_{tier} is unavailable: {why}")
        fast = native.native_fast(spec, registered) if tier == "cuda" else None  # a C++ autograd node, where declared
        fast = fast or fastpath.tier_fast(spec, tier, spec.first_output, fallback=registered)
        resolved.append(fast or registered)
        return resolved[0](*args, **kwargs)

    return call


def _bind(kernel: Callable[..., Any], kernel_args: Callable[..., tuple], first: bool, outputs: int = 1
          ) -> Callable[..., Any]:
    """The op's Python signature onto a kernel op (or launcher): map the arguments; when ``first``, keep the op's
    ``outputs`` leading outputs (output 0 alone for a one-output op) and drop the saved statistics after them."""
    if first and outputs > 1:
        return lambda *a, **k: tuple(kernel(*kernel_args(*a, **k))[:outputs])
    if first:
        return lambda *a, **k: kernel(*kernel_args(*a, **k))[0]
    return lambda *a, **k: kernel(*kernel_args(*a, **k))


def local_imports(path: Path) -> tuple[Path, ...]:
    """``path`` and the sibling modules it imports relatively (``from .rms_norm import ...``), transitively: the files
    whose bytes an implementation built from ``path`` runs, so its source hash moves when any of them changes."""
    seen: list[Path] = []
    todo = [path]
    while todo:
        p = todo.pop()
        if p in seen or not p.is_file():
            continue
        seen.append(p)
        for m in re.finditer(r"^from \.(\w+) import", p.read_text(), re.M):
            todo.append(p.parent / f"{m.group(1)}.py")
    return tuple(seen)


def standard_impls(spec: OpSpec) -> None:
    """Register the eager, compile, triton and cuda implementations of ``spec`` (kernel files named after the op),
    ahead of any implementation the declaration added itself. The cuda tier exists where ``cuda_src/<op>.cu`` or
    ``cuda_src/<op>.cpp`` does: a CUDA kernel stays only where it earns its keep (``analysis/territories.py``).

    ``spec.kernel_args`` maps the op's Python signature onto the kernel ops' schema (e.g. normalized_shape to a
    list); ``spec.first_output``: the kernel ops return (outputs..., saved statistics...) and the op returns its
    ``spec.outputs`` leading ones. The
    Triton op is ``tiered_ops::<op>_triton``, the CUDA op ``tiered_ops::<op>_cuda``, each with a backward op
    ``<op>_bwd_<tier>`` that ``spec.autograd`` calls.
    """
    name, op_file, first_output, n_out = spec.name, spec.source, spec.first_output, len(spec.outputs)
    op_files = local_imports(op_file)  # the declaration and the sibling modules it imports (ops/_common.py, ...)
    eager = spec.eager or spec.reference
    kernel_args = spec.kernel_args
    if kernel_args is None:
        raise ValueError(f"{name}: the declaration needs kernel_args to build its kernel tiers")
    declared, spec.impls = dict(spec.impls), {}
    triton_file = TRITON_SRC / f"{name}.py"
    cu_file, wrapper = cuda_ext.op_files(name)
    # Each tier's fn runs behind the op's contract (``registry.checked``: validated once, before the tier runs, mixed
    # dtypes promoted as torch does); ``unchecked`` is the tier alone, for callers that validated the call already.
    spec.add(Impl("eager", Tier.EAGER, checked(spec, eager), op_files, own_functions=((op_file, eager.__name__),),
                  unchecked=eager))
    compiled = Compiled(eager)
    spec.add(Impl("compile", Tier.COMPILE, checked(spec, compiled), op_files,
                  own_functions=((op_file, eager.__name__),), unchecked=compiled))
    fast_file = Path(fastpath.__file__)
    triton_registered = _bind(_kernel_op(f"{name}_triton", lambda: _triton_load(spec)), kernel_args, first_output,
                              n_out)
    triton_fast = _eager_fast(spec, "triton", triton_registered, lambda: _triton_load(spec))
    spec.add(Impl("triton", Tier.TRITON, checked(spec, triton_fast), unchecked=triton_fast,
                  sources=(*op_files, *local_imports(triton_file), TRITON_SRC / "common.py", TRITON_SRC / "launch.py",
                           fast_file),
                  available=_triton_available_for(spec), timeable=_triton_timeable,
                  unregistered=lambda: _bind(getattr(_triton_module(name), f"{name}_launch"), kernel_args,
                                             first_output, n_out),
                  own_code=(triton_file,)))
    # The CUDA tier where the op has CUDA code (either file: a missing half is reported by the registration test, not
    # hidden); an op whose kernel defends nothing runs at the other three.
    has_cuda = cu_file.exists() or wrapper.exists()
    if has_cuda:
        cuda_files = [cu_file, wrapper, *cuda_ext.shared_files()]
        cuda_files += cuda_ext.included_files(cuda_files)  # the headers they include (norm_grads.cuh, ...)
        if native.declares_node(name):  # its training call goes through tiers/native.py
            cuda_files.append(Path(native.__file__))
        cuda_registered = _bind(_kernel_op(f"{name}_cuda", cuda_ext.load), kernel_args, first_output, n_out)
        cuda_fast = _eager_fast(spec, "cuda", cuda_registered, cuda_ext.load)
        spec.add(Impl("cuda", Tier.CUDA, checked(spec, cuda_fast), unchecked=cuda_fast,
                      sources=(*op_files, *cuda_files, fast_file), devices=("cuda",), available=cuda_ext.available,
                      unregistered=lambda: (lambda f: f and _bind(f, kernel_args, first_output, n_out))(
                          cuda_ext.pybind_function(f"{name}_cuda")),
                      own_code=(cu_file, wrapper)))
    # The same kernel ops at another setting of a tuned parameter: one candidate each (through the registered op: the
    # eager fast path binds the default setting).
    kernel_tiers = [(spec.impls["triton"], lambda: _triton_load(spec))]
    if has_cuda:
        kernel_tiers.append((spec.impls["cuda"], cuda_ext.load))
    for suffix, extra in spec.kernel_variants:
        def args_at(*a: Any, _extra: dict = extra, **k: Any) -> tuple:
            return kernel_args(*a, **k, **_extra)

        for base, load in kernel_tiers:
            registered = _bind(_kernel_op(f"{name}_{base.name}", load), args_at, first_output, n_out)
            spec.add(dataclasses.replace(base, name=f"{base.name}_{suffix}", fn=checked(spec, registered),
                                         unchecked=registered, unregistered=None, _hash=None))
    for impl in declared.values():  # the declaration's own implementations, behind the same contract
        if impl.unchecked is None and impl.tier != Tier.PEER:
            impl.unchecked, impl.fn = impl.fn, checked(spec, impl.fn)
        spec.add(impl)
    if has_cuda:
        cuda_ext.on_load(lambda: register_kernel_ops(spec, "cuda", fakes=True))
