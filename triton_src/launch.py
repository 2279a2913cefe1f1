"""Direct launches of compiled Triton kernels, for eager callers that pay per-call host time.

``kernel[grid](...)`` (the JITFunction launch) binds the arguments, computes Triton's specialization of every one
of them, builds a cache key from the specialization and the options, looks the compiled kernel up, asks the driver
for the current device and stream, and then calls the compiled kernel's launcher. A :class:`DirectKernel` fixes the
constexprs and options once, goes through that launch the first time per specialization key, keeps the
``CompiledKernel`` it returns, and afterwards calls the compiled kernel's launcher (``CompiledKernel.run``) itself.

The launcher's arguments (Triton 3.6 to 3.9, the same as ``CompiledKernel.__getitem__`` passes them): grid x, y, z,
the raw stream, the CUfunction, the packed metadata, the launch metadata (None unless a launch-enter hook is set),
the enter and exit hooks, then every argument of the kernel in signature order, constexprs included (the launcher
skips them). Under the launcher, a plan's launch calls Triton's C launch itself, in the form of the installed Triton's
version (:data:`LAUNCH_FORMS`, checked at import; an unknown version is told once and launched Triton's own way).

The key here covers everything that changes Triton's specialization of an argument: a tensor's dtype and whether
its data pointer is 16-byte aligned; an int's type (i32 / i64 / u64 by range), whether it is 1 (Triton makes it a
constexpr) and whether it is a multiple of 16; the Python type of any other scalar. The constexprs and the options
are fixed per DirectKernel, and the device is the current CUDA device, as Triton's launch takes it.
On the Triton interpreter (TRITON_INTERPRET=1) a DirectKernel launches the kernel the normal way: correctness only.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Any, Callable

import torch
import triton
from torch.library import triton_op, wrap_triton

log = logging.getLogger(__name__)
_I32 = 1 << 31


def _key_function(kinds: str) -> Callable[..., tuple]:
    """The key of one call's arguments, for arguments of these kinds ('t' tensor, 'i' int, 'o' other), made once per
    DirectKernel: generated source, as Triton's own binder is, so that a call pays no loop over its arguments."""
    parts, names = [], []
    for i, k in enumerate(kinds):
        a = f"a{i}"
        names.append(a)
        if k == "t":
            parts.append(f"{a}.dtype, ({a}.data_ptr() & 15) == 0")
        elif k == "i":
            parts.append(f"{a}.__class__, {a} == 1, ({a} & 15) == 0, -{_I32} <= {a} < {_I32}, {a} >= {1 << 63}")
        else:
            parts.append(f"{a}.__class__")
    src = f"def key(dev, {', '.join(names)}):\n    return (dev, {', '.join(parts)})\n" if names else \
        "def key(dev):\n    return (dev,)\n"
    namespace: dict[str, Any] = {}
    exec(compile(src, f"<triton_src.launch key {kinds}>", "exec"), namespace)  # noqa: S102 - our own source
    return namespace["key"]


def _pointers_function(kinds: str) -> Callable[..., tuple | None]:
    """The arguments of these kinds with every tensor replaced by its data pointer (an int, which Triton's C launch
    takes as the address itself: no data_ptr call and no cuPointerGetAttribute there), or None when a pointer is not
    16-byte aligned."""
    names = [f"a{i}" for i in range(len(kinds))]
    outs = [f"p{i}" if k == "t" else a for i, (a, k) in enumerate(zip(names, kinds))]
    body = [f"    p{i} = a{i}.data_ptr()" for i, k in enumerate(kinds) if k == "t"]
    ptrs = [f"p{i}" for i, k in enumerate(kinds) if k == "t"] or ["0"]
    body.append(f"    if ({' | '.join(ptrs)}) & 15:\n        return None")
    body.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
    src = f"def pointers({', '.join(names)}):\n" + "\n".join(body) + "\n"
    namespace: dict[str, Any] = {}
    exec(compile(src, f"<triton_src.launch pointers {kinds}>", "exec"), namespace)  # noqa: S102 - our own source
    return namespace["pointers"]


def _kind(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return "t"
    if isinstance(a, int) and not isinstance(a, bool):
        return "i"
    return "o"


def _hook_holder() -> Any:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return knobs.runtime
    from triton.compiler import CompiledKernel  # a Triton without knobs holds the hooks on the class

    return CompiledKernel


_HOOKS = _hook_holder()


def _hooks() -> tuple[Any, Any]:
    """Triton's launch enter/exit hooks when any is set (a profiler such as proton), else (None, None)."""
    enter, exit_ = _HOOKS.launch_enter_hook, _HOOKS.launch_exit_hook
    # Triton 3.9 holds hook chains (never None, empty when no hook is set); older ones hold a function or None.
    if getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_):
        return enter, exit_
    return None, None


# How the fast path calls the C launch under a compiled kernel's launcher (Triton's CudaLauncher), per Triton version,
# read from each version's triton/backends/nvidia/driver.py (the launcher, its C launch) and triton/compiler/compiler.py
# (``CompiledKernel.__getitem__``, whose launcher arguments are those of this module's docstring in all four):
# SPREAD (3.6): the C launch generated per kernel takes grid x, y, z, stream, function, cooperative grid, PDL, global
#   scratch, profile scratch, packed metadata, launch metadata, enter hook, exit hook, then the kernel's arguments;
# PACKED (3.7 to 3.9): the shared C launch takes grid x, y, z, stream, function, cooperative grid, PDL, packed metadata,
#   launch metadata, enter hook, exit hook, global scratch, profile scratch, the launcher's arg_annotations and
#   kernel_signature, then the kernel's arguments as one tuple.
# Both take a pointer argument as an int (the address itself). The table is read at import; another Triton logs one
# WARNING at the first direct launch and every launch then goes through Triton's own launch (``kernel[grid](...)``):
# correct, slower. tests/test_fastpath.py fails on a Triton missing here.
SPREAD, PACKED = "spread", "packed"
LAUNCH_FORMS: dict[tuple[int, int], str] = {(3, 6): SPREAD, (3, 7): PACKED, (3, 8): PACKED, (3, 9): PACKED}


def triton_version(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of ``version`` (default: the installed Triton's), or None where it does not read so."""
    parts = (triton.__version__ if version is None else version).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


LAUNCH_FORM: str | None = LAUNCH_FORMS.get(triton_version())
_warned: list[bool] = []


def launch_form() -> str | None:
    """The installed Triton's launch form, or None (unsupported: one WARNING, the first time it is asked)."""
    form = LAUNCH_FORM
    if form is None and not _warned:
        _warned.append(True)
        log.warning("Triton %s is not one whose kernel launcher the Triton fast path knows (%s): its kernels go "
                    "through Triton's own launch, correct but with more host time per call",
                    triton.__version__, ", ".join(f"{a}.{b}" for a, b in sorted(LAUNCH_FORMS)))
    return form


def c_launch(run: Any, form: str | None = None) -> tuple | None:
    """How to call the C launch under ``run`` (a compiled kernel's launcher) directly: (C launch, packed form,
    cooperative grid, PDL, arg annotations, kernel signature), or None where ``run`` is to be called as it is: a
    launcher other than Triton's CudaLauncher, a kernel needing scratch memory (the launcher allocates it), a
    sanitizer build (GSan adds arguments), or a Triton missing from LAUNCH_FORMS. ``form``: the installed Triton's
    by default. :func:`c_launch_args` lays the arguments out."""
    form = LAUNCH_FORM if form is None else form
    if form is None or type(run).__name__ != "CudaLauncher" or getattr(run, "gsan_enabled", False):
        return None
    try:
        if run.global_scratch_size != 0 or run.profile_scratch_size != 0:
            return None
        if form == PACKED:
            return run.launch, True, run.launch_cooperative_grid, run.launch_pdl, run.arg_annotations, \
                run.kernel_signature
        return run.launch, False, run.launch_cooperative_grid, run.launch_pdl, None, None
    except AttributeError:  # a launcher of this name without the attributes its version has: called as it is
        return None


def c_launch_args(c: tuple, grid: tuple, stream: int, function: Any, packed: Any, args: tuple) -> tuple:
    """The C launch's arguments (see :func:`c_launch`) for one launch without hooks; ``args``: every argument of the
    kernel in signature order, constexprs included."""
    if c[1]:
        return (grid[0], grid[1], grid[2], stream, function, c[2], c[3], packed, None, None, None, None, None, c[4],
                c[5], args)
    return (grid[0], grid[1], grid[2], stream, function, c[2], c[3], None, None, packed, None, None, None, *args)


class DirectKernel:
    """One @triton.jit kernel with fixed constexprs and launch options (num_warps, ...), launched as
    ``dk(grid, *args)`` with ``grid`` a 3-tuple and ``args`` its non-constexpr arguments in signature order."""

    def __init__(self, kernel: Any, options: dict[str, Any], consts: dict[str, Any]) -> None:
        self._kernel, self.module, self.name = kernel, kernel.fn.__module__, kernel.fn.__name__
        self.options, self.consts = options, consts
        self._interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        # A Triton whose launcher this module does not know: Triton's own launch for every call (one WARNING).
        self._unknown = not self._interpreted and launch_form() is None
        self._cache: dict[tuple, tuple] = {}
        self._key: Callable[..., tuple] | None = None
        # A JITFunction's params say which are constexprs; an interpreted function's annotations do.
        params = getattr(kernel, "params", None)
        if params is not None:
            names, const_names = [p.name for p in params], [p.name for p in params if p.is_constexpr]
        else:
            sig = inspect.signature(kernel.fn).parameters
            names = list(sig)
            const_names = [n for n, p in sig.items() if "constexpr" in str(p.annotation)]
        if sorted(const_names) != sorted(consts):
            raise TypeError(f"{self.name}: constexprs {sorted(const_names)} expected, got {sorted(consts)}")
        # Constexprs after the last runtime argument (every kernel here) are appended; elsewhere, merged per call.
        self._trailing = names[len(names) - len(const_names):] == const_names
        self._tail = tuple(consts[n] for n in names if n in consts)
        self._slots = [(n in consts, consts.get(n)) for n in names]

    def kernel(self) -> Any:
        """The kernel; on the interpreter as its module holds it now (a JITFunction defined before TRITON_INTERPRET
        was set is made again as an interpreted one)."""
        if self._interpreted:
            return getattr(sys.modules[self.module], self.name, self._kernel)
        return self._kernel

    def _all_args(self, args: tuple) -> tuple:
        if self._trailing:
            return args + self._tail
        it = iter(args)
        return tuple(v if const else next(it) for const, v in self._slots)

    def _launch_jit(self, grid: tuple, args: tuple) -> Any:
        return self.kernel()[grid](*args, **self.consts, **self.options)

    def _first(self, dev: int, key: tuple | None, grid: tuple, args: tuple) -> None:
        ck = self._launch_jit(grid, args)
        if key is None or ck is None or not hasattr(ck, "packed_metadata"):
            return
        run = ck.run  # loads the binary onto the device (CompiledKernel._init_handles)
        self._cache[key] = (run, ck.function, ck.packed_metadata, ck)
        log.debug("%s: compiled kernel kept for device %d, key %s", self.name, dev, key)

    def __call__(self, grid: tuple, *args: Any) -> None:
        if self._interpreted or self._unknown:
            self._launch_jit(grid, args)
            return
        dev = torch._C._cuda_getDevice()
        keyf = self._key
        if keyf is None:
            keyf = self._key = _key_function("".join(_kind(a) for a in args))
        try:
            key = keyf(dev, *args)
        except (AttributeError, TypeError):  # an argument of another kind than on the first call: Triton's launch
            self._launch_jit(grid, args)
            return
        entry = self._cache.get(key)
        if entry is None:
            self._first(dev, key, grid, args)
            return
        run, function, packed, ck = entry
        stream = torch._C._cuda_getCurrentRawStream(dev)
        full = self._all_args(args)
        enter, exit_ = _hooks()
        meta = ck.launch_metadata(grid, stream, *full) if enter is not None else None
        run(grid[0], grid[1], grid[2], stream, function, packed, meta, enter, exit_, *full)


def param_key(t: torch.Tensor | None) -> tuple | None:
    """What a launch plan's key holds of an optional parameter tensor (its checks depend on nothing else)."""
    return None if t is None else (t.shape, t.dtype, t.get_device())


_kernels: dict[tuple, DirectKernel] = {}


def direct(kernel: Any, num_warps: int, **consts: Any) -> DirectKernel:
    """The DirectKernel of ``kernel`` with these constexprs and ``num_warps`` (one per combination, shared)."""
    key = (kernel.fn.__module__, kernel.fn.__name__, num_warps, tuple(sorted(consts.items())))
    dk = _kernels.get(key)
    if dk is None:
        dk = _kernels[key] = DirectKernel(kernel, {"num_warps": num_warps}, consts)
    return dk


class Bound:
    """A DirectKernel at one grid, for one launch plan whose key holds the dtypes and the ints of the arguments
    (the caller keeps them the same on every call). A call then checks only the current device and that every
    pointer is 16-byte aligned, and launches the kept compiled kernel with the pointers as ints (through the C launch
    itself where :func:`c_launch` knows how); any other call goes through the DirectKernel's full key."""

    __slots__ = ("dk", "grid", "dev", "pointers", "entry")

    def __init__(self, dk: DirectKernel, grid: tuple[int, int, int]) -> None:
        self.dk, self.grid = dk, grid
        self.dev = -1
        self.pointers: Callable[..., tuple | None] | None = None
        self.entry: tuple | None = None

    def __call__(self, *args: Any) -> None:
        entry = self.entry
        if entry is not None and torch._C._cuda_getDevice() == self.dev:
            raw = self.pointers(*args)
            if raw is not None:
                run, function, packed, ck, tail, c = entry
                grid = self.grid
                stream = torch._C._cuda_getCurrentRawStream(self.dev)
                enter, exit_ = _hooks()
                if enter is None:
                    full = raw + tail if tail is not None else self.dk._all_args(raw)
                    if c is None:
                        run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *full)
                    elif c[1]:  # PACKED (see c_launch)
                        c[0](grid[0], grid[1], grid[2], stream, function, c[2], c[3], packed, None, None, None, None,
                             None, c[4], c[5], full)
                    else:  # SPREAD
                        c[0](grid[0], grid[1], grid[2], stream, function, c[2], c[3], None, None, packed, None, None,
                             None, *full)
                    return
                full = self.dk._all_args(args)  # a launch hook sees the tensors, as Triton's own launch gives them
                meta = ck.launch_metadata(grid, stream, *full)
                run(grid[0], grid[1], grid[2], stream, function, packed, meta, enter, exit_, *full)
                return
        dk = self.dk
        dk(self.grid, *args)
        if entry is None and not dk._interpreted and dk._key is not None:
            pointers = _pointers_function("".join(_kind(a) for a in args))
            if pointers(*args) is not None:
                dev = torch._C._cuda_getDevice()
                kept = dk._cache.get(dk._key(dev, *args))
                if kept is not None:
                    self.dev, self.pointers = dev, pointers
                    self.entry = (*kept, dk._tail if dk._trailing else None, c_launch(kept[0]))


def bound(kernel: Any, grid: tuple[int, int, int], num_warps: int, **consts: Any) -> Bound:
    """``direct(kernel, num_warps, **consts)`` at ``grid``, for one launch plan (see :class:`Bound`)."""
    return Bound(direct(kernel, num_warps, **consts), grid)


class Step:
    """One kernel launch of a launch plan: the kernel, its grid, ``num_warps`` and constexprs, fixed when the plan is
    made (once per shape on the eager fast path, per call in the registered op). ``step(direct, *args)`` launches it
    with its runtime arguments in signature order: through ``wrap_triton`` when not ``direct`` (the registered
    triton_op, so torch.compile traces the launch), else through :class:`Bound` (the kept compiled kernel, for eager
    callers). Both read the same fields, so the two launches of a plan cannot differ in their settings."""

    __slots__ = ("kernel", "grid", "num_warps", "consts", "_bound")

    def __init__(self, kernel: Any, grid: tuple, num_warps: int, **consts: Any) -> None:
        self.kernel, self.grid, self.num_warps, self.consts = kernel, grid, num_warps, consts
        self._bound: Bound | None = None

    def __call__(self, direct: bool, *args: Any) -> None:
        if not direct:
            wrap_triton(self.kernel)[self.grid](*args, **self.consts, num_warps=self.num_warps)
            return
        b = self._bound
        if b is None:
            grid = (*self.grid, 1, 1)[:3]
            b = self._bound = bound(self.kernel, grid, self.num_warps, **self.consts)
        b(*args)

    def __repr__(self) -> str:
        name = getattr(getattr(self.kernel, "fn", None), "__name__", self.kernel)
        return f"Step({name}, grid={self.grid}, num_warps={self.num_warps}, {self.consts})"


def register_ops(name: str, launch: Callable[..., Any], bwd_launch: Callable[..., Any]) -> tuple[Any, Any]:
    """An op's two launchers registered as ``tiered_ops::<name>_triton`` and ``tiered_ops::<name>_bwd_triton``."""
    return (triton_op(f"tiered_ops::{name}_triton", launch, mutates_args={}),
            triton_op(f"tiered_ops::{name}_bwd_triton", bwd_launch, mutates_args={}))


class Plans(dict):
    """An op's launch plans kept per key for its eager fast path: ``plans.get(key) or plans.new(key, *args)``, the
    plan made by ``make(*args)`` once per key (a plan is a non-empty tuple, so never falsy)."""

    def __init__(self, make: Callable[..., Any]) -> None:
        super().__init__()
        self.make = make

    def new(self, key: tuple, *args: Any) -> Any:
        plan = self[key] = self.make(*args)
        return plan
