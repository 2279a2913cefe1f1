"""Planted faulty implementations of one tiny op, ``plant_double(x) = 2 * x``, for the isolation tests.

A sweep over this op must finish with every planted candidate recorded as failed (with its reason) and the
good ones measured; none of the plants may ever be selected. Importing this module registers the op, so a
worker process sees it too (the sweep's workers import each op's reference module; the CLI: ``--import``).

- ``py_segv``: the process dies of SIGSEGV mid-call (any device).
- ``py_hang``: the call never returns (CPU: a Python loop; the CUDA version is ``cuda_spin``).
- ``triton_bad``: a Triton kernel that fails at compile time (a static_assert), ``triton_good`` its correct twin.
- ``cuda_oob``: a CUDA kernel writing 4 TiB out of bounds (illegal address: the CUDA context is lost).
- ``cuda_spin``: a CUDA kernel that never ends.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import torch

from tiered_ops.ops._common import gen, randn
from tiered_ops.registry import Impl, Inputs, OpSpec, Problem, Tier, make_problem, pow2_ceil, register_op

HERE = Path(__file__).resolve().parent
_ext: dict[str, object] = {}


def reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _segv(x: torch.Tensor) -> torch.Tensor:
    os.kill(os.getpid(), signal.SIGSEGV)
    return x * 2


def _hang(x: torch.Tensor) -> torch.Tensor:
    while True:
        time.sleep(0.05)


def _triton(bad: bool):
    def fn(x: torch.Tensor) -> torch.Tensor:
        import triton
        import triton.language as tl

        kernel = _kernels.get(bad)
        if kernel is None:
            @triton.jit
            def kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, BAD: tl.constexpr):
                tl.static_assert(not BAD, "planted: this kernel does not compile")
                offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
                tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

            _kernels[bad] = kernel
        xc = x.contiguous()
        y = torch.empty_like(xc)
        if xc.numel():
            kernel[(triton.cdiv(xc.numel(), 1024),)](xc, y, xc.numel(), BLOCK=1024, BAD=bad)
        return y
    return fn


_kernels: dict[bool, object] = {}


def _triton_available(device: torch.device) -> str | None:
    try:
        from triton_src import common
    except ImportError as e:
        return f"triton unavailable: {e}"
    return common.available(device)


def _triton_timeable(device: torch.device) -> str | None:
    from triton_src import common

    return common.timeable(device)


def _cuda_available(device: torch.device) -> str | None:
    """Build (once per process) and load the planted kernels' extension; None when loaded."""
    if "error" in _ext:
        return str(_ext["error"])
    if "lib" not in _ext:
        if not torch.cuda.is_available() or torch.version.cuda is None:
            return "no CUDA device"
        from torch.utils import cpp_extension

        from tiered_ops.tiers.cuda_ext import build_dir_root

        bdir = build_dir_root() / "tiered_plants"
        bdir.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(name="tiered_plants", sources=[str(HERE / "binding.cpp"), str(HERE / "faulty.cu")],
                               build_directory=str(bdir), is_python_module=False, extra_cuda_cflags=["-O1"])
        except Exception as e:
            _ext["error"] = f"plant extension failed to build: {str(e).strip().splitlines()[-1][:300]}"
            return str(_ext["error"])
        _ext["lib"] = True
    return None


def _cuda(name: str):
    return lambda x: getattr(torch.ops.tiered_plants, name)(x)


def _problem(shape: tuple[int, ...]) -> Problem:
    return make_problem(shape)


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    return Inputs((randn(p.shape, dtype, device, gen(device, seed)),))


SPEC = register_op(OpSpec(
    name="plant_double",
    reference=reference,
    make_inputs=_inputs,
    problem=_problem,
    problem_of=lambda x: _problem(tuple(x.shape)),
    bucket=lambda p: (pow2_ceil(math.prod(p.shape)),),
    bytes_moved=lambda p, dt: 2 * math.prod(p.shape) * torch.empty((), dtype=dt).element_size(),
    edge_problems=lambda: [make_problem((1,)), make_problem((1823, 781))],
    default_problems=lambda device_type: [make_problem((1 << 20,))],  # one: each hang costs a timeout
    source=Path(__file__),
))
_FP32 = (torch.float32,)
for impl in (
    Impl("eager", Tier.EAGER, reference, (HERE / "__init__.py",), dtypes=_FP32),
    Impl("py_segv", Tier.EAGER, _segv, (HERE / "__init__.py",), dtypes=_FP32),
    Impl("py_hang", Tier.EAGER, _hang, (HERE / "__init__.py",), dtypes=_FP32, devices=("cpu",)),
    Impl("cuda_oob", Tier.CUDA, _cuda("oob_double"), (HERE / "faulty.cu", HERE / "binding.cpp"), dtypes=_FP32,
         devices=("cuda",), available=_cuda_available),
    Impl("cuda_spin", Tier.CUDA, _cuda("spin_double"), (HERE / "faulty.cu", HERE / "binding.cpp"), dtypes=_FP32,
         devices=("cuda",), available=_cuda_available),
    Impl("triton_good", Tier.TRITON, _triton(False), (HERE / "__init__.py",), dtypes=_FP32,
         available=_triton_available, timeable=_triton_timeable),
    Impl("triton_bad", Tier.TRITON, _triton(True), (HERE / "__init__.py",), dtypes=_FP32,
         available=_triton_available, timeable=_triton_timeable),
):
    SPEC.add(impl)
