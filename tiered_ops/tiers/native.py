"""The CUDA tier's eager fast path with its autograd node in C++, for ops whose wrapper file defines one.

``fastpath.fast_callable`` builds a training call from the op's Python ``setup_context`` and backward: a Python
``torch.autograd.Function`` whose forward the interpreter runs and whose backward the engine calls back into Python
for. An op whose ``cuda_src/<op>.cpp`` defines ``<op>_train_cuda`` (``TIERED_OPS_CUDA_TRAIN``,
``cuda_src/native_autograd.h``) has that node in C++: its forward saves what the op's declaration saves, and the
engine runs its backward without a Python frame. :func:`native_fast` gives the op's Python signature onto it: the
forward launcher alone when no gradient is needed (its outputs picked from the registered op's), the C++ node when one
is (``<op>_train_cuda`` returns the op's outputs), the registered op (``fallback``) while torch.compile traces or a
functorch transform is active.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import cuda_ext

MARK = "TIERED_OPS_CUDA_TRAIN("  # the line in an op's wrapper file that exports its C++ autograd node


def declares_node(op: str) -> bool:
    """Whether ``cuda_src/<op>.cpp`` exports a C++ autograd node (read from the file: the source hash of the op's CUDA
    tier then covers this module, which calls it)."""
    wrapper = cuda_ext.op_files(op)[1]
    return wrapper.exists() and MARK in wrapper.read_text()


def native_fast(spec: Any, fallback: Callable[..., Any]) -> Callable[..., Any] | None:
    """``spec``'s CUDA fast path through its C++ autograd node, or None where the loaded extension has none (an op
    without one, or the extension not built)."""
    name, kernel_args = spec.name, spec.kernel_args
    fwd, train = cuda_ext.pybind_function(f"{name}_cuda"), cuda_ext.pybind_function(f"{name}_train_cuda")
    if fwd is None or train is None or kernel_args is None:
        return None
    outputs = len(spec.outputs)
    if not spec.first_output:
        def pick(out: Any) -> Any:
            return out
    elif outputs == 1:
        def pick(out: Any) -> Any:
            return out[0]
    else:
        def pick(out: Any) -> Any:
            return tuple(out[:outputs])
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad
    transforms_active, compiling = torch._C._are_functorch_transforms_active, torch.compiler.is_compiling

    def call(*a: Any, **k: Any) -> Any:
        if compiling() or transforms_active():
            return fallback(*a, **k)
        args = kernel_args(*a, **k)
        if grad_enabled() and any_requires_grad(*args):
            return train(*args)
        return pick(fwd(*args))

    call.__name__ = call.__qualname__ = f"{name}_cuda_native"
    return call
