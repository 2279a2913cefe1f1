"""The per-call path of ``tiered_ops.<op>``: the public functions, made from each op's declaration, and the slow
path that resolves a call signature's selection once.

Each public function is generated from its op's eager signature (like ``dataclasses`` makes ``__init__``): its
fast path reads ``requires_grad`` of each tensor argument, builds a key of every tensor's shape and dtype, the
first tensor's device, the other arguments and whether the call trains, and calls the cached selection; a miss
goes to ``dispatch``. Generated code keeps the hot path as short as a hand-written one.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..registry import CONTEXTS, DTYPE_NAMES, OPS, Impl, OpSpec, needs_promotion, run_promoted
from ..store.store import STORE_ERRORS
from ..tiers import cuda_ext
from ..tiers.catalog import get_op
from . import capture
from . import decide as _decide
from .decide import Selection, _as_dtype, _calls, get_store, select_problem
from .record import active, note

log = logging.getLogger(__name__)


def not_tensors(op: str, optional: tuple[str, ...] = (), **args: object) -> TypeError:
    """The error for a tensor argument of ``tiered_ops.<op>`` that is not a tensor (``None`` where ``optional``):
    the hot path reads ``.requires_grad`` of each and lands here on an AttributeError."""
    name, v = next((k, v) for k, v in args.items()
                   if not isinstance(v, torch.Tensor) and not (v is None and k in optional))
    return TypeError(f"{op}: argument '{name}' must be a torch.Tensor{' or None' if name in optional else ''}, "
                     f"got {type(v).__name__}")


def dispatch(spec: OpSpec, key: tuple, x: torch.Tensor, args: tuple, kwargs: dict[str, Any],
             train: bool = False, ckey: bytes | None = None) -> torch.Tensor:
    """Slow path of ``tiered_ops.<op>``: resolve the call's selection, cache it by exact signature.

    ``train`` picks the fwd+bwd decision, else the fwd_nograd one; the key's last element is the caller's context
    (an index into ``registry.CONTEXTS``: 0 eager, 1 traced by torch.compile, 2 inside CUDA-graph capture). ``ckey``:
    the call's C++ key where one was read (the selection is cached under it too)."""
    _contract(spec, args, kwargs)  # once per call signature (the key holds what it reads)
    if spec.check_values is not None:
        spec.check_values(*args, **kwargs)
    if x.dtype not in DTYPE_NAMES:
        first = next(iter(inspect.signature(spec.reference).parameters))
        raise TypeError(f"tiered_ops.{spec.name}: {first} must be float32, bfloat16 or float16 (the dtypes its tiers "
                        f"are selected for), got {x.dtype}; float64 is the gate's reference: "
                        f"tiered_ops.get_op({spec.name!r}).reference takes it")
    problem = spec.problem_of(*args, **kwargs)
    mode = "fwd+bwd" if train else "fwd_nograd"
    global _load_tried
    if _ckey is None and key[-1] == 0 and x.is_cuda and not _load_tried and not _python_key:
        _load_tried = True  # once per process: the C++ key, where the CUDA extension is built already
        cuda_ext.load_if_built(x.device)
    if active():
        note(spec, problem, x.dtype, mode, x.device, CONTEXTS[key[-1]])
    if key[-1] == 2:  # inside CUDA-graph capture: never measure, compile or sync here; not cached (a later
        # capture may find the graphed decision warm)
        return _decide.capture_selection(spec, problem, _as_dtype(x.dtype), x.device, mode,
                                         capture.flavor(args, kwargs)).fn(*args, **kwargs)
    # no store to measure into: eager (tuning off, nothing stored); a store failing now: eager, said once. While
    # dynamo traces, the store is not looked at (its lock would break the graph): a decision made before is read.
    unusable = not torch.compiler.is_compiling() and get_store().unusable
    try:
        sel = select_problem(spec, problem, _as_dtype(x.dtype), x.device, tune=False if unusable else None,
                             mode=mode, context=CONTEXTS[key[-1]], warm_graphed=False)
    except STORE_ERRORS as e:
        log.warning("tiered_ops.%s: the store failed while deciding (%s); eager for this call signature", spec.name, e)
        eager = spec.impls["eager"]
        sel = Selection(eager.fn, eager, dict(op=spec.name, problem=str(problem), chosen=eager.name, tier="eager",
                                              reason=f"the store failed: {e}: eager", candidates=[]))
    sel = Selection(hot_fn(spec, sel.impl, x.device, needs_promotion(spec, args, kwargs)), sel.impl, sel.record)
    if len(_calls) > 4096:
        _calls.clear()
    _calls[key] = sel
    if key[-1] == 0 and ckey is not None:
        _calls[ckey] = sel
    if key[-1] == 0:
        # The compiled context's selection of this signature is cached now too: a trace that found the key missing
        # would guard on its absence, and its own miss (which caches it) would fail that guard: a recompile.
        compiled = key[:-1] + (1,)
        if compiled not in _calls:
            try:
                _calls[compiled] = select_problem(spec, problem, _as_dtype(x.dtype), x.device, tune=False, mode=mode,
                                                  context="compiled", warm_graphed=False)
            except STORE_ERRORS:
                pass  # the trace decides it then
    if key[-1] == 0 and capture.capturable(x.device):
        # an eager call (a user's warm-up before capturing): the graphed context's choice is called once too, on
        # this call's arguments (copies of them where a backward runs), so a capture of this call finds it compiled and
        # loaded for tensors of these very flavours
        try:
            graphed = select_problem(spec, problem, _as_dtype(x.dtype), x.device, tune=False, mode=mode,
                                     context="graphed", warm_graphed=False).impl
        except STORE_ERRORS:
            graphed = spec.impls["eager"]  # what a capture then runs: always warm
        capture.warm(spec, graphed, problem, _as_dtype(x.dtype), x.device, mode, args, kwargs)
        out = sel.fn(*args, **kwargs)
        capture.mark_warm(spec, sel.impl, problem, _as_dtype(x.dtype), x.device, mode, capture.flavor(args, kwargs))
        return out
    return sel.fn(*args, **kwargs)


_TENSOR_ARGS: dict[str, tuple[list[str], tuple[str, ...]]] = {}
_POSITIONAL: dict[str, list[str]] = {}


def _tensor_args(spec: OpSpec) -> tuple[list[str], tuple[str, ...]]:
    """The names of ``spec``'s tensor arguments and of those among them that may be None."""
    if spec.name not in _TENSOR_ARGS:
        params = list(inspect.signature(spec.reference).parameters.values())
        _TENSOR_ARGS[spec.name] = ([p.name for p in params if _is_tensor(p)],
                                   tuple(p.name for p in params if _is_tensor(p) and "None" in str(p.annotation)))
        _POSITIONAL[spec.name] = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    return _TENSOR_ARGS[spec.name]


def _check_tensors(spec: OpSpec, args: tuple, kwargs: dict[str, Any]) -> None:
    """A TypeError naming a tensor argument of the call that is not a tensor (nor None where it may be): the hot path
    reads no attribute that only a tensor has (an array with a shape and a dtype passes it)."""
    names, optional = _tensor_args(spec)
    given = dict(zip(_POSITIONAL[spec.name], args)) | kwargs
    if any(not isinstance(given[k], torch.Tensor) and not (given[k] is None and k in optional) for k in names):
        raise not_tensors(spec.name, optional, **{k: given[k] for k in names})


def hot_fn(spec: OpSpec, impl: Impl, device: torch.device, mixed: bool) -> Callable[..., Any]:
    """What the hot path of ``tiered_ops.<op>`` calls for one call signature, validated on the slow path: the tier
    alone (``impl.unchecked``), and only what the key cannot hold on every call: the data checks where they cost no
    sync (``spec.check_values``, CPU tensors), a mix of floating dtypes promoted as torch does (``run_promoted``)."""
    fn = impl.unchecked
    if fn is None:
        return impl.fn
    values = spec.check_values if device.type == "cpu" else None
    if mixed:
        def promoted(*args: Any, **kwargs: Any) -> Any:
            if values is not None:
                values(*args, **kwargs)
            return run_promoted(spec, fn, args, kwargs)
        return promoted
    if values is not None:
        def checked_values(*args: Any, **kwargs: Any) -> Any:
            values(*args, **kwargs)
            return fn(*args, **kwargs)
        return checked_values
    return fn


def _is_tensor(p: inspect.Parameter) -> bool:
    return "Tensor" in str(p.annotation)


def _key_parts(p: inspect.Parameter, decisive: set[str]) -> list[str]:
    """The fast-path key's expressions for one argument (flat: no tuple is built per argument), all the slow path's
    validation and decision read of it (the slow path validates each key once): a tensor's shape and dtype (each
    False for an optional one left out), the value of an argument the op's problem takes (``decisive``; a sequence
    as a tuple), a dtype argument's value (validation checks which), and of the others (eps, ignore_index:
    validation checks their type) which kind of value each is."""
    n, ann = p.name, str(p.annotation)
    if _is_tensor(p):
        if "None" in ann:
            return [f"{n} is not None and {n}.shape", f"{n} is not None and {n}.dtype"]
        return [f"{n}.shape", f"{n}.dtype"]
    if "torch.dtype" in ann:
        return [n]
    if n not in decisive:
        # which kind of value it is (None, a bool, a number, else another type that validation refuses, so that a
        # key with all three False is never cached): bools, not its class or the class's name, which dynamo's
        # lookup of a key cannot hash or match in every torch version
        return [f"{n} is None", f"isinstance({n}, bool)", f"isinstance({n}, (int, float))"]
    if "Sequence" in ann or "list" in ann:
        return [f"{n} if {n}.__class__ is tuple or {n}.__class__ is int or {n} is None else tuple({n})"]
    return [n]


@dataclass
class _Signature:
    """The pieces of generated code an op's declaration gives: its parameter list, the key of a call's signature,
    the call passed on, the slow path's (args, kwargs), the tensor arguments' type check."""

    ns: dict[str, Any]
    params: str
    key: str
    call: str
    slow: str
    not_tensors: str
    first: str
    every: str


def _signature(spec: OpSpec) -> _Signature:
    params = list(inspect.signature(spec.reference).parameters.values())
    names = [p.name for p in params]
    first = names[0]
    if not _is_tensor(params[0]):
        raise TypeError(f"{spec.name}: the first argument of its reference must be a tensor")
    optional = tuple(p.name for p in params if _is_tensor(p) and "None" in str(p.annotation))
    tensors = [p.name for p in params if _is_tensor(p)]
    ns: dict[str, Any] = dict(_not_tensors=not_tensors, _SPEC=spec)
    sig = []
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in sig:
            sig.append("*")
        if p.default is inspect.Parameter.empty:
            sig.append(p.name)
        else:
            ns[f"_D{i}"] = p.default
            sig.append(f"{p.name}=_D{i}")
    decisive = set(list(inspect.signature(spec.problem).parameters)[1:])
    parts = [f"{first}.shape", f"{first}.dtype", "_dev"] + [k for p in params[1:] for k in _key_parts(p, decisive)]
    # keyword-only arguments (the reference's after ``*``) go on by name, to the slow path as its kwargs
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return _Signature(ns, ", ".join(sig), ", ".join(parts), ", ".join(positional + [f"{k}={k}" for k in keywords]),
                      f"({', '.join(positional)},), {{{', '.join(f'{k!r}: {k}' for k in keywords)}}}",
                      f"_not_tensors({spec.name!r}, {optional!r}, {', '.join(f'{t}={t}' for t in tensors)})", first,
                      ", ".join(names))


# The per-call key read in C++ (``cuda_src/call_key.cpp``, part of the CUDA extension): ``_ckey(op, *args)`` gives
# one byte string of the call's signature (or None: the Python key decides), built without a Python object per
# tensor attribute. Used once the extension is loaded (it is never built for this); the generated functions' globals
# get it then (``use_call_key``).
_ckey: Callable[..., bytes | None] | None = None
_NAMESPACES: list[dict[str, Any]] = []
_load_tried = False
_python_key = False  # the Python key asked for (use_call_key(None)): the extension's load keeps it


def _extension_loaded() -> None:
    if not _python_key:
        use_call_key(cuda_ext.pybind_function("call_key"))


def use_call_key(fn: Callable[..., bytes | None] | None) -> None:
    """Key calls with ``fn`` (the extension's ``call_key``) ahead of the Python key, or with the Python key alone
    (None: also once the extension loads later). Selections cached under the C++ keys so far are dropped."""
    global _ckey, _python_key
    _ckey, _python_key = fn, fn is None
    for ns in _NAMESPACES:
        ns["_ckey"] = fn
    for k in [k for k in _calls if isinstance(k, bytes)]:
        _calls.pop(k, None)


_PUBLIC: dict[str, Callable[..., Any]] = {}
# Whether the current CUDA stream is capturing a graph: the C function itself where torch has CUDA (the hot path
# asks only for a CUDA tensor, whose device is initialized), torch's wrapper otherwise.
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
# Whether dynamo traces the call, as cheaply as it can be asked: ``torch.compiler.is_compiling()`` is
# ``torch.jit.is_scripting()`` (False outside TorchScript) and then the module's flag; dynamo folds
# ``is_dynamo_compiling()`` to True while it traces, and outside a trace the flag alone says what is_compiling says.
_DYNAMO = getattr(torch.compiler, "is_dynamo_compiling", None)
_COMPILING = ("_dynamo() or _tc._is_compiling_flag" if _DYNAMO is not None and
              isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool) else "_compiling()")


def public(name: str) -> Callable[..., Any]:
    """``tiered_ops.<name>``: the public function of a catalogued op, made once."""
    if name not in _PUBLIC:
        _PUBLIC[name] = make_public(get_op(name))
    return _PUBLIC[name]


def make_public(spec: OpSpec) -> Callable[..., Any]:
    """``tiered_ops.<op>``: the op's eager signature over the selected implementation, with a generated fast path."""
    g = _signature(spec)
    names = list(inspect.signature(spec.reference).parameters)
    optional = _tensor_args(spec)[1]
    req = " or ".join(f"{n}.requires_grad" if n not in optional else f"({n} is not None and {n}.requires_grad)"
                      for n in (names[i] for i in spec.grad_args))
    ns = dict(g.ns, _calls=_calls, _dispatch=dispatch, _grad=torch.is_grad_enabled,
              _compiling=torch.compiler.is_compiling, _dynamo=_DYNAMO, _tc=torch.compiler, _capturing=_CAPTURING)
    # The key: (op, every tensor's shape and dtype, the first one's device index, the other arguments as
    # ``_key_parts`` reads them, train, context), flat. ``train`` reads requires_grad only with grad mode on; the
    # context is 1 while dynamo traces, 2 inside a CUDA-graph capture (asked only for a CUDA tensor), else 0.
    # Where the C++ key is in use (an eager call, not traced), it is read once and tried first; a miss (or None: a
    # capture, an argument it does not encode) takes the Python key, and an eager signature's selection is cached
    # under the C++ key read.
    src = f'''def {spec.name}({g.params}):
    ck = None
    if _ckey is not None and not ({_COMPILING}):
        ck = _ckey({spec.name!r}, {g.every})
        sel = _calls.get(ck)
        if sel is not None:
            return sel.fn({g.call})
    try:
        _dev = {g.first}.get_device()
        key = ({spec.name!r}, {g.key}, _grad() and ({req}),
               1 if {_COMPILING} else 2 if _dev >= 0 and _capturing() else 0)
    except AttributeError:
        raise {g.not_tensors} from None
    sel = _calls.get(key)
    if sel is None:
        return _dispatch(_SPEC, key, {g.first}, {g.slow}, key[-2], ck)
    if ck is not None and not key[-1]:
        _calls[ck] = sel
    return sel.fn({g.call})
'''
    ns.update(_ckey=_ckey)
    _NAMESPACES.append(ns)
    exec(compile(src, f"<tiered_ops.{spec.name}>", "exec"), ns)  # noqa: S102 (generated from the declaration)
    fn = ns[spec.name]
    fn.__module__, fn.__qualname__ = "tiered_ops", spec.name
    fn.__doc__ = (f"{spec.name}{inspect.signature(spec.reference)}: through the implementation selected for the "
                  "call's shapes, dtype, device, mode (training when grad is on and an input requires it), context.\n\n"
                  + (inspect.getdoc(inspect.getmodule(spec.reference)) or ""))
    fn.__source__ = src
    return fn


_BINDERS: dict[tuple[str, int], tuple[OpSpec, Callable[..., Callable[..., Any]]]] = {}


def bind_selection(sel: Selection) -> Callable[..., Any]:
    """What calling ``sel`` (a ``select_backend`` result) runs: the op's signature over its implementation, which
    validates each distinct call signature once (the key of ``tiered_ops.<op>`` without train and context) and then
    calls the implementation unchecked (``hot_fn``), as ``tiered_ops.<op>`` does; ``sel.fn`` where the selection
    is of no catalogued op."""
    op = sel.record.get("op")
    spec = get_op(op) if isinstance(op, str) and op in OPS else None
    if spec is None or spec.impls.get(sel.impl.name) is not sel.impl:
        return sel.fn
    if (op, id(spec)) not in _BINDERS:
        g = _signature(spec)
        src = f'''def _bind(_impl, _checked, _seen):
    def {spec.name}({g.params}):
        if _dynamo():  # traced: the selection's own fn (checked), as before it was bound
            return _checked({g.call})
        if _ckey is None or (key := _ckey({spec.name!r}, {g.every})) is None:
            try:
                _dev = {g.first}.get_device()
                key = ({g.key})
            except AttributeError:
                raise {g.not_tensors} from None
        fn = _seen.get(key)
        if fn is None:
            fn = _admit(_SPEC, _impl, _seen, key, {g.first}, {g.slow})
        return fn({g.call})
    return {spec.name}
'''
        ns = dict(g.ns, _admit=_admit, _dynamo=_DYNAMO or torch.compiler.is_compiling, _ckey=_ckey)
        _NAMESPACES.append(ns)
        exec(compile(src, f"<tiered_ops.select_backend.{spec.name}>", "exec"), ns)  # noqa: S102 (see make_public)
        ns["_bind"].__source__ = src
        _BINDERS[op, id(spec)] = (spec, ns["_bind"])  # the spec kept: its id stays its own
    fn = _BINDERS[op, id(spec)][1](sel.impl, sel.fn, {})
    fn.__qualname__ = f"Selection.{spec.name}"
    return fn


def _contract(spec: OpSpec, args: tuple, kwargs: dict[str, Any]) -> None:
    """The op's contract for a new call signature, on both per-call paths: every tensor argument a tensor, then the
    declaration's ``validate`` (an error names the argument)."""
    _check_tensors(spec, args, kwargs)
    if spec.validate is not None:
        spec.validate(*args, **kwargs)


def _admit(spec: OpSpec, impl: Impl, seen: dict[tuple, Callable[..., Any]], key: tuple, x: torch.Tensor,
           args: tuple, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """A selection's first call of a signature: the op's contract checked (an error names the argument), then what
    this signature runs (``hot_fn``) kept for the next calls of it."""
    _contract(spec, args, kwargs)
    fn = hot_fn(spec, impl, x.device, needs_promotion(spec, args, kwargs))
    if len(seen) > 4096:
        seen.clear()
    seen[key] = fn
    return fn


Selection.bind = bind_selection
cuda_ext.on_load(_extension_loaded)
