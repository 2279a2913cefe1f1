"""The four standard implementations of an op, built from its eager function and its kernels.

Every op file calls ``standard_impls`` once; the plumbing of each tier (lazy torch.compile, the
Triton and CUDA availability checks, source files for staleness) lives here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from .. import cuda_ext
from ..registry import ROOT, Impl, OpSpec, Tier

TRITON_SRC = ROOT / "triton_src"


def _triton_available_for(op: str) -> Callable[[torch.device], str | None]:
    """Availability of the Triton tier of ``op``: importing triton_src/<op>.py registers its triton_op."""

    def available(device: torch.device) -> str | None:
        try:
            import importlib

            from triton_src import common

            importlib.import_module(f"triton_src.{op}")
        except Exception as e:  # triton missing or broken on this machine
            return f"triton unavailable: {type(e).__name__}: {e}"
        return common.available(device)

    return available


def _triton_timeable(device: torch.device) -> str | None:
    from triton_src import common

    return common.timeable(device)


class Compiled:
    """torch.compile of the eager function, created on first call, specialized per shape."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self._compiled: Callable[..., torch.Tensor] | None = None

    def __call__(self, *args, **kwargs) -> torch.Tensor:
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


def standard_impls(spec: OpSpec, eager: Callable[..., torch.Tensor], triton_fn: Callable[..., torch.Tensor],
                   cuda_fn: Callable[..., torch.Tensor]) -> None:
    """Register eager, compile, triton and cuda implementations of ``spec`` (files named after the op)."""
    op_file: Path = spec.source
    spec.add(Impl("eager", Tier.EAGER, eager, (op_file,)))
    spec.add(Impl("compile", Tier.COMPILE, Compiled(eager), (op_file,)))
    spec.add(Impl("triton", Tier.TRITON, triton_fn,
                  (op_file, TRITON_SRC / f"{spec.name}.py", TRITON_SRC / "common.py"),
                  available=_triton_available_for(spec.name), timeable=_triton_timeable))
    cuda_files = [cuda_ext.CUDA_SRC / n for n in (f"{spec.name}.cu", "common.cuh", "launchers.h", "binding.cpp")]
    spec.add(Impl("cuda", Tier.CUDA, cuda_fn, (op_file, *cuda_files), devices=("cuda",),
                  available=cuda_ext.available))


def gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Standard normal values (never zeros), drawn in fp32 and rounded to dtype."""
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
