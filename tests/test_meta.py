"""Maintenance-cost and graph-break metadata: LOC, ptxas, ninja log, explain, recompiles, `tiered-ops info`."""

import textwrap

import pytest
import torch
from helpers import HAS_CUDA, builtin_ops, gpu

from tiered_ops.cli.cli import main
from tiered_ops.measure import meta
from tiered_ops.registry import package_dir
from tiered_ops.store.store import Store
from tiered_ops.tiers import cuda_ext
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


def test_loc_counts_code_not_comments_or_docstrings(tmp_path):
    py = tmp_path / "k.py"
    py.write_text(textwrap.dedent('''\
        """Module docstring
        over two lines."""
        import torch  # a comment after code counts

        # a comment line


        def f(x):
            """Docstring."""
            y = (x +
                 1)
            return y
        '''))
    assert meta.count_loc(py) == 5  # import, def, two lines of y, return
    assert meta.count_loc(py, "f") == 4
    cu = tmp_path / "k.cu"
    cu.write_text("// header\n#include <x.h>\n/* block\n   comment */\nint f(int a) {\n  return a;  // why\n}\n\n"
                  "int g() { return 1; }\n")
    assert meta.count_loc(cu) == 5
    assert meta.count_loc(cu, "f") == 3
    with pytest.raises(ValueError, match="no function 'h'"):
        meta.count_loc(cu, "h")


def test_impl_loc_counts_own_code_only():
    spec = get_op("softmax")
    triton = meta.impl_loc(spec.impls["triton"])
    cuda = meta.impl_loc(spec.impls["cuda"])
    assert triton == meta.count_loc(package_dir("triton_src") / "softmax.py")
    # the .cu file plus its wrapper file, not the shared module and headers
    assert cuda == meta.count_loc(cuda_ext.CUDA_SRC / "softmax.cu") + meta.count_loc(cuda_ext.CUDA_SRC / "softmax.cpp")
    assert 0 < meta.count_loc(cuda_ext.CUDA_SRC / "softmax.cpp") < meta.count_loc(cuda_ext.CUDA_SRC / "softmax.cu")
    assert meta.impl_loc(spec.impls["eager"]) == meta.count_loc(spec.source, "reference")


def test_ptxas_report_from_a_real_nvcc_run():
    kernels = meta.ptxas_report(cuda_ext.CUDA_SRC / "softmax.cu", "90")
    # (forward v1, backward v1) x 3 dtypes x (vectorized, scalar) + forward v2 x (4 packs fp32, 3 packs 16-bit)
    # + forward v3 x 3 dtypes (its static shared memory: the reduction's 32 floats, the block's (max, sum) twice, by
    # the row's parity, and the row's merged (max, sum))
    assert len(kernels) == 12 + 4 + 3 + 3 + 3
    for k in kernels:
        assert "softmax" in k["kernel"] and k["arch"] == "sm_90"
        assert 8 <= k["registers"] <= 255 and k["spill_bytes"] == 0
        assert k["smem_bytes"] == (160 if "v3" in k["kernel"] else 128)


def test_parse_ptxas_reads_spills_and_smem():
    text = ("ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90'\n"
            "ptxas info    : Function properties for _Z1kPf\n"
            "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 360 bytes cmem[0]\n")
    (k,) = meta.parse_ptxas(text)
    assert k == dict(kernel="_Z1kPf", arch="sm_90", registers=255, spill_bytes=12, stack_bytes=16, smem_bytes=4096)


def test_ninja_log_seconds(tmp_path):
    (tmp_path / ".ninja_log").write_text("# ninja log v5\n0\t41000\t1\tsoftmax.cuda.o\tabc\n"
                                         "10\t9010\t1\tbinding.o\tdef\n0\t2000\t2\tsoftmax.cuda.o\tabd\n")
    assert cuda_ext.ninja_seconds(tmp_path) == {"softmax.cuda.o": 2.0, "binding.o": 9.0}  # last entry counts
    assert cuda_ext.ninja_seconds(tmp_path / "nowhere") == {}


@pytest.mark.skipif(HAS_CUDA, reason="the CPU interpreter's graph-break count; the GPU test covers compiled Triton")
@pytest.mark.parametrize("impl", ["eager", "compile", "triton"])
def test_explain_counts_no_break_through_registered_tiers_on_cpu(impl):
    spec = get_op("rms_norm")
    gb = meta.graph_breaks(spec, spec.impls[impl], CPU)
    assert gb["registered"]["error"] is None and gb["registered"]["breaks"] == 0 and gb["registered"]["graphs"] == 1


def test_explain_counts_a_break_for_an_opaque_function():
    opaque = torch.compiler.disable(lambda x, dim=-1: torch.softmax(x, dim))
    got = meta.explain(opaque, (torch.randn(4, 8), -1))
    assert got["breaks"] == 1 and got["graphs"] == 2 and got["reasons"]


def test_recompiles_static_vs_dynamic():
    spec = get_op("muladd")
    r = meta.recompiles_in_bucket(spec, spec.impls["eager"].fn, CPU)
    assert len(r["shapes"]) == 3 and len({spec.bucket(spec.problem(_shape(s))) for s in r["shapes"]}) == 1
    assert r["static"] == 2 and r["dynamic"] == 0


def _shape(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in s.split(",")[0].split("x"))


def test_metadata_is_stored_per_source_and_info_prints_it(private_store, capsys):
    spec = get_op("gelu")
    store = Store(private_store)
    m = meta.stored_or_collect(store, spec, spec.impls["cuda"], CPU)
    assert m["loc"] > 20 and m["max_registers"] > 0 and m["spill_bytes"] == 0 and "sm_90" in m["archs"]
    assert m["graph_breaks"]["error"].startswith("unavailable")
    from tiered_ops.measure.fingerprint import fingerprint

    key = fingerprint(CPU).key
    assert store.get_meta("gelu", "cuda", key, spec.impls["cuda"].source_hash) == m
    assert store.get_meta("gelu", "cuda", key, "another-source") is None  # stale metadata is never reused
    assert main(["--db", str(private_store), "info", "gelu", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for impl in spec.impls:
        assert f"\n{impl} [" in out
    assert "recompiles over 3 shapes of one bucket: 2 with dynamic=False" in out
    assert "NVIDIA GPUs only" in out and "graph breaks through the op" in out


@gpu
def test_gpu_graph_breaks_registered_zero_unregistered_cuda_breaks():
    dev = torch.device("cuda")
    for spec in builtin_ops():
        op = spec.name
        for name in ("triton", "cuda"):
            if name not in spec.impls:  # an op without a CUDA kernel (muladd)
                continue
            gb = meta.graph_breaks(spec, spec.impls[name], dev)
            assert gb["registered"]["breaks"] == 0 and gb["registered"]["graphs"] == 1, (op, name, gb)
        if "cuda" not in spec.impls:
            continue
        contrast = meta.graph_breaks(spec, spec.impls["cuda"], dev)["unregistered"]
        assert contrast["breaks"] >= 1, (op, contrast)  # the pybind11 function is opaque to dynamo


@gpu
def test_gpu_triton_kernel_registers_reported():
    spec = get_op("softmax")
    x = torch.randn(64, 1000, device="cuda")
    spec.impls["triton"].fn(x, -1)
    ks = meta.triton_kernel_report("softmax")
    assert ks and all(k["registers"] > 0 and k["spill_bytes"] is not None for k in ks)


def test_a_first_call_inside_a_trace_does_not_break_the_graph():
    """The kernel op is resolved on its first call; when that call is inside a trace (a model compiled before any
    eager call), resolving must not be traced: importlib and the extension's lock broke the graph there (seen on
    the H100 under pytest-xdist, where no earlier test had called the op)."""
    from tiered_ops.tiers.tiers import _kernel_op, _triton_load

    spec = get_op("softmax")
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    assert spec.impls["triton"].why_not(dev) is None
    fresh = _kernel_op("softmax_triton", lambda: _triton_load(spec))
    gb = meta.explain(lambda t: fresh(t, -1), (torch.randn(4, 8, device=dev),))
    assert gb["breaks"] == 0 and gb["graphs"] == 1, gb
