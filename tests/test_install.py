"""A plain (non-editable) install carries every kernel source, `python -m tiered_ops` runs, and what the README
and docs/ show is exported and runs as written."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import builtin_ops

import tiered_ops
from tiered_ops.registry import Tier
from tiered_ops.tiers import cuda_ext

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS_MODEL = (ROOT / "docs" / "model-code.md").read_text()
DOCS = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def wheel_path(file: Path) -> str:
    """The path ``file`` has inside a wheel: from the top of the importable package that holds it (the folders
    with an ``__init__.py`` above it), which must be the package that importing its name finds."""
    top = file.parent
    assert (top / "__init__.py").exists(), f"{file} is not inside a package (no __init__.py in {top})"
    while (top.parent / "__init__.py").exists():
        top = top.parent
    spec = importlib.util.find_spec(top.name)
    assert spec is not None and spec.submodule_search_locations, f"package {top.name} of {file} is not importable"
    found = [Path(p).resolve() for p in spec.submodule_search_locations]
    assert top.resolve() in found, f"{file}: importing {top.name} finds {found}, not {top}"
    return file.resolve().relative_to(top.resolve().parent).as_posix()


def kernel_files() -> set[Path]:
    """Every file an implementation is hashed from and every file the CUDA build reads; not the planted faulty
    kernels of tests/plants (registered when a test imports them) nor a peer library's files."""
    tests = Path(__file__).resolve().parent
    files = {p for spec in builtin_ops() for impl in spec.impls.values() if impl.tier != Tier.PEER
             for p in impl.sources if not p.resolve().is_relative_to(tests)}
    return files | set(cuda_ext.all_files()) | set(cuda_ext.sources())


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """Names in a wheel built from a copy of the checkout (the build writes nothing into the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in ("tiered_ops", "triton_src", "cuda_src"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("tiered_ops-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def test_every_kernel_source_is_package_data_in_the_wheel(wheel_names):
    files = kernel_files()
    # Each tier's files are there: the op files, the Triton kernels and every CUDA source and header.
    assert {p.suffix for p in files} >= {".py", ".cu", ".cuh", ".h", ".cpp"}
    missing = sorted(path for path in map(wheel_path, files) if path not in wheel_names)
    assert not missing, f"kernel sources missing from the wheel: {missing}"


def test_kernel_sources_are_found_through_their_packages():
    # The same files wherever the packages are installed: not through the checkout's layout.
    import cuda_src
    import triton_src
    from tiered_ops.tiers import tiers as _tiers

    assert cuda_ext.CUDA_SRC == Path(cuda_src.__file__).resolve().parent
    assert _tiers.TRITON_SRC == Path(triton_src.__file__).resolve().parent


def test_python_m_tiered_ops_runs_the_cli(tmp_path):
    env = dict(os.environ, TIERED_OPS_DB=str(tmp_path / "s.sqlite"),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "tiered_ops", "list", "--device", "cpu"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for op in (s.name for s in builtin_ops()):
        assert op in r.stdout


def test_readme_names_only_exported_functions():
    called = set(re.findall(r"\btiered_ops\.([a-z_]+)\(", README + DOCS))
    assert {"softmax", "select_backend", "set_policy", "set_tuning"} <= called
    assert not [n for n in sorted(called) if n not in tiered_ops.__all__ or not callable(getattr(tiered_ops, n))]


def test_set_policy_sets_the_process_default():
    from tiered_ops.decide.decide import default_policy

    try:
        tiered_ops.set_policy("cold-start", calls=1000)
        assert default_policy() == ("cold-start", 1000)
    finally:
        tiered_ops.set_policy(None)
    assert default_policy() != ("cold-start", 1000)


def test_readme_model_code_runs_as_written():
    section = DOCS_MODEL.split("## Calling the ops", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "tiered_ops.softmax(x" in code and "select_backend" in code
    g = torch.Generator().manual_seed(0)
    ns = dict(x=torch.randn(4, 64, generator=g),
              h=torch.randn(8, 4096, generator=g, dtype=torch.bfloat16, requires_grad=True),
              weight=torch.randn(4096, generator=g, dtype=torch.bfloat16),
              bias=torch.randn(4096, generator=g, dtype=torch.bfloat16))
    tiered_ops.set_tuning(False)  # decisions without measuring: the snippet runs in a second
    try:
        exec(compile(code, "docs/model-code.md (Calling the ops)", "exec"), ns)
    finally:
        tiered_ops.set_tuning(None)
    assert ns["y"].shape == ns["x"].shape
    assert ns["sel"].tier == Tier.EAGER and ns["sel"].name == "eager"  # nothing measured, tuning off
    assert ns["out"].shape == (8, 4096) and ns["out"].dtype == torch.bfloat16
    assert ns["h"].requires_grad


@pytest.mark.parametrize("driver, spec, want", [
    (False, None, "install -q torch==2.13.0+cpu"),
    (True, None, "install -q torch==2.13.0"),
    (False, "torch==2.11.0 --index-url https://example.invalid/cu130",
     "install -q torch==2.11.0 --index-url https://example.invalid/cu130"),
])
def test_scripts_install_the_cpu_torch_where_there_is_no_nvidia_driver(tmp_path, driver, spec, want):
    """scripts/torch.sh (run by scripts/test.sh, scripts/bench.sh and .ci/run) with a Python that has no torch:
    PyPI's plain torch (the CUDA build, GBs) only where nvidia-smi is; TORCH_SPEC wins over both."""
    bin_dir, log = tmp_path / "bin", tmp_path / "pip.log"
    bin_dir.mkdir()
    py = bin_dir / "python"
    py.write_text(f'#!/bin/sh\n[ "$1" = "-c" ] && exit 1\nshift 2\necho "$@" >> {log}\n')
    py.chmod(0o755)
    if driver:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **({"TORCH_SPEC": spec} if spec else {})}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "torch.sh"), str(py)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [want]
    for script in ("scripts/test.sh", "scripts/bench.sh", ".ci/run"):
        text = (ROOT / script).read_text()
        assert "scripts/torch.sh" in text and "pip install -q torch" not in text.replace('"', ""), script


def test_an_editable_install_keeps_the_installed_cpu_torch():
    """pyproject's torch range holds 2.13.0+cpu: `pip install -e .` after scripts/torch.sh pulls no other torch."""
    import tomllib
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = Requirement(next(d for d in deps if d.startswith("torch")))
    assert torch_req.specifier.contains("2.13.0+cpu") and torch_req.specifier.contains(torch.__version__)
