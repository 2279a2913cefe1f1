"""Build and load the CUDA tier: ``cuda_src/*.cu`` and ``cuda_src/*.cpp`` as one TORCH_LIBRARY extension.

An op's CUDA code is two files: its kernels and host launchers ``cuda_src/<op>.cu`` (plain CUDA) and its torch
wrapper ``cuda_src/<op>.cpp``, which registers the op (schemas, CUDA and CPU kernels, pybind11 functions) with one
``TIERED_OPS_CUDA_OP`` line. ``binding.cpp`` (the module) and the headers are shared by every op and name none.

Built with ``torch.utils.cpp_extension.load`` (ninja) for the local GPU's architecture, into a build
directory whose name hashes the sources, the torch and CUDA versions and the target architecture:
a binary built from other sources or for another torch is never loaded. The build happens once per
process on first use (scripts/gpu.sh logs its seconds). Fakes (meta kernels) and
autograd formulas of the ops are registered here, so the ops trace under torch.compile and train.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .. import envs
from ..registry import package_dir

log = logging.getLogger(__name__)

# The installed package cuda_src (its .cu/.cuh/.h/.cpp are package data); the build directory stays outside it.
CUDA_SRC = package_dir("cuda_src")
_lock = threading.Lock()
_state: dict[str, object] = {}
_on_load: list[Callable[[], None]] = []


# Files every op's CUDA code is built with: a change to one of them is a change to every op.
SHARED = ("common.cuh", "launchers.h", "binding.h", "binding.cpp")


def sources() -> list[Path]:
    return sorted(CUDA_SRC.glob("*.cu")) + sorted(CUDA_SRC.glob("*.cpp"))


def op_files(op: str, root: Path | None = None) -> tuple[Path, Path]:
    """The CUDA files of ``op`` alone: its kernel file and its wrapper file."""
    root = CUDA_SRC if root is None else root
    return root / f"{op}.cu", root / f"{op}.cpp"


def included_files(files: list[Path], root: Path | None = None) -> list[Path]:
    """The headers of ``root`` that ``files`` include (``#include "name"``), and the ones those include, in the order
    first met: an op's source hash covers them, so a change to a header its kernels are built from stales its rows."""
    root = CUDA_SRC if root is None else root
    found: list[Path] = []
    todo = [f for f in files if f.exists()]
    while todo:
        for line in todo.pop(0).read_text().splitlines():
            m = _INCLUDE.match(line)
            header = root / m.group(1) if m else None
            if header is not None and header.exists() and header not in found and header not in files:
                found.append(header)
                todo.append(header)
    return found


_INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')


def shared_files(root: Path | None = None) -> list[Path]:
    """The files every op's CUDA code is built with (an op's source hash covers these and its own two)."""
    root = CUDA_SRC if root is None else root
    return [root / f for f in SHARED]


def all_files() -> list[Path]:
    """Every file the build reads (sources and headers): the input of the build hash."""
    return sorted(p for p in CUDA_SRC.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))


def build_dir_root() -> Path:
    env = envs.build_dir()
    return Path(env) if env else envs.cache_dir() / "cuda_build"


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


# The build's flags: part of its name, so a build found on disk (``_built``) was made with them.
_CFLAGS = ["-O3"]
_CUDA_CFLAGS = ["-O3", "-lineinfo"]


def build_name(arch: str) -> str:
    h = hashlib.sha256()
    for p in all_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch}|{_CFLAGS}|{_CUDA_CFLAGS}".encode())
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
    if "name" in _state:  # loaded: no lock, so that dynamo tracing a first call through an op sees no context manager
        return None
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
        t0 = time.perf_counter()
        module = _built(name, bdir)
        if module is None:
            from torch.utils import cpp_extension  # (imports setuptools: a first call that finds a build skips it)

            old = os.environ.get("TORCH_CUDA_ARCH_LIST")
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
            try:
                module = cpp_extension.load(
                    name=name, sources=[str(p) for p in sources()], build_directory=str(bdir),
                    # No -std here: torch picks the standard its headers need (C++20 for torch 2.11); overriding it
                    # segfaulted when a TORCH_CHECK threw out of the op.
                    extra_cflags=_CFLAGS, extra_cuda_cflags=_CUDA_CFLAGS,
                    is_python_module=True, verbose=envs.verbose_build(),
                )
            except Exception as e:  # recorded as the reason the CUDA tier is unavailable
                _state["error"] = f"CUDA extension failed to build: {_first_error(str(e))}"
                return _state["error"]  # type: ignore[return-value]
            finally:
                if old is None:
                    os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
                else:
                    os.environ["TORCH_CUDA_ARCH_LIST"] = old
        _state.update(name=name, load_s=time.perf_counter() - t0, arch=arch, module=module, build_dir=bdir)
        for hook in _on_load:
            hook()
        return None


def _built(name: str, bdir: Path) -> Any:
    """The extension imported straight from its build, where one is there and no build holds the directory: its name
    hashes every source, torch's version, CUDA's, the architecture and the flags, so a build under it is of these
    very sources (ninja's up-to-date check costs a first call ~0.3 s). None otherwise, or where the import fails (a
    build cut off mid-link): ``cpp_extension.load`` then builds what is missing."""
    so = bdir / f"{name}.so"
    if not so.is_file() or (bdir / "lock").exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (ImportError, OSError) as e:
        log.warning("the CUDA extension's build %s did not import (%s); building it again", so, e)
        return None
    return module


# The C++ call key alone, as a module of its own (the CUDA extension's binding.cpp exports the same three functions).
_CALL_KEY_MODULE = """#include <torch/extension.h>
namespace tiered_ops {
PyObject* call_key_function(); PyObject* call_cached_function(); PyObject* fast_path_function();
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("call_key") = pybind11::reinterpret_steal<pybind11::object>(tiered_ops::call_key_function());
  m.attr("call_cached") = pybind11::reinterpret_steal<pybind11::object>(tiered_ops::call_cached_function());
  m.attr("fast_path") = pybind11::reinterpret_steal<pybind11::object>(tiered_ops::fast_path_function());
}
"""


def build_call_key_cpu(build_dir: Path, name: str = "tiered_ops_call_key_cpu", source_dir: Path | None = None) -> Any:
    """The C++ call key (``call_key.cpp`` and the header it includes) built alone with its CUDA part compiled out: a
    module with ``call_key``, ``call_cached`` and ``fast_path``, for a host without CUDA (the tests; the dispatch
    diagnostics on a CPU). ``source_dir``: another copy of ``cuda_src`` (an earlier tree's, to compare in one
    process under another ``name``). Needs a C++ compiler and Python's headers."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "module.cpp").write_text(_CALL_KEY_MODULE)
    src = (source_dir or CUDA_SRC) / "call_key.cpp"
    return cpp_extension.load(name=name, build_directory=str(build_dir),
                              sources=[str(src), str(build_dir / "module.cpp")],
                              extra_cflags=[*_CFLAGS, "-DTIERED_OPS_CALL_KEY_NO_CUDA"], verbose=envs.verbose_build())


def on_load(hook: Callable[[], None]) -> None:
    """Call ``hook`` once the extension is loaded (now, when it is already): the tiers register the autograd and fake
    kernels of the ops it defines there, so this module needs nothing above it."""
    _on_load.append(hook)
    if "name" in _state:
        hook()


def pybind_function(name: str):
    """A function the loaded extension exports (a CUDA op's C++ function, the graph-break contrast; ``call_key``, a
    call's key read in C++), or None when not built."""
    module = _state.get("module")
    return getattr(module, name, None) if module is not None else None


def load_if_built(device: torch.device) -> bool:
    """Load the extension where its build for ``device`` is on disk already (never build here); True once it is
    loaded. The per-call path asks this on its first CUDA call, so that the C++ key serves a process whose decisions
    name no CUDA implementation too."""
    if "name" in _state:
        return True
    if "error" in _state or device.type != "cuda" or not torch.cuda.is_available():
        return False
    name = build_name(_arch(device))
    if not any((build_dir_root() / name).glob(f"{name}*.so")):
        return False
    return load(device) is None


def registered_ops() -> list[str] | None:
    """The ops the loaded extension registered (one per wrapper file, each once: a file may export several
    functions), or None when not built."""
    module = _state.get("module")
    return list(dict.fromkeys(module.registered_ops)) if module is not None else None


def ninja_seconds(build_dir: Path) -> dict[str, float]:
    """Seconds ninja spent on each target of the last build in ``build_dir`` (from its .ninja_log).

    Format (v5): a header line, then ``start_ms end_ms mtime target hash`` per target; a target rebuilt
    later appears again, and the last entry counts.
    """
    log = Path(build_dir) / ".ninja_log"
    out: dict[str, float] = {}
    if not log.exists():
        return out
    for line in log.read_text().splitlines():
        parts = line.split("\t")
        if line.startswith("#") or len(parts) < 4:
            continue
        out[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
    return out


def build_info() -> dict[str, object]:
    """Build facts of the loaded extension: per-object seconds, total, target architecture."""
    if "name" not in _state:
        return {}
    secs = ninja_seconds(_state["build_dir"])  # type: ignore[arg-type]
    return dict(arch=f"sm_{str(_state['arch']).replace('.', '')}", load_s=_state["load_s"], objects=secs,
                build_s=sum(secs.values()) if secs else None)


def available(device: torch.device) -> str | None:
    """Availability check for CUDA-tier implementations (builds on first call)."""
    if device.type != "cuda":
        return "CUDA tier runs on CUDA devices only"
    return load(device)
