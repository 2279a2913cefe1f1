"""A module's forward swapped through its class: the module becomes an instance of a subclass of its own class whose
``forward`` is the replacement (one subclass per class and replacement, named as the class), and ``unswap`` gives it
its class back.

Why a subclass and not a forward on the instance: torch.compile guards what a traced call reads, and a forward held
by each instance is read (and guarded: the function, its arguments) per module, on every call of a compiled model;
a class's forward is guarded once per class. Everything else of the module stays: its parameters, buffers,
state_dict keys, hooks, ``isinstance`` and its class's name; a deepcopy or a pickled copy stays swapped (the subclass
pickles as its class and replacement, both found by name).

A replacement that needs something of the class it swaps (the class's own forward, a forward made from it) is a
maker (``per_class``): called once with the class, it returns the forward, which holds what it needs in its closure.
Under torch.compile that is a constant of the class, read once per class; a forward asking ``type(self)`` for it
makes dynamo guard each module's class against the first module's (one guard per module, evaluated on every call of
the compiled model: per decoder layer, one per patched module that asks).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

_BASE = "_tiered_ops_base"  # class attribute of a swapped class: the class it swaps
_REPLACEMENT = "_tiered_ops_replacement"  # class attribute of a swapped class: its replacement (a maker or a forward)
_MAKES = "_tiered_ops_makes"  # function attribute of a maker (``per_class``)
_CLASSES: dict[tuple[type, Callable[..., Any]], type] = {}


def original_class(m: nn.Module) -> type:
    """The class ``m`` had before it was swapped (its class where it is not)."""
    return type(m).__dict__.get(_BASE, type(m))


def own_forward(m: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``m``'s forward as its class had it before the swap (a patched module's original code; no hook, no op of
    ours unless that code calls one)."""
    # original_class(m), inlined and its key spelled out: under torch.compile each function called and each global
    # read is a guard evaluated on every call of the compiled model
    cls = type(m)
    return cls.__dict__.get("_tiered_ops_base", cls).forward(m, *args, **kwargs)


def per_class(make: Callable[[type], Callable[..., Any]]) -> Callable[[type], Callable[..., Any]]:
    """Mark ``make`` a maker: a replacement that ``swapped_class`` calls once with the class it swaps, for the
    forward (which may raise a RuntimeError: the class can no longer be rewritten)."""
    setattr(make, _MAKES, True)
    return make


def swapped_class(base: type, forward: Callable[..., Any]) -> type:
    """The subclass of ``base`` whose forward is ``forward`` (or what ``forward`` makes of ``base``, for a maker:
    ``per_class``), made once."""
    key = (base, forward)
    if key not in _CLASSES:
        made = forward(base) if getattr(forward, _MAKES, False) else forward
        _CLASSES[key] = type(base.__name__, (base,), {
            "forward": made, _BASE: base, _REPLACEMENT: forward, "__reduce_ex__": _reduce_ex,
            "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__doc__": f"{base.__qualname__} whose forward is {forward.__module__}.{forward.__qualname__} "
                       "(tiered_ops.patch; tiered_ops.unpatch gives the module its class back)"})
    return _CLASSES[key]


def swap(m: nn.Module, forward: Callable[..., Any]) -> None:
    m.__class__ = swapped_class(original_class(m), forward)


def unswap(m: nn.Module) -> None:
    """Give ``m`` its class back (nothing changes where it was not swapped)."""
    m.__class__ = original_class(m)


def _rebuild(base: type, forward: Callable[..., Any]) -> nn.Module:
    m = base.__new__(base)
    m.__class__ = swapped_class(base, forward)
    return m


def _reduce_ex(self: nn.Module, protocol: int) -> tuple:
    # pickle and deepcopy: the subclass is made at runtime (no name finds it), so a copy is rebuilt from the class and
    # the replacement (module-level functions), then given the state (nn.Module.__setstate__)
    cls = type(self)
    return _rebuild, (cls.__dict__[_BASE], cls.__dict__[_REPLACEMENT]), self.__dict__
