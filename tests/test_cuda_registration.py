"""Every CUDA op is registered whole, from its own files, and only those files enter its source hash.

An op's CUDA code is cuda_src/<op>.cu (kernels, launchers) and cuda_src/<op>.cpp (its torch wrapper ending in one
TIERED_OPS_CUDA_OP line: schemas, CUDA and CPU kernels, pybind11 functions of forward and backward). These tests read
the sources (no CUDA build here): each op has both files and one registration of its own name, the registration macro
expands into every part, the op's Python declaration gives the fakes, the autograd and the fast path, and editing one
op's files, or adding or removing an op's, leaves the other ops' source hashes alone; an op without CUDA files (muladd)
has no cuda tier. The C++ itself is checked by g++ (slow).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import builtin_ops, gpu
from nvcc_build import NVCC, nvcc_object

from tiered_ops.tiers import cuda_ext, fastpath
from tiered_ops.tiers.catalog import get_op

ROOT = Path(__file__).resolve().parent.parent
CUDA_SRC = ROOT / "cuda_src"
_STRINGS = r'((?:\s*"(?:[^"\\]|\\.)*")+)'
_REGISTRATION = re.compile(r"^TIERED_OPS_CUDA_OP\(\s*(\w+)\s*," + _STRINGS + r"\s*," + _STRINGS + r"\s*\)\s*;", re.M)
# What the registration macro must expand into, for forward and backward alike: block -> its statements.
_MACRO_PARTS = {
    "TORCH_LIBRARY_FRAGMENT(tiered_ops, m)": ("m.def(FWD_SCHEMA);", "m.def(BWD_SCHEMA);"),
    "TORCH_LIBRARY_IMPL(tiered_ops, CUDA, m)": ('m.impl(#OP "_cuda", TORCH_FN(OP##_cuda));',
                                                'm.impl(#OP "_bwd_cuda", TORCH_FN(OP##_bwd_cuda));'),
    "TORCH_LIBRARY_IMPL(tiered_ops, CPU, m)": ('m.impl(#OP "_cuda", TORCH_FN(OP##_cuda));',
                                               'm.impl(#OP "_bwd_cuda", TORCH_FN(OP##_bwd_cuda));'),
    "PybindExportEntry OP##_pybind_export(#OP, [](pybind11::module_& m)": ('m.def(#OP "_cuda", &OP##_cuda);',
                                                                           'm.def(#OP "_bwd_cuda", &OP##_bwd_cuda);'),
}
_NOT_OPS = ("binding", "call_key")  # .cpp files of the module, not of an op


def _joined(literals: str) -> str:
    return "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', literals))


def registrations(root: Path) -> dict[str, list[tuple[str, str, str]]]:
    """File stem -> the (op, forward schema, backward schema) registrations in cuda_src/<stem>.cpp."""
    return {p.stem: [(m[1], _joined(m[2]), _joined(m[3])) for m in _REGISTRATION.finditer(p.read_text())]
            for p in sorted(root.glob("*.cpp")) if p.stem not in _NOT_OPS}


def _macro_body(root: Path) -> str:
    text = (root / "binding.h").read_text()
    m = re.search(r"#define TIERED_OPS_CUDA_OP\(OP, FWD_SCHEMA, BWD_SCHEMA\)((?:.*\\\n)*.*)", text)
    return re.sub(r"\s+", " ", m[1].replace("\\\n", " ")) if m else ""


def _schema_args(schema: str) -> list[str]:
    inner = schema[schema.index("(") + 1:schema.rindex(") ->")]
    return [a.split()[-1] for a in inner.split(",") if a.strip()]


def problems(root: Path, python_ops: list[str]) -> list[str]:
    """Everything missing or inconsistent in the CUDA registrations under ``root`` and the ops' declarations."""
    out: list[str] = []
    body = _macro_body(root)
    for block, parts in _MACRO_PARTS.items():
        start = body.find(block)
        inside = body[start:body.find("}", start)] if start >= 0 else ""
        out += [f"binding.h: TIERED_OPS_CUDA_OP does not expand into {part} in {block}" for part in parts
                if part not in inside]
    regs = registrations(root)
    kernels = {p.stem for p in root.glob("*.cu")}
    out += [f"{op}.cu has no wrapper file {op}.cpp" for op in sorted(kernels - set(regs))]
    out += [f"{op}.cpp has no kernel file {op}.cu" for op in sorted(set(regs) - kernels)]
    module = (root / "binding.cpp").read_text()
    for stem, found in regs.items():
        if len(found) != 1:
            out.append(f"{stem}.cpp: expected one TIERED_OPS_CUDA_OP line, found {len(found)}")
            continue
        op, fwd, bwd = found[0]
        text = (root / f"{stem}.cpp").read_text()
        if op != stem:
            out.append(f"{stem}.cpp registers {op!r}: a wrapper file registers the op it is named after")
        for fn, schema in ((f"{op}_cuda", fwd), (f"{op}_bwd_cuda", bwd)):
            if not schema.startswith(fn + "("):
                out.append(f"{stem}.cpp: the schema {schema!r} does not define {fn}")
            if not re.search(rf"^\S.*\b{fn}\(", text, re.M):
                out.append(f"{stem}.cpp: no function {fn}")
        if re.search(rf"\b{op}_", module):
            out.append(f"binding.cpp names {op}: the module lists no op (each op registers itself)")
        if op not in python_ops:
            out.append(f"{op}: registered in CUDA but declared by no op of tiered_ops")
            continue
        spec = get_op(op)
        if "cuda" not in spec.impls:
            out.append(f"{op}: the declaration has no cuda implementation")
        for what, fake, schema in (("fake", spec.fake, fwd), ("bwd_fake", spec.bwd_fake, bwd)):
            if fake is None:
                out.append(f"{op}: no {what} (the kernel op would not trace under torch.compile)")
            elif len(inspect.signature(fake).parameters) != len(_schema_args(schema)):
                out.append(f"{op}: {what} takes {list(inspect.signature(fake).parameters)}, the schema "
                           f"{_schema_args(schema)}")
        if spec.autograd is None or spec.kernel_args is None:
            out.append(f"{op}: no autograd or kernel_args (no backward, no eager fast path)")
    registered = {r[0][0] for r in regs.values() if r}
    out += [f"{op}: a cuda implementation without a registration in cuda_src/{op}.cpp" for op in python_ops
            if "cuda" in get_op(op).impls and op not in registered]
    return out


def _builtin() -> list[str]:
    return [s.name for s in builtin_ops()]


def test_every_cuda_op_is_registered_whole():
    assert registrations(CUDA_SRC), "no TIERED_OPS_CUDA_OP line found"
    assert problems(CUDA_SRC, _builtin()) == []


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "cuda_src"
    shutil.copytree(CUDA_SRC, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("break_it, expect", [
    (lambda r: _edit(r / "segment_sum.cpp", "TIERED_OPS_CUDA_OP(segment_sum,", "TIERED_OPS_CUDA_OP_(segment_sum,"),
     "segment_sum.cpp: expected one TIERED_OPS_CUDA_OP line, found 0"),
    (lambda r: (r / "gelu.cpp").unlink(), "gelu.cu has no wrapper file gelu.cpp"),
    (lambda r: _edit(r / "softmax.cpp", '"softmax_bwd_cuda(', '"softmax_backward_cuda('),
     "does not define softmax_bwd_cuda"),
    (lambda r: _edit(r / "binding.h", 'm.def(#OP "_bwd_cuda", &OP##_bwd_cuda);', ""),
     'does not expand into m.def(#OP "_bwd_cuda", &OP##_bwd_cuda); in PybindExportEntry'),
    (lambda r: _edit(r / "binding.h", 'm.impl(#OP "_cuda", TORCH_FN(OP##_cuda));', ""),
     'does not expand into m.impl(#OP "_cuda", TORCH_FN(OP##_cuda)); in TORCH_LIBRARY_IMPL(tiered_ops, CUDA, m)'),
    (lambda r: _edit(r / "gelu.cpp", "gelu_bwd_cuda(Tensor dy, Tensor x, Tensor? bias, str approximate)",
                     "gelu_bwd_cuda(Tensor dy, Tensor x, Tensor? bias, str approximate, int extra)"),
     "gelu: bwd_fake takes"),
    (lambda r: _edit(r / "binding.cpp", "namespace tiered_ops {", "namespace tiered_ops {\n// softmax_cuda"),
     "binding.cpp names softmax"),
    (lambda r: shutil.copy(r / "gelu.cu", r / "planted.cu"), "planted.cu has no wrapper file planted.cpp"),
], ids=["no-registration", "no-wrapper", "bwd-schema-name", "no-pybind-bwd", "no-cuda-impl", "fake-mismatch",
        "module-names-an-op", "kernel-without-op"])
def test_a_missing_part_is_reported(tmp_path, break_it, expect):
    root = _copy(tmp_path)
    break_it(root)
    found = problems(root, _builtin())
    assert any(expect in p for p in found), found


def test_an_op_without_fakes_is_reported(monkeypatch):
    spec = get_op("segment_sum")
    monkeypatch.setattr(spec, "bwd_fake", None)
    assert any("segment_sum: no bwd_fake" in p for p in problems(CUDA_SRC, _builtin()))


@pytest.mark.parametrize("op", sorted(registrations(CUDA_SRC)))
def test_the_fast_path_takes_both_pybind_functions(monkeypatch, op):
    """The eager fast path of every registered op is built from its pybind11 forward and backward (the names the
    registration exports); an op that returns one output uses it."""
    asked: list[str] = []

    def pybind_function(name: str):
        asked.append(name)
        return lambda *a: None

    monkeypatch.setattr(cuda_ext, "pybind_function", pybind_function)
    spec = get_op(op)
    assert fastpath.tier_fast(spec, "cuda", spec.first_output) is not None
    assert sorted(asked) == sorted([f"{op}_cuda", f"{op}_bwd_cuda"])


_HASHES = """
import json
from tiered_ops.tiers import cuda_ext
from tiered_ops.tiers.catalog import all_ops
assert str(cuda_ext.CUDA_SRC).startswith({root!r}), cuda_ext.CUDA_SRC
print(json.dumps({{s.name: s.impls["cuda"].source_hash for s in all_ops() if "cuda" in s.impls}}))
"""


def _cuda_hashes(tree: Path) -> dict[str, str]:
    """Op -> its cuda implementation's source hash, for the ops of ``tree`` that have one."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", _HASHES.format(root=str(tree))], capture_output=True, text=True,
                       env=env, cwd=tree, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_ops_cuda_files_change_its_hash_alone(tmp_path):
    tree = tmp_path / "tree"
    for pkg in ("tiered_ops", "triton_src", "cuda_src"):
        shutil.copytree(ROOT / pkg, tree / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = _cuda_hashes(tree)
    _edit(tree / "cuda_src" / "gelu.cu", "namespace tiered_ops {", "namespace tiered_ops {\n// an edit")
    after_cu = _cuda_hashes(tree)
    _edit(tree / "cuda_src" / "softmax.cpp", "namespace tiered_ops {", "namespace tiered_ops {\n// an edit")
    after_wrapper = _cuda_hashes(tree)
    shutil.copy(tree / "cuda_src" / "gelu.cu", tree / "cuda_src" / "newop.cu")  # an op added: nobody's hash moves
    shutil.copy(tree / "cuda_src" / "gelu.cpp", tree / "cuda_src" / "newop.cpp")
    after_new = _cuda_hashes(tree)
    for f in cuda_ext.op_files("segment_sum", tree / "cuda_src"):  # an op's CUDA kernel removed: its tier goes,
        f.unlink()  # nobody else's hash moves
    after_removed = _cuda_hashes(tree)
    _edit(tree / "cuda_src" / "norm_grads.cuh", "#pragma once", "#pragma once\n// an edit")
    after_header = _cuda_hashes(tree)  # a header some ops' kernels include: theirs move, and no other op's
    _edit(tree / "cuda_src" / "binding.h", "#pragma once", "#pragma once\n// an edit")
    after_shared = _cuda_hashes(tree)

    assert {op for op in before if after_cu[op] != before[op]} == {"gelu"}
    assert {op for op in before if after_wrapper[op] != after_cu[op]} == {"softmax"}
    assert after_new == after_wrapper
    assert after_removed == {op: h for op, h in after_new.items() if op != "segment_sum"} != after_new
    header = ROOT / "cuda_src" / "norm_grads.cuh"  # included directly or through another header (rms_grads.cuh)
    includers = {f.stem for f in (ROOT / "cuda_src").glob("*.cu") if header in cuda_ext.included_files([f])}
    assert includers >= {"rms_norm", "layer_norm", "fused_add_rms_norm"}
    assert {op for op in after_removed if after_header[op] != after_removed[op]} == includers
    assert all(after_shared[op] != after_header[op] for op in after_header)


def _torch_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return include_paths()


def _gxx_unity(tmp_path: Path, mode: list[str]) -> subprocess.CompletedProcess:
    """g++ of the module and every wrapper file as one translation unit (one parse of the torch headers; their
    file-local names must not collide). The CUDA runtime headers come from the toolkit (nvcc's), and the header torch
    generates at its CUDA build, missing from the CPU wheel, is stubbed."""
    gxx = shutil.which("g++")
    cuda_inc = next((p for p in ("/usr/local/cuda/include",) if os.path.exists(f"{p}/cuda_runtime_api.h")), None)
    if gxx is None or cuda_inc is None:
        pytest.skip("needs g++ and the CUDA toolkit's headers")
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    unity = tmp_path / "unity.cpp"
    unity.write_text("".join(f'#include "{p.name}"\n' for p in sorted(CUDA_SRC.glob("*.cpp"))))
    incs = [*_torch_includes(), sysconfig.get_paths()["include"], cuda_inc, str(tmp_path / "stub"), str(CUDA_SRC)]
    return subprocess.run([gxx, "-std=c++20", *mode, "-Wall", "-Werror", "-DTORCH_EXTENSION_NAME=tiered_ops_x",
                           *[f"-I{i}" for i in incs], str(unity)], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def unity_object(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The wrappers' unity file compiled once (-O0, an object: its undefined symbols are the launchers it calls):
    the run and the object, shared by the two tests that read them."""
    tmp = tmp_path_factory.mktemp("unity")
    return _gxx_unity(tmp, ["-c", "-O0", "-fPIC", "-o", str(tmp / "unity.o")]), tmp / "unity.o"


@pytest.mark.slow
def test_the_wrappers_compile_with_gxx(unity_object):
    r, _ = unity_object
    assert r.returncode == 0, r.stderr[-4000:]


def _symbols(obj: Path, defined: bool) -> set[str]:
    r = subprocess.run(["nm", "-C", "--defined-only" if defined else "--undefined-only", str(obj)],
                       capture_output=True, text=True, check=True)
    return {m[1] for m in re.finditer(r"^\s*(?:[0-9a-f]+\s+)?[TU] (tiered_ops::.*)$", r.stdout, re.M)}


@pytest.mark.slow
def test_every_launcher_a_wrapper_calls_is_defined_by_its_kernel_file(unity_object):
    """The launchers are declared in the wrapper files and defined in the .cu files: a signature that differs links
    only at load time (an undefined symbol). Both sides are compiled here and their symbols compared; the .cu
    objects are tests/test_nvcc.py's (one nvcc build of each file per test process: tests/nvcc_build.py). Slow on
    the CPU (42 s on 2 cores): nvcc builds every kernel file here, and test_nvcc.py then reuses the builds."""
    if NVCC is None or shutil.which("nm") is None:
        pytest.skip("needs nvcc and nm")
    r, unity = unity_object
    assert r.returncode == 0, r.stderr[-4000:]
    have: set[str] = set()
    for cu in sorted(CUDA_SRC.glob("*.cu")):
        r, obj = nvcc_object(cu)
        assert r.returncode == 0, r.stderr[-3000:]
        have |= _symbols(obj, defined=True)
    need = _symbols(unity, defined=False)
    assert need and need <= have, sorted(need - have)


@gpu
def test_the_built_extension_registers_every_op_whole():
    import torch

    assert cuda_ext.load() is None
    ops = sorted(registrations(CUDA_SRC))
    assert sorted(cuda_ext.registered_ops()) == ops
    for op in ops:
        for fn in (f"{op}_cuda", f"{op}_bwd_cuda"):
            assert cuda_ext.pybind_function(fn) is not None, fn
            schema = str(getattr(torch.ops.tiered_ops, fn).default._schema)
            assert schema.startswith(f"tiered_ops::{fn}("), schema


def test_a_finished_build_is_imported_without_ninja_and_a_broken_one_is_built_again(tmp_path, caplog):
    """``cuda_ext._built``: the build under the sources' hash is imported straight (no up-to-date check on a first
    call); a build directory another build holds (its lock), a missing or a truncated library: None (then built)."""
    name = "tiered_ops_cuda_test0123"
    src = tmp_path / "m.c"
    src.write_text(f'#include <Python.h>\nstatic struct PyModuleDef d = {{PyModuleDef_HEAD_INIT, "{name}", 0, -1}};\n'
                   f'PyMODINIT_FUNC PyInit_{name}(void) {{ PyObject *m = PyModule_Create(&d); '
                   'PyModule_AddIntConstant(m, "answer", 42); return m; }\n')
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    assert cuda_ext._built(name, tmp_path) is None  # nothing built yet
    so = tmp_path / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(so)],
                   check=True)
    (tmp_path / "lock").write_text("")
    assert cuda_ext._built(name, tmp_path) is None  # a build holds the directory
    (tmp_path / "lock").unlink()
    assert cuda_ext._built(name, tmp_path).answer == 42
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / f"{name}.so").write_bytes(so.read_bytes()[:100])  # cut off mid-link (another file: this one is mapped)
    assert cuda_ext._built(name, cut) is None
    assert "did not import" in caplog.text
