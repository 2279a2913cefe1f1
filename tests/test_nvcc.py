"""Every CUDA kernel file compiles with plain nvcc (no torch headers), with no register spills; the GPU diagnostics
build against them."""

import re
from pathlib import Path

import pytest
from nvcc_build import NVCC, nvcc_object

CUDA_SRC = Path(__file__).resolve().parent.parent / "cuda_src"


PLANTS = Path(__file__).resolve().parent / "plants"


@pytest.mark.parametrize("cu", sorted(CUDA_SRC.glob("*.cu")) + sorted(PLANTS.glob("*.cu")), ids=lambda p: p.name)
def test_compiles_without_spills(cu):
    assert NVCC, "nvcc not found: the CUDA kernel files must compile on every machine that runs the tests"
    r, _ = nvcc_object(cu)
    assert r.returncode == 0, r.stderr[-3000:]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)]
    kernels = re.findall(r"Compiling entry function '(\w+)'", r.stderr)
    assert kernels and len(spills) == len(kernels), r.stderr[-2000:]
    assert sum(spills) == 0, r.stderr


DIAG = CUDA_SRC.parent / "scripts" / "diag"


@pytest.mark.parametrize("cu", sorted(DIAG.glob("*.cu")), ids=lambda p: p.name)
def test_the_standalone_diagnostics_build_against_the_kernels_as_they_are(cu):
    """The GPU diagnostics (scripts/diag/*.cu, run by hand on a GPU) include the op's kernel files: a change there
    that breaks one is found here, not on the GPU. Built as their headers say, for sm_90a."""
    assert NVCC, "nvcc not found: the CUDA kernel files must compile on every machine that runs the tests"
    r, _ = nvcc_object(cu, arch="90a", includes=(CUDA_SRC, DIAG))
    assert r.returncode == 0, r.stderr[-3000:]
