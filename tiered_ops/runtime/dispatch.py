"""The per-call path of ``tiered_ops.<op>``: the public functions, made from each op's declaration, and the slow
path that resolves a call signature's selection once.

Each public function is generated from its op's eager signature (like ``dataclasses`` makes ``__init__``): its
fast path reads ``requires_grad`` of each tensor argument, builds a key of every tensor's shape and dtype, the
first tensor's device, the other arguments and whether the call trains, and calls the cached selection; a miss
goes to ``dispatch``. Generated code keeps the hot path as short as a hand-written one. A call dynamo traces goes to
``traced_call``, whose slow path runs at trace time outside the trace (``trace_plan``); one whose key holds a symbolic
size (dynamic shapes) goes to ``dispatch``: the decision is found by its bucket, not its exact sizes.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from typing import Any, Callable

import torch

from ..decide import capture
from ..decide import decide as _decide
from ..decide.decide import Selection
from ..decide.inductor_choice import call_traced, routed
from ..decide.seam import ask, assume_constant_result, trace_choice
from ..decide.signature import check_tensors, describe, op_signature, stand_ins, tensor_args
from ..registry import CONTEXTS, DTYPE_NAMES, Context, OpSpec, Problem, needs_promotion
from ..tiers import cuda_ext
from ..tiers.catalog import get_op
from .hot import _TRACE_FNS, DECOMPOSED, decomposition, hot_fn, trace_fn
from .memo import _calls, _hot, _traced, _traced_buckets, bucket_key, remember, symbolic_key
from .record import active, note

log = logging.getLogger(__name__)


def dispatch(spec: OpSpec, key: tuple, x: torch.Tensor, args: tuple, kwargs: dict[str, Any],
             train: bool = False, ckey: bytes | None = None) -> torch.Tensor:
    """Slow path of ``tiered_ops.<op>``: resolve the call's selection, cache it by exact signature.

    ``train`` picks the fwd+bwd decision, else the fwd_nograd one; the key's last element is the caller's context
    (an index into ``registry.CONTEXTS``: 0 eager, 1 traced by torch.compile, 2 inside CUDA-graph capture: the int
    keeps the per-call key cheap to hash), read here once as its ``Context``. ``ckey``: the call's C++ key where one was
    read (the selection is cached under it too)."""
    problem = _admitted(spec, x, args, kwargs)  # once per call signature (the key holds what it reads)
    mixed = needs_promotion(spec, args, kwargs)
    mode = "fwd+bwd" if train else "fwd_nograd"
    context = CONTEXTS[key[-1]]
    global _load_tried
    if _ckey is None and context is Context.EAGER and x.is_cuda and not _load_tried and not _python_key:
        _load_tried = True  # once per process: the C++ key, where the CUDA extension is built already
        load_call_key(x.device)
    if active():
        note(spec, problem, x.dtype, mode, x.device, context, (key[:-1], mixed))
    if context is Context.GRAPHED:  # inside CUDA-graph capture: never measure, compile or sync here; not cached (a
        # later capture may find the graphed decision warm)
        return ask(spec, problem, x.dtype, x.device, mode, Context.GRAPHED,
                   capturing=capture.flavor(args, kwargs)).fn(*args, **kwargs)
    if context is Context.COMPILED:
        # traced: the decision made before is read (the store is not looked at: its lock would break the graph) and
        # its code goes into the caller's graph. Nothing is cached: dynamo guards what a trace reads of ``_calls``
        # (a key's absence, its length), and the trace's own write would fail that guard on the next call: a recompile.
        # Symbolic sizes: what an eager call of the bucket primed, by the bucket (its bounds become the graph's guards).
        symbolic = symbolic_key(key)
        if not symbolic:  # Inductor's choice among the tiers where it is asked for (TIERED_OPS_COMPILE_CHOICE)
            out = call_traced(spec, args, kwargs, mode, mixed)
            if out is not None:
                return out
        if symbolic:
            name = _traced_buckets.get(bucket_key(spec, problem, x.dtype, x.device, mode, mixed))
            if name is not None:
                return _TRACE_FNS[name](*args, **kwargs)
        # else the decision is read (or the eager tier chosen, its bucket queued for tuning) by the seam's function
        # dynamo calls for real and takes the result of as a constant: never a graph break (``seam.trace_choice``)
        name = trace_choice(spec.name, spec.bucket(problem), None if symbolic else problem.shape, problem.params,
                            DTYPE_NAMES[x.dtype], str(x.device), mode)
        return hot_fn(spec, spec.impls[name], x.device, mixed)(*args, **kwargs)
    sel = ask(spec, problem, x.dtype, x.device, mode, context)
    sel = Selection(hot_fn(spec, sel.impl, x.device, mixed), sel.impl, sel.record, sel.key)
    remember(key, sel)
    if context is Context.EAGER and ckey is not None:
        _hot[ckey] = sel.fn
    if context is Context.EAGER:
        prime_trace(spec, key[:-1], mixed, problem, x.dtype, x.device, mode)
    if context is Context.EAGER and capture.capturable(x.device):
        # an eager call (a user's warm-up before capturing): the graphed context's choice is called once too, on
        # this call's arguments (copies of them where a backward runs), so a capture of this call finds it compiled and
        # loaded for tensors of these very flavours
        graphed = ask(spec, problem, x.dtype, x.device, mode, Context.GRAPHED).impl
        capture.warm(spec, graphed, problem, x.dtype, x.device, mode, args, kwargs)
        out = sel.fn(*args, **kwargs)
        capture.mark_warm(spec, sel.impl, problem, x.dtype, x.device, mode, capture.flavor(args, kwargs))
        return out
    return sel.fn(*args, **kwargs)


def load_call_key(device: torch.device) -> threading.Thread | None:
    """Load the CUDA extension where it is built (its C++ call key serves the hot path from then on). Under
    background tuning a first call never waits for that (importing it and registering its ops takes 0.1-0.3 s on
    a GPU host): it loads on a thread of its own (returned) while the Python key serves; else here, at once."""
    if _decide.tuning_mode() != "background":
        cuda_ext.load_if_built(device)
        return None
    t = threading.Thread(target=cuda_ext.load_if_built, args=(device,), name="tiered_ops-load-extension", daemon=True)
    t.start()
    return t


def prime_trace(spec: OpSpec, signature: tuple, mixed: bool, problem: Problem, dtype: torch.dtype,
                device: torch.device, mode: str) -> None:
    """Cache the compiled context's selection of one call signature (``signature``: its key without the context),
    where it is decided, so that a later trace finds it: its guards are then one dict lookup per call site, not the
    slow path's reads. A trace caches nothing itself (see ``dispatch``). Called by an eager call's slow path and by
    ``tune`` for the signatures its step recorded.

    A trace reads the name of what it calls (``_traced``), then that function from one table (``trace_fn``): call
    sites of different signatures that run the same implementation reach it through one source, where reaching it
    through each signature's selection made dynamo add an aliasing guard that builds both keys in Python on every
    call of the compiled caller."""
    if routed(spec, mode, mixed):
        return  # a trace asks Inductor to choose (``inductor_choice``)
    key = signature + (1,)
    bucket = bucket_key(spec, problem, dtype, device, mode, mixed)  # what a trace with symbolic sizes reads
    primed = _traced.get(key)
    if key in _calls and primed is not None:
        _traced_buckets[bucket] = primed  # primed again after ``tune``'s clear
        return
    sel = ask(spec, problem, dtype, device, mode, Context.COMPILED)
    name = trace_fn(spec, sel.impl, device, mixed)
    remember(key, Selection(_TRACE_FNS[name], sel.impl, sel.record, sel.key))  # the table's function: hot_fn made it
    _traced[key] = name
    _traced_buckets[bucket] = name


# The per-call key read in C++ (``cuda_src/call_key.cpp``, part of the CUDA extension): ``_ckey(op, *args)`` gives
# one byte string of the call's signature (or None: the Python key decides), built without a Python object per
# tensor attribute; ``_cached(table, kwnames, op, *args)`` reads it, looks it up in ``table`` (key -> function) and
# calls what it finds, or returns the key (None where there is none); ``_fast`` gives a generated function that hot
# path as its C vectorcall, so a hit runs no Python frame of ours (dynamo traces the function's code). Used once the
# extension is loaded (it is never built for this); the generated functions' globals get them then (``use_call_key``).
_ckey: Callable[..., bytes | None] | None = None
_cached: Callable[..., Any] | None = None
_fast: Callable[..., bool] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class _Generated:
    """A generated per-call function: its globals (``_cached`` set there) and what its C fast path is given."""

    ns: dict[str, Any]
    fn: Callable[..., Any]
    table: dict | type  # a type: a method of that class (self._seen is the table)
    op: str
    params: tuple[str, ...]
    defaults: tuple
    kwnames: tuple[str, ...]

    def give_fast_path(self) -> None:
        if _fast is not None:
            _fast(self.fn, self.table, self.op, self.params, self.defaults, inspect.Parameter.empty, self.kwnames,
                  torch.compiler)


_GENERATED: list[_Generated] = []
_load_tried = False
_python_key = False  # the Python key asked for (use_call_key(None)): the extension's load keeps it


def _extension_loaded() -> None:
    if not _python_key:
        use_call_key(*(cuda_ext.pybind_function(n) for n in ("call_key", "call_cached", "fast_path")))


def use_call_key(key: Callable[..., bytes | None] | None, cached: Callable[..., Any] | None = None,
                 fast: Callable[..., bool] | None = None) -> None:
    """Key calls in C++ ahead of the Python key (``key`` and ``cached``: the extension's ``call_key`` and
    ``call_cached``; ``fast``: its ``fast_path``, None to keep each generated function's own frame), or with the
    Python key alone (None: also once the extension loads later). Selections cached under the C++ keys so far are
    dropped."""
    global _ckey, _cached, _python_key, _fast
    if (key is None) != (cached is None):
        raise ValueError("use_call_key: call_key and call_cached go together (both None: the Python key)")
    if cached is not None and not _traceable(cached):
        key = cached = None
    if _fast is not None:
        for g in _GENERATED:
            _fast(g.fn, None)
    _ckey, _cached, _python_key = key, cached, key is None
    _fast = fast if cached is not None and _FLAG else None
    for g in _GENERATED:
        g.ns["_cached"] = cached
        g.give_fast_path()
    _hot.clear()


def _generated(ns: dict[str, Any], fn: Callable[..., Any], table: dict | type, spec: OpSpec,
               kwnames: tuple[str, ...]) -> None:
    """Keep ``fn`` (generated in ``ns``: the op's parameters, after ``self`` where ``table`` is the class whose
    ``__call__`` it is) for
    ``use_call_key``, and give it the C fast path at once where the extension is loaded."""
    params = tuple(inspect.signature(spec.reference).parameters.values())
    g = _Generated(ns, fn, table, spec.name, tuple(p.name for p in params), tuple(p.default for p in params), kwnames)
    _GENERATED.append(g)
    g.give_fast_path()


_TRACEABLE: set[int] = set()


def _traceable(cached: Callable[..., Any]) -> bool:
    """Whether dynamo can trace through ``cached`` (a C function): it is told to read it as a call that finds
    nothing, so a traced call takes the Python key (context: compiled) without the hot path asking whether it is
    traced. False (logged) where torch cannot be told: the Python key alone then."""
    if id(cached) not in _TRACEABLE:
        try:
            torch.compiler.substitute_in_graph(cached, skip_signature_check=True)(lambda table, kw, op, *args: None)
        except (AttributeError, TypeError, ValueError, RuntimeError) as e:
            log.warning("the C++ call key is not used: dynamo cannot be told to trace through it (%s)", e)
            return False
        _TRACEABLE.add(id(cached))
    return True


_PUBLIC: dict[str, Callable[..., Any]] = {}
_PROBES: dict[str, Any] = {}  # the globals of every op's ``decomposes`` (make_public)
# Whether the current CUDA stream is capturing a graph: the C function itself where torch has CUDA (the hot path
# asks only for a CUDA tensor, whose device is initialized), torch's wrapper otherwise.
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
# Whether dynamo traces the call, as cheaply as it can be asked: ``torch.compiler.is_compiling()`` is
# ``torch.jit.is_scripting()`` (False outside TorchScript) and then the module's flag; dynamo folds
# ``is_dynamo_compiling()`` to True while it traces, and outside a trace the flag alone says what is_compiling says.
_DYNAMO = getattr(torch.compiler, "is_dynamo_compiling", None)
_FLAG = _DYNAMO is not None and isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool)
_COMPILING = "_dynamo() or _tc._is_compiling_flag" if _FLAG else "_compiling()"
# Where the C++ key is tried: not while dynamo traces (asked first: folded to True there, so the trace reads no flag
# and guards none; a torch whose dynamo sets the flag while tracing would otherwise guard it True and recompile at
# each call), nor while a trace runs the code for real (non-strict export).
_EAGER = "not _dynamo() and not _tc._is_compiling_flag" if _FLAG else "not _compiling()"


def public(name: str) -> Callable[..., Any]:
    """``tiered_ops.<name>``: the public function of a catalogued op, made once."""
    if name not in _PUBLIC:
        _PUBLIC[name] = make_public(get_op(name))
    return _PUBLIC[name]


def make_public(spec: OpSpec) -> Callable[..., Any]:
    """``tiered_ops.<op>``: the op's eager signature over the selected implementation, with a generated fast path."""
    g = op_signature(spec)
    names = list(inspect.signature(spec.reference).parameters)
    optional = tensor_args(spec)[1]
    req = " or ".join(f"{n}.requires_grad" if n not in optional else f"({n} is not None and {n}.requires_grad)"
                      for n in (names[i] for i in spec.grad_args))
    ns = dict(g.ns, _calls=_calls, _dispatch=dispatch, _traced_call=traced_call,
              _grad=torch.is_grad_enabled,
              _compiling=torch.compiler.is_compiling, _dynamo=_DYNAMO, _tc=torch.compiler, _capturing=_CAPTURING)
    # The key: (op, every tensor's shape and dtype, the first one's device index, the other arguments as
    # ``key_parts`` reads them, train, context), flat. ``train`` reads requires_grad only with grad mode on; the
    # context is 1 while dynamo traces, 2 inside a CUDA-graph capture (asked only for a CUDA tensor), else 0.
    # Where the C++ key is in use (an eager call, not traced), one C call reads it, looks it up and calls what is
    # cached under it (``_hot``); a miss returns the key (None: a capture, an argument it does not encode) and takes
    # the Python key, and an eager signature's function is cached under the C++ key read.
    src = f'''def {spec.name}({g.params}):
    ck = None
    if _cached is not None and {_EAGER}:
        ck = _cached(_hot, _KW, {spec.name!r}, {g.every})
        if ck.__class__ is not bytes and ck is not None:
            return ck
    try:
        _dev = {g.first}.get_device()
        key = ({spec.name!r}, {g.key}, _grad() and ({req}),
               1 if {_COMPILING} else 2 if _dev >= 0 and _capturing() else 0)
    except AttributeError:
        raise {g.not_tensors} from None
    if key[-1] == 1:
        try:
            _desc = ({describe(spec)},)
        except AttributeError:
            raise {g.not_tensors} from None
        return _traced_call(_SPEC, key, _desc, {g.slow})
    sel = _calls.get(key)
    if sel is None:
        return _dispatch(_SPEC, key, {g.first}, {g.slow}, key[-2], ck)
    if ck is not None and not key[-1]:
        _hot[ck] = sel.fn
    return sel.fn({g.call})
'''
    ns.update(_cached=_cached, _hot=_hot, _KW=g.kwnames)
    exec(compile(src, f"<tiered_ops.{spec.name}>", "exec"), ns)  # noqa: S102 (generated from the declaration)
    fn = ns[spec.name]
    # ``decomposes``: whether a trace of the call (its key, context 1) runs the op's plain torch decomposition. Every
    # op's in one namespace (its defaults bound when defined): a trace reading its globals guards them once, not per op
    probe = f'''def decomposes({g.params}):
    _dev = {g.first}.get_device()
    return _decomposes(({spec.name!r}, {g.key}, _grad() and ({req}), 1), ({describe(spec)},))
'''
    _PROBES.update(g.ns, _grad=torch.is_grad_enabled, _decomposes=traced_decomposes)
    exec(compile(probe, f"<tiered_ops.{spec.name}.decomposes>", "exec"), _PROBES)  # noqa: S102 (as above)
    fn.decomposes = _PROBES.pop("decomposes")
    fn.__module__, fn.__qualname__ = "tiered_ops", spec.name
    fn.__doc__ = (f"{spec.name}{inspect.signature(spec.reference)}: through the implementation selected for the "
                  "call's shapes, dtype, device, mode (training when grad is on and an input requires it), context.\n\n"
                  + (inspect.getdoc(inspect.getmodule(spec.reference)) or ""))
    fn.__source__ = src
    _generated(ns, fn, _hot, spec, g.kwnames)
    return fn


def traced_call(spec: OpSpec, key: tuple, described: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
    """A call of ``tiered_ops.<op>`` while dynamo traces it (context 1), from the generated function: what
    ``prime_trace`` cached for its signature (``_traced``: a guard on that key, so a signature primed later traces
    the caller again), else ``trace_plan``'s choice; symbolic sizes, and a call Inductor chooses for, go to
    ``dispatch``. One function for every op: what dynamo guards of it is shared by every call site."""
    if symbolic_key(key):
        return dispatch(spec, key, args[0], args, kwargs, key[-2], None)
    name = _traced.get(key)
    if name is not None:
        return _TRACE_FNS[name](*args, **kwargs)
    plan = trace_plan(key, described)
    if plan is None:
        return dispatch(spec, key, args[0], args, kwargs, key[-2], None)
    return hot_fn(spec, spec.impls[plan[0]], args[0].device, plan[1])(*args, **kwargs)


@assume_constant_result
def trace_plan(key: tuple, described: tuple) -> tuple[str, bool] | None:
    """What a trace of one call signature with static sizes and no primed selection (``prime_trace``) calls: the
    slow path of a compiled-context call (``dispatch``: contract, problem, decision), run for real at trace time on
    stand-ins of the call's tensors. Returns the name of the implementation in the op's table (``spec.impls``) and
    whether the call's dtypes are promoted (``hot_fn``'s ``mixed``), or None where Inductor is asked to choose
    (``routed``) or the call is refused: ``dispatch`` traces those calls, so a refused one raises as it did (an
    exception raised here would reach the caller as dynamo's internal error, also without ``fullgraph``).

    ``described``: the call's arguments in the reference's order, each tensor as (shape, dtype, device,
    requires_grad) and stood in for by a fake tensor of those (contiguous: the contract and the problem read no
    strides), the others as they are. Dynamo calls this for real (``torch.compiler.assume_constant_result``'s mark)
    and takes its result as a constant: nothing it reads becomes a guard, where tracing the slow path made a guard of
    every read of the op's declaration, its validation helpers and the call path's tables (each evaluated on every
    call of the compiled caller). A later publication reaches the next trace, as ``trace_choice``'s decision does; a
    selection primed later (an eager call) fails the trace's guard on ``_traced`` and the caller is traced again."""
    spec = get_op(key[0])
    args, kwargs = stand_ins(spec, described)
    x = args[0]
    try:
        problem = _admitted(spec, x, args, kwargs, values=False)  # stand-ins hold no values to check
        mixed = needs_promotion(spec, args, kwargs)
    except Exception:  # noqa: BLE001 (raised again where the caller sees it: dispatch, traced, as before)
        return None
    mode = "fwd+bwd" if key[-2] else "fwd_nograd"
    if routed(spec, mode, mixed):
        return None
    if active():
        note(spec, problem, x.dtype, mode, x.device, Context.COMPILED, (key[:-1], mixed))
    return trace_choice(spec.name, spec.bucket(problem), problem.shape, problem.params, DTYPE_NAMES[x.dtype],
                        str(x.device), mode), mixed


def traced_decomposes(key: tuple, described: tuple) -> bool:
    """``tiered_ops.<op>.decomposes`` while dynamo traces: whether a trace of the call (``key``: its key in context
    1) runs the op's plain torch decomposition (the eager or compile tier, no promotion), read as ``traced_call``
    reads it (a primed name: the same guard on ``_traced``, so a decision primed later traces the caller again; else
    ``trace_plan``'s constant). One function for every op: its guards are shared by every call site. Symbolic sizes:
    False (the op's own path)."""
    if symbolic_key(key):
        return False
    name = _traced.get(key)
    if name is not None:
        return decomposition(name)
    return plan_decomposes(key, described)


@assume_constant_result
def plan_decomposes(key: tuple, described: tuple) -> bool:
    """Whether ``trace_plan`` sends a trace of the call to the op's plain torch decomposition (``hot.DECOMPOSED``) with
    no promotion, which a patched module may trace in its original's own code instead (the same graph as stock's)."""
    plan = trace_plan(key, described)
    return plan is not None and plan[0] in DECOMPOSED and not plan[1]


def _admitted(spec: OpSpec, x: torch.Tensor, args: tuple, kwargs: dict[str, Any], values: bool = True) -> Problem:
    """A new call signature admitted (the contract, the declaration's value checks unless ``values`` is False, a
    selectable dtype: an error names the argument) and its problem; the slow path's first steps, eager and traced
    alike."""
    _contract(spec, args, kwargs)
    if values and spec.check_values is not None:
        spec.check_values(*args, **kwargs)
    _check_dtype(spec, x)
    return spec.problem_of(*args, **kwargs)


def _check_dtype(spec: OpSpec, x: torch.Tensor) -> None:
    if x.dtype not in DTYPE_NAMES:
        first = next(iter(inspect.signature(spec.reference).parameters))
        raise TypeError(f"tiered_ops.{spec.name}: {first} must be float32, bfloat16 or float16 (the dtypes its tiers "
                        f"are selected for), got {x.dtype}; float64 is the gate's reference: "
                        f"tiered_ops.get_op({spec.name!r}).reference takes it")


def _contract(spec: OpSpec, args: tuple, kwargs: dict[str, Any]) -> None:
    """The op's contract for a new call signature, on both per-call paths: every tensor argument a tensor, then the
    declaration's ``validate`` (an error names the argument)."""
    check_tensors(spec, args, kwargs)
    if spec.validate is not None:
        spec.validate(*args, **kwargs)


cuda_ext.on_load(_extension_loaded)
