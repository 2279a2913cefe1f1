"""benchmarks/step_profile.py: kernels sorted into families (tiered_ops' own found from the kernel sources), and a
step of each variant timed and issued on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_patch import needs_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import step_profile  # noqa: E402


@pytest.mark.parametrize("name, fam", [
    ("void rms_norm_v1_kernel<__nv_bfloat16, 8>(__nv_bfloat16 const*, float*, long)", "tiered_ops"),
    ("_rms_norm_rows", "tiered_ops"),
    ("ce_fwd_v2_kernel", "tiered_ops"),
    ("triton_red_fused__to_copy_add_mean_pow_0", "inductor"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("Memset (Device)", "other"),
])
def test_kernel_families(name, fam):
    assert step_profile.family(name) == fam


def test_the_own_kernels_are_read_from_both_kernel_folders():
    assert {"_rms_norm_rows", "_ce_fwd", "rms_norm_v1_kernel", "reduce_partials_kernel"} <= step_profile.OWN


@needs_hf
def test_a_step_of_each_variant_on_the_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TIERED_OPS_DB", str(tmp_path / "s.sqlite"))
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "--model", "llama-tiny", "--seq", "16", "--reps", "2",
                                      "--variants", "stock,tiered", "--no-tune"])
    assert step_profile.main() == 0
    out = capsys.readouterr().out
    assert "llama-tiny train eager bf16 16 tokens on cpu" in out
    for v in ("stock", "tiered"):
        assert f"  {v:13s} step " in out and "host to issue it" in out
