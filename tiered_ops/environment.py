"""The build environment a failure can depend on: which compilers and build tools are on PATH (resolved), the
compiler variables, the Python installation (``sys.prefix``) and the torch/Triton versions.

A candidate that failed with an exception (unavailable here, raised while compiling, building or importing) may
have failed for its environment rather than for its code: a missing C++ compiler fails the compile tier, and
installing one fixes it. Such a failure is stored with :func:`environment`, and a stored failure whose
environment differs from the current one is not fresh (``OpSpec.fresh_impl``): the next sweep or selection
measures the candidate again. A wrong answer is the kernel's own and is stored without one.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import sys

TOOLS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "nvcc", "ninja")
VARIABLES = ("CC", "CXX", "CUDA_HOME")


def _resolved(exe: str | None) -> str | None:
    return os.path.realpath(exe) if exe else None


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    """Triton's ``__version__`` without importing Triton where it is not imported yet (0.4 s or more, paid by the
    first call of a process): read from its ``__init__.py``; "none" where it is not installed. The one reading of it:
    the device fingerprint and the build environment both use it."""
    mod = sys.modules.get("triton")
    if mod is not None:
        return getattr(mod, "__version__", "none")
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "none"
    try:
        with open(spec.origin, encoding="utf-8") as f:
            found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", f.read(), re.M)
    except OSError:
        found = None
    if found:
        return found.group(1)
    try:  # a layout that sets its version otherwise
        import triton

        return triton.__version__
    except Exception:  # triton is optional on some CPU platforms
        return "none"


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    import torch

    # the Python installation (a venv's folder), not the name it was started by: `python` and `python3` of one venv
    # are one environment, and a failure stored by one of them holds for the other
    return {"python": sys.prefix, "torch": torch.__version__, "triton": triton_version()}


def environment() -> str:
    """This process's build environment as compact JSON with sorted keys (equal environments give equal strings).

    Looked up on every call (a few ``stat``s), not cached: a compiler installed while a process runs counts."""
    tools = {t: _resolved(shutil.which(t)) for t in TOOLS}
    variables = {v: os.environ.get(v) for v in VARIABLES}
    compilers = {f"{v} resolved": _resolved(shutil.which(variables[v] or "")) for v in ("CC", "CXX")}
    return json.dumps({"tools": tools, **variables, **compilers, **_versions()}, sort_keys=True,
                      separators=(",", ":"))
