"""The eager fast path of a kernel tier: the op's Python signature straight onto its launcher, no dispatcher.

A registered kernel op (``torch.library.triton_op`` / ``TORCH_LIBRARY``) is what torch.compile traces, and an eager
call of it pays the dispatcher, the custom op's Python wrapper and the autograd kernel of ``register_autograd`` on
every call. :func:`fast_callable` gives the same computation for eager callers: with no input requiring grad (or
grad mode off) it calls the forward launcher directly; otherwise it goes through one ``torch.autograd.Function``
whose forward calls the launcher and runs the op's own ``setup_context`` and whose backward is the op's own
``backward_for(bwd)`` (the functions ``spec.autograd`` registers with ``torch.library.register_autograd``, called as
that registration calls them). Triton tier: fwd/bwd are ``triton_src.<op>.<op>_fast`` / ``<op>_bwd_fast``; CUDA
tier: the extension's pybind11 functions ``<op>_cuda`` / ``<op>_bwd_cuda``.

Only for callers that are not traced: under torch.compile or a functorch transform the wrapper calls ``fallback``
(the registered op) when one is given.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import cuda_ext

_C = torch._C
# The C++ apply of autograd.Function, without the Python classmethod's functorch handling (which the fallback
# serves) and its binding of default arguments (the Function here defines no setup_context of its own).
_APPLY = _C._FunctionBase.__dict__["apply"]


def _function(name: str, fwd: Callable[..., Any], bwd: Callable[..., Any], setup_context: Callable[..., None],
              backward_for: Callable[[Callable[..., Any]], Callable[..., Any]], several_outputs: bool) -> type:
    def forward(ctx: Any, *args: Any) -> Any:
        out = fwd(*args)
        if several_outputs:
            # Outputs no gradient reached (statistics the op marks non-differentiable, an output the caller did not
            # use) get None rather than zeros filled on every backward: the op's backward takes None for them.
            ctx.set_materialize_grads(False)
        setup_context(ctx, args, out)
        return out

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward_for(bwd))})


def fast_callable(fwd: Callable[..., Any], bwd: Callable[..., Any], setup_context: Callable[..., None],
                  backward_for: Callable[[Callable[..., Any]], Callable[..., Any]], kernel_args: Callable[..., tuple],
                  first_output: bool = False, fallback: Callable[..., Any] | None = None, name: str = "FastOp",
                  fwd_infer: Callable[..., Any] | None = None, outputs: int = 1) -> Callable[..., Any]:
    """A function with the op's Python signature (``kernel_args`` maps it onto fwd's arguments) that launches
    ``fwd`` directly when no gradient is needed and otherwise goes through one autograd.Function built from the op's
    ``setup_context`` and ``backward_for(bwd)``. ``first_output``: fwd returns (outputs..., statistics...) and the op
    returns its ``outputs`` leading ones (output 0 alone when ``outputs`` is 1, else a tuple); every one of them
    carries its gradient (the op's ``setup_context`` marks the statistics non-differentiable, and its backward gets
    None for an output that no gradient reached). ``fallback`` (the registered op with the same signature) serves
    traced calls. ``fwd_infer``: a launcher with fwd's arguments that returns the op's output(s) alone, used where no
    gradient is needed (it may skip what only the backward reads).

    The returned function's ``forward_only`` attribute is the direct launch alone, for a caller that has already
    decided that no gradient is needed (no input requires grad, or grad mode is off) and is not traced."""
    if outputs < 1:
        raise ValueError(f"fast_callable: outputs must be at least 1, got {outputs}")
    fn = _function(name, fwd, bwd, setup_context, backward_for, first_output)
    apply = _APPLY.__get__(None, fn)
    grad_enabled, any_requires_grad = _C.is_grad_enabled, _C._any_requires_grad
    transforms_active, compiling = _C._are_functorch_transforms_active, torch.compiler.is_compiling

    if not first_output:
        def pick(out: Any) -> Any:
            return out
    elif outputs == 1:
        def pick(out: Any) -> Any:
            return out[0]
    else:
        def pick(out: Any) -> Any:
            return tuple(out[:outputs])
    if fwd_infer is None:
        fwd_infer = (lambda *args: pick(fwd(*args))) if first_output else fwd

    def call(*a: Any, **k: Any) -> Any:
        if fallback is not None and (compiling() or transforms_active()):
            return fallback(*a, **k)
        args = kernel_args(*a, **k)
        if grad_enabled() and any_requires_grad(*args):
            return pick(apply(*args)) if first_output else apply(*args)
        return fwd_infer(*args)

    def forward_only(*a: Any, **k: Any) -> Any:
        return fwd_infer(*kernel_args(*a, **k))

    call.__name__ = call.__qualname__ = name
    forward_only.__name__ = forward_only.__qualname__ = f"{name}_forward_only"
    call.forward_only = forward_only  # type: ignore[attr-defined]
    return call


def tier_fast(spec: Any, tier: str, first_output: bool = False, fallback: Callable[..., Any] | None = None
              ) -> Callable[..., Any] | None:
    """The fast path of ``spec``'s ``tier`` ("triton" or "cuda"), or None when that tier's launchers are not there
    (the CUDA extension not built, a Triton without the op's module). ``fallback`` (the registered op bound to the
    op's signature) serves traced calls. An op of several outputs (``spec.outputs``) returns them all."""
    if spec.autograd is None or spec.kernel_args is None:
        return None
    name = spec.name
    if tier == "triton":
        import importlib

        try:
            mod = importlib.import_module(f"triton_src.{name}")
        except ImportError:
            return None
        fwd, bwd = getattr(mod, f"{name}_fast", None), getattr(mod, f"{name}_bwd_fast", None)
        infer = getattr(mod, f"{name}_infer_fast", None)
    elif tier == "cuda":
        fwd, bwd = cuda_ext.pybind_function(f"{name}_cuda"), cuda_ext.pybind_function(f"{name}_bwd_cuda")
        infer = None
    else:
        raise ValueError(f"tier_fast: tier must be 'triton' or 'cuda', got {tier!r}")
    if fwd is None or bwd is None:
        return None
    setup, backward_for = spec.autograd
    return fast_callable(fwd, bwd, setup, backward_for, spec.kernel_args, first_output, fallback=fallback,
                         name=f"{name}_{tier}_fast", fwd_infer=infer, outputs=len(spec.outputs))
