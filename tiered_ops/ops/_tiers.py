"""The four standard implementations of an op, built from its eager function and its kernels.

Every op file calls ``standard_impls`` once; the plumbing of each tier (lazy torch.compile, the
Triton and CUDA availability checks, source files for staleness) lives here and nowhere else.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import cuda_ext
from ..registry import ROOT, Impl, OpSpec, Tier

TRITON_SRC = ROOT / "triton_src"


def _triton_module(op: str):
    import importlib

    return importlib.import_module(f"triton_src.{op}")


def _triton_available_for(spec: OpSpec) -> Callable[[torch.device], str | None]:
    """Availability of the Triton tier: importing triton_src/<op>.py registers its triton_op."""

    def available(device: torch.device) -> str | None:
        try:
            from triton_src import common

            mod = _triton_module(spec.name)
        except Exception as e:  # triton missing or broken on this machine
            return f"triton unavailable: {type(e).__name__}: {e}"
        if common.interpreted() and spec.fake is not None and not getattr(mod, "_fake_registered", False):
            # On the interpreter triton_op's derived fake would run the kernel on fake tensors; the op's own
            # fake lets dynamo trace it (explain, fullgraph) on the CPU. On a GPU triton_op's own is used.
            getattr(mod, f"{spec.name}_triton").register_fake(spec.fake)
            mod._fake_registered = True
        return common.available(device)

    return available


def _triton_timeable(device: torch.device) -> str | None:
    from triton_src import common

    return common.timeable(device)


def _kernel_op(name: str) -> Callable[..., torch.Tensor]:
    """torch.ops.tiered_ops.<name>, resolved at call time (the op exists once its module or extension loaded)."""
    ns = torch.ops.tiered_ops

    def call(*args):
        return getattr(ns, name)(*args)

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
            self._compiled = torch.compile(self.fn, dynamic=False)
        return self._compiled(*args, **kwargs)


def _identity(kernel_op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return kernel_op


def standard_impls(spec: OpSpec, eager: Callable[..., torch.Tensor],
                   adapt: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]] = _identity) -> None:
    """Register eager, compile, triton and cuda implementations of ``spec`` (files named after the op).

    ``adapt`` maps the op's Python signature onto the kernel ops' schema (e.g. normalized_shape to a list);
    the Triton op is ``tiered_ops::<op>_triton``, the CUDA op ``tiered_ops::<op>_cuda``.
    """
    name, op_file = spec.name, spec.source
    spec.kernel_args = adapt(lambda *args: args)
    triton_file = TRITON_SRC / f"{name}.py"
    cu_file = cuda_ext.CUDA_SRC / f"{name}.cu"
    binding = cuda_ext.CUDA_SRC / "binding.cpp"
    spec.add(Impl("eager", Tier.EAGER, eager, (op_file,), own_functions=((op_file, eager.__name__),)))
    spec.add(Impl("compile", Tier.COMPILE, Compiled(eager), (op_file,), own_functions=((op_file, eager.__name__),)))
    spec.add(Impl("triton", Tier.TRITON, adapt(_kernel_op(f"{name}_triton")),
                  (op_file, triton_file, TRITON_SRC / "common.py"),
                  available=_triton_available_for(spec), timeable=_triton_timeable,
                  unregistered=lambda: adapt(getattr(_triton_module(name), f"{name}_launch")),
                  own_code=(triton_file,)))
    cuda_files = [cu_file, cuda_ext.CUDA_SRC / "common.cuh", cuda_ext.CUDA_SRC / "launchers.h", binding]
    spec.add(Impl("cuda", Tier.CUDA, adapt(_kernel_op(f"{name}_cuda")), (op_file, *cuda_files), devices=("cuda",),
                  available=cuda_ext.available,
                  unregistered=lambda: (lambda f: f and adapt(f))(cuda_ext.pybind_function(f"{name}_cuda")),
                  own_code=(cu_file,), own_functions=((binding, f"{name}_cuda"),)))


def gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Standard normal values (never zeros), drawn in fp32 and rounded to dtype."""
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
