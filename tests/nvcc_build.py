"""One nvcc build of each CUDA file per test process, shared by the tests that read it: ptxas's report
(tests/test_nvcc.py: no register spills) and the launchers the object defines (tests/test_cuda_registration.py)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


@functools.lru_cache(maxsize=None)
def _out_dir() -> Path:
    out = Path(tempfile.mkdtemp(prefix="tiered_ops_nvcc_"))
    atexit.register(shutil.rmtree, out, True)
    return out


@functools.lru_cache(maxsize=None)
def nvcc_object(cu: Path, arch: str = "90",
                includes: tuple[Path, ...] = ()) -> tuple[subprocess.CompletedProcess, Path]:
    """``cu`` compiled for sm_``arch`` (``90a`` for the diagnostics' cluster and async-copy code) at -O3 with ptxas's
    report (-Xptxas -v), ``includes`` on the include path: the run (its stderr holds the report) and the object file.
    Built once per process; the caller asserts NVCC first."""
    assert NVCC, "nvcc not found"
    obj = _out_dir() / f"{cu.parent.name}-{cu.stem}-{arch}.o"
    flags = [f for d in includes for f in ("-I", str(d))]
    r = subprocess.run([NVCC, "-c", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas",
                        "-v", *flags, str(cu), "-o", str(obj)], capture_output=True, text=True, timeout=600)
    return r, obj
