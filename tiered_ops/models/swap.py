"""A module's forward swapped through its class: the module becomes an instance of a subclass of its own class whose
``forward`` is the replacement (one subclass per class and replacement, named as the class), and ``unswap`` gives it
its class back.

Why a subclass and not a forward on the instance: torch.compile guards what a traced call reads, and a forward held
by each instance is read (and guarded: the function, its arguments) per module, on every call of a compiled model;
a class's forward is guarded once per class. Everything else of the module stays: its parameters, buffers,
state_dict keys, hooks, ``isinstance`` and its class's name; a deepcopy or a pickled copy stays swapped (the subclass
pickles as its class and replacement, both found by name).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

_BASE = "_tiered_ops_base"  # class attribute of a swapped class: the class it swaps
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


def swapped_class(base: type, forward: Callable[..., Any]) -> type:
    """The subclass of ``base`` whose forward is ``forward``, made once."""
    key = (base, forward)
    if key not in _CLASSES:
        _CLASSES[key] = type(base.__name__, (base,), {
            "forward": forward, _BASE: base, "__reduce_ex__": _reduce_ex,
            "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__doc__": f"{base.__qualname__} whose forward is {forward.__module__}.{forward.__qualname__} "
                       "(tiered_ops.patch; tiered_ops.unpatch gives the module its class back)"})
    return _CLASSES[key]


def install_routed(swapped: type, attr: str, routed: Callable[[type], Callable[..., Any] | str]) -> Callable[..., Any]:
    """The forward ``routed`` makes from ``swapped``'s base class (or why it cannot: then a RuntimeError), kept on
    ``swapped`` as ``attr``: for a rewrite whose swapped forward runs a forward made per class (and made again for a
    class rebuilt by pickle in another process)."""
    made = routed(swapped.__dict__.get(_BASE, swapped))
    if isinstance(made, str):
        raise RuntimeError(f"tiered_ops.patch: {swapped.__qualname__} can no longer be routed: {made}")
    setattr(swapped, attr, made)
    return made


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
    return _rebuild, (cls.__dict__[_BASE], cls.__dict__["forward"]), self.__dict__
