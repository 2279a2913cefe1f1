"""The code an op's declaration gives the per-call path (``dispatch.py``): its parameter list, the Python key of a
call's signature, the call passed on, and the check that each tensor argument is a tensor."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..registry import OpSpec


def not_tensors(op: str, optional: tuple[str, ...] = (), **args: object) -> TypeError:
    """The error for a tensor argument of ``tiered_ops.<op>`` that is not a tensor (``None`` where ``optional``):
    the hot path reads ``.requires_grad`` of each and lands here on an AttributeError."""
    name, v = next((k, v) for k, v in args.items()
                   if not isinstance(v, torch.Tensor) and not (v is None and k in optional))
    return TypeError(f"{op}: argument '{name}' must be a torch.Tensor{' or None' if name in optional else ''}, "
                     f"got {type(v).__name__}")


_TENSOR_ARGS: dict[str, tuple[list[str], tuple[str, ...]]] = {}
_POSITIONAL: dict[str, list[str]] = {}


def tensor_args(spec: OpSpec) -> tuple[list[str], tuple[str, ...]]:
    """The names of ``spec``'s tensor arguments and of those among them that may be None."""
    if spec.name not in _TENSOR_ARGS:
        params = list(inspect.signature(spec.reference).parameters.values())
        _TENSOR_ARGS[spec.name] = ([p.name for p in params if is_tensor(p)],
                                   tuple(p.name for p in params if is_tensor(p) and "None" in str(p.annotation)))
        _POSITIONAL[spec.name] = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    return _TENSOR_ARGS[spec.name]


def check_tensors(spec: OpSpec, args: tuple, kwargs: dict[str, Any]) -> None:
    """A TypeError naming a tensor argument of the call that is not a tensor (nor None where it may be): the hot path
    reads no attribute that only a tensor has (an array with a shape and a dtype passes it)."""
    names, optional = tensor_args(spec)
    given = dict(zip(_POSITIONAL[spec.name], args)) | kwargs
    if any(not isinstance(given[k], torch.Tensor) and not (given[k] is None and k in optional) for k in names):
        raise not_tensors(spec.name, optional, **{k: given[k] for k in names})


def is_tensor(p: inspect.Parameter) -> bool:
    return "Tensor" in str(p.annotation)


def key_parts(p: inspect.Parameter, decisive: set[str]) -> list[str]:
    """The fast-path key's expressions for one argument (flat: no tuple is built per argument), all the slow path's
    validation and decision read of it (the slow path validates each key once): a tensor's shape and dtype (each
    False for an optional one left out), the value of an argument the op's problem takes (``decisive``; a sequence
    as a tuple), a dtype argument's value (validation checks which), and of the others (eps, ignore_index:
    validation checks their type) which kind of value each is."""
    n, ann = p.name, str(p.annotation)
    if is_tensor(p):
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
        # type(), not the __class__ attribute: tracing, torch 2.11's dynamo answers "not int" for an int's class (an
        # int dim then went to tuple(), which dynamo refuses: a graph break)
        return [f"{n} if type({n}) is tuple or type({n}) is int or {n} is None else tuple({n})"]
    return [n]


@dataclass
class Signature:
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
    kwnames: tuple[str, ...]


def op_signature(spec: OpSpec) -> Signature:
    params = list(inspect.signature(spec.reference).parameters.values())
    names = [p.name for p in params]
    first = names[0]
    if not is_tensor(params[0]):
        raise TypeError(f"{spec.name}: the first argument of its reference must be a tensor")
    optional = tuple(p.name for p in params if is_tensor(p) and "None" in str(p.annotation))
    tensors = [p.name for p in params if is_tensor(p)]
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
    parts = [f"{first}.shape", f"{first}.dtype", "_dev"] + [k for p in params[1:] for k in key_parts(p, decisive)]
    # keyword-only arguments (the reference's after ``*``) go on by name, to the slow path as its kwargs
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return Signature(ns, ", ".join(sig), ", ".join(parts), ", ".join(positional + [f"{k}={k}" for k in keywords]),
                      f"({', '.join(positional)},), {{{', '.join(f'{k!r}: {k}' for k in keywords)}}}",
                      f"_not_tensors({spec.name!r}, {optional!r}, {', '.join(f'{t}={t}' for t in tensors)})", first,
                      ", ".join(names), tuple(keywords))


def describe(spec: OpSpec) -> str:
    """Generated code: the call's arguments in the reference's order as constants a trace can pass to a function
    dynamo calls for real (``dispatch.trace_plan``): each tensor as (shape, dtype, device, requires_grad), None for
    an optional one left out; the others as they are."""
    tensors, optional = tensor_args(spec)

    def one(n: str) -> str:
        d = f"({n}.shape, {n}.dtype, {n}.device, {n}.requires_grad)"
        return f"None if {n} is None else {d}" if n in optional else d
    return ", ".join(one(p) if p in tensors else p for p in inspect.signature(spec.reference).parameters)


def stand_ins(spec: OpSpec, described: tuple) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) of a call ``describe`` described: each tensor a fake tensor of its shape, dtype, device and
    requires_grad, contiguous (the contract and the problem read no strides), made in the fake mode of the trace
    that runs (a fresh one outside a trace); the other arguments as they were."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    params = list(inspect.signature(spec.reference).parameters.values())
    values = []
    with detect_fake_mode() or FakeTensorMode():
        for p, d in zip(params, described):
            if is_tensor(p) and d is not None:
                shape, dtype, device, grad = d
                d = torch.empty(shape, dtype=dtype, device=device).requires_grad_(grad)
            values.append(d)
    kw = inspect.Parameter.KEYWORD_ONLY
    return (tuple(v for p, v in zip(params, values) if p.kind is not kw),
            {p.name: v for p, v in zip(params, values) if p.kind is kw})
