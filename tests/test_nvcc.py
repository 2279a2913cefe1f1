"""Every CUDA kernel file compiles with plain nvcc (no torch headers), with no register spills."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_SRC = Path(__file__).resolve().parent.parent / "cuda_src"
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


PLANTS = Path(__file__).resolve().parent / "plants"


@pytest.mark.parametrize("cu", sorted(CUDA_SRC.glob("*.cu")) + sorted(PLANTS.glob("*.cu")), ids=lambda p: p.name)
def test_compiles_without_spills(cu, tmp_path):
    assert NVCC, "nvcc not found: the CUDA kernel files must compile on every machine that runs the tests"
    r = subprocess.run([NVCC, "-c", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v",
                        str(cu), "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)]
    kernels = re.findall(r"Compiling entry function '(\w+)'", r.stderr)
    assert kernels and len(spills) == len(kernels), r.stderr[-2000:]
    assert sum(spills) == 0, r.stderr
