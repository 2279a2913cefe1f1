"""``tiered_ops.select_backend``: the tuner's selection (``decide.select_backend``), returned as a callable of the op's
own signature that validates each distinct call signature once and then calls the implementation unchecked, as
``tiered_ops.<op>`` does.

The callable is an instance of a class made once per op from its declaration (``bound_class``), whose ``__call__``
is generated like the public function's (``dispatch.make_public``) and gets the same C fast path where the CUDA
extension is loaded. The tuner's own ``Selection`` stays a plain record: the binding happens here, in the call path,
and one callable is kept per decision of the table (``_bound``, derived from the table).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch

from ..decide import decide as _decide
from ..decide import table
from ..decide.decide import Selection
from ..decide.signature import op_signature
from ..registry import OPS, Impl, OpSpec, needs_promotion
from ..tiers.catalog import get_op
from . import dispatch
from .hot import hot_fn

_BINDERS: dict[tuple[str, int], tuple[OpSpec, type]] = {}
# id of a table's Selection -> (it, its callable): the same callable for every select_backend of one decision
_bound: dict[int, tuple[Selection, Selection]] = table.derived(value=operator.itemgetter(0))


@functools.wraps(_decide.select_backend)
def select_backend(*args: Any, **kwargs: Any) -> Selection:
    sel = _decide.select_backend(*args, **kwargs)
    hit = _bound.get(id(sel))
    if hit is not None and hit[0] is sel:
        return hit[1]
    return bind(sel)


def bind(sel: Selection) -> Selection:
    """``sel`` as the callable of its op's signature (``bound_class``); ``sel`` itself where it is of no catalogued
    op, or while dynamo traces (its ``fn`` is called then)."""
    cls = bound_class(sel) if isinstance(sel, Selection) and not torch.compiler.is_compiling() else None
    if cls is None:
        return sel
    made = cls(sel.fn, sel.impl, sel.record, sel.key)
    if sel.key is None or table.current().get(sel.key) is sel:  # the table's decision, or one of another policy
        table.put(_bound, id(sel), (sel, made))
    return made


def bound_class(sel: Selection) -> type | None:
    """The class of a ``select_backend`` callable of ``sel``'s op, whose ``__call__`` is the op's signature over the
    selection's implementation: it validates each distinct call signature once (the key of ``tiered_ops.<op>``
    without train and context; ``self._seen`` keeps what each runs) and then calls the implementation unchecked
    (``hot_fn``), as ``tiered_ops.<op>`` does. None where the selection is of no catalogued op (its ``fn`` is
    called)."""
    op = sel.record.get("op")
    spec = get_op(op) if isinstance(op, str) and op in OPS else None
    if spec is None or spec.impls.get(sel.impl.name) is not sel.impl:
        return None
    if (op, id(spec)) not in _BINDERS:
        g = op_signature(spec)
        # a method of the class (no frame but its own); traced, the selection's own fn (checked) as before binding
        src = f'''def __call__(self, {g.params}):
    key = None if _cached is None else _cached(self._seen, _KW, {spec.name!r}, {g.every})
    if key.__class__ is not bytes:
        if key is not None:
            return key
        if _dynamo():
            return self.fn({g.call})
        try:
            _dev = {g.first}.get_device()
            key = ({g.key})
        except AttributeError:
            raise {g.not_tensors} from None
    fn = self._seen.get(key)
    if fn is None:
        fn = _admit(_SPEC, self.impl, self._seen, key, {g.first}, {g.slow})
    return fn({g.call})
'''
        ns = dict(g.ns, _admit=_admit, _dynamo=dispatch._DYNAMO or torch.compiler.is_compiling,
                  _cached=dispatch._cached, _KW=g.kwnames)
        exec(compile(src, f"<tiered_ops.select_backend.{spec.name}>", "exec"), ns)  # noqa: S102 (see make_public)
        call = ns["__call__"]
        call.__source__, call.__qualname__ = src, f"Selection.{spec.name}.__call__"
        cls = type("Selection", (Selection,), dict(__call__=call, __init__=_init, __module__=__name__))
        dispatch._generated(ns, call, cls, spec, g.kwnames)
        _BINDERS[op, id(spec)] = (spec, cls)
    return _BINDERS[op, id(spec)][1]


def _init(self: Selection, *args: Any, **kwargs: Any) -> None:
    Selection.__init__(self, *args, **kwargs)
    self._seen = {}  # the callable's own table of call signatures


def _admit(spec: OpSpec, impl: Impl, seen: dict[tuple, Callable[..., Any]], key: tuple, x: torch.Tensor,
           args: tuple, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """A selection's first call of a signature: the op's contract checked (an error names the argument), then what
    this signature runs (``hot_fn``) kept for the next calls of it."""
    dispatch._contract(spec, args, kwargs)
    fn = hot_fn(spec, impl, x.device, needs_promotion(spec, args, kwargs))
    table.put(seen, key, fn)
    return fn
