"""Build and load the CUDA tier: ``cuda_src/*.cu`` + ``cuda_src/binding.cpp`` as one TORCH_LIBRARY extension.

Built with ``torch.utils.cpp_extension.load`` (ninja) for the local GPU's architecture, into a build
directory whose name hashes the sources, the torch and CUDA versions and the target architecture:
a binary built from other sources or for another torch is never loaded. The build happens once per
process on first use (scripts/gpu.sh logs its seconds). Fakes (meta kernels) for
the ops are registered here so the ops trace under torch.compile.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch

from .registry import ROOT

CUDA_SRC = ROOT / "cuda_src"
_lock = threading.Lock()
_state: dict[str, object] = {}


def sources() -> list[Path]:
    return sorted(CUDA_SRC.glob("*.cu")) + [CUDA_SRC / "binding.cpp"]


def all_files() -> list[Path]:
    """Every file the build reads (sources and headers): the input of the build hash."""
    return sorted(p for p in CUDA_SRC.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))


def build_dir_root() -> Path:
    env = os.environ.get("TIERED_OPS_BUILD_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tiered_ops" / "cuda_build"


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def build_name(arch: str) -> str:
    h = hashlib.sha256()
    for p in all_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch}".encode())
    return f"tiered_ops_cuda_{h.hexdigest()[:12]}"


def _first_error(msg: str) -> str:
    for line in msg.splitlines():
        if "error" in line.lower() and "Error building extension" not in line:
            return line.strip()[:300]
    return msg.strip().splitlines()[0][:300] if msg.strip() else "unknown error"


def load(device: torch.device | None = None) -> str | None:
    """Build (once) and load the extension; None when loaded, else why the CUDA tier is unavailable."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.version.cuda is None:
        return "torch was built without CUDA"
    with _lock:
        if "error" in _state:
            return _state["error"]  # type: ignore[return-value]
        if "name" in _state:
            return None
        device = device or torch.device("cuda", torch.cuda.current_device())
        arch = _arch(device)
        name = build_name(arch)
        bdir = build_dir_root() / name
        bdir.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        old = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        t0 = time.perf_counter()
        try:
            cpp_extension.load(
                name=name, sources=[str(p) for p in sources()], build_directory=str(bdir),
                # No -std here: torch picks the standard its headers need (C++20 for torch 2.11); overriding it
                # segfaulted when a TORCH_CHECK threw out of the op.
                extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "-lineinfo"],
                is_python_module=False, verbose=os.environ.get("TIERED_OPS_VERBOSE_BUILD") == "1",
            )
        except Exception as e:  # recorded as the reason the CUDA tier is unavailable
            _state["error"] = f"CUDA extension failed to build: {_first_error(str(e))}"
            return _state["error"]  # type: ignore[return-value]
        finally:
            if old is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = old
        _state.update(name=name, build_s=time.perf_counter() - t0, arch=arch)
        _register_fakes()
        return None


def _register_fakes() -> None:
    @torch.library.register_fake("tiered_ops::softmax_cuda")
    def _(x: torch.Tensor, dim: int) -> torch.Tensor:
        if x.dim() == 0:
            return torch.empty_like(x)
        # The kernel writes rows along `dim` contiguously and returns them moved back into place.
        return torch.empty_like(x.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(-1, dim)

    @torch.library.register_fake("tiered_ops::rms_norm_cuda")
    def _(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tiered_ops::muladd_cuda")
    def _(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(a, memory_format=torch.contiguous_format)


def available(device: torch.device) -> str | None:
    """Availability check for CUDA-tier implementations (builds on first call)."""
    if device.type != "cuda":
        return "CUDA tier runs on CUDA devices only"
    return load(device)
