"""The normalizations' weight/bias gradients (rms_norm, layer_norm, fused_add_rms_norm): a persistent dx kernel
writing (programs, n) fp32 partials, then one reducing kernel writing the parameter's dtype. Checked against the
float64 truth where the row tiles outnumber the persistent grid (programs loop) and where there are fewer rows than
programs, in every form; the gradient's dtype; and the launches of a backward (at most two)."""

import pytest
import torch
from helpers import DTYPES, assert_matches, aten_ops, gpu

from tiered_ops.ops.fused_add_rms_norm import _problem as FA
from tiered_ops.ops.layer_norm import _problem as LN
from tiered_ops.ops.rms_norm import _problem as RMS
from triton_src import common, launch, norm_grads
from triton_src import fused_add_rms_norm as tfa
from triton_src import layer_norm as tln
from triton_src import rms_norm as trms

# On the CPU the persistent grid has 2 * CPU_SMS = 8 programs.
CASES = [
    ("rms_norm", RMS((1000, 96))),  # 63 tiles of 16 rows over 8 programs: each program loops
    ("rms_norm", RMS((3, 3000))),  # 3 rows of one tile each: fewer tiles than programs
    ("rms_norm", RMS((20, 9000))),  # longer than MAX_FUSED_BWD: the looped kernel, 20 rows over 8 programs
    ("rms_norm", RMS((1000, 96), weight_offset=1.0)),  # Gemma's form
    ("rms_norm", RMS((1000, 96), cast_before_weight=True)),  # Llama's form
    ("rms_norm", RMS((20, 9000), cast_before_weight=True)),  # Llama's form, looped
    ("layer_norm", LN((1000, 96))),
    ("layer_norm", LN((3, 3000))),
    ("layer_norm", LN((20, 9000))),  # looped
    ("layer_norm", LN((2, 20003))),  # few giant rows: the split kernels
    ("layer_norm", LN((1000, 1))),  # one column: dx is 0, db is the sum of dy
    ("layer_norm", LN((1000, 96), weight=False)),  # bias only
    ("layer_norm", LN((20, 9000), bias=False)),  # weight only, looped
    ("fused_add_rms_norm", FA((1000, 96))),
    ("fused_add_rms_norm", FA((3, 3000))),
    ("fused_add_rms_norm", FA((20, 9000))),  # looped
    ("fused_add_rms_norm", FA((1000, 96), weight_offset=1.0)),
    ("fused_add_rms_norm", FA((20, 9000), cast_before_weight=True)),
]


@pytest.mark.parametrize("op,problem", CASES, ids=[f"{op}-{p}" for op, p in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_param_grads_match_float64(op, problem, dtype):
    assert_matches(op, "triton", problem, dtype, seed=5, grad=True)


def test_the_persistent_grid_is_smaller_than_the_work():
    """The shapes above exercise what they claim: 1000 x 96 has more row tiles than programs, 3 x 3000 fewer."""
    x = torch.randn(1000, 96)
    plan = trms.plan_bwd(x, x, [96], torch.ones(96))
    assert plan.step.grid == (2 * common.CPU_SMS,) and plan.step.consts["ROWS"] == 16  # 63 tiles
    assert plan.grads.shape == (2 * common.CPU_SMS, 96)
    x = torch.randn(3, 3000)
    assert trms.plan_bwd(x, x, [3000], torch.ones(3000)).step.grid == (3,)


def _bwd_calls(op, dtype, wdtype, rows, n, form):
    """(name, backward function taking direct, the weight) for op with x of (rows, n) in dtype and a weight."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(wdtype)
    dt = torch.promote_types(wdtype, dtype) if form.get("cast_before_weight") else dtype
    dy = torch.randn(rows, n, generator=g).to(dt)
    off, cast = form.get("weight_offset", 0.0), form.get("cast_before_weight", False)
    if op == "rms_norm":
        return w, lambda fast: (trms.rms_norm_bwd_fast if fast else trms.rms_norm_bwd_launch)(
            dy, x, [n], w, 1e-6, off, cast)
    if op == "fused_add_rms_norm":
        rstd = torch.rand(rows) + 0.5
        return w, lambda fast: (tfa.fused_add_rms_norm_bwd_fast if fast else tfa.fused_add_rms_norm_bwd_launch)(
            dy, x.clone(), x, [n], w, rstd, off, cast)
    mean, rstd = torch.randn(rows), torch.rand(rows) + 0.5
    return w, lambda fast: (tln.layer_norm_bwd_fast if fast else tln.layer_norm_bwd_launch)(
        dy, x, [n], w, mean, rstd, True)


FORMS = [("rms_norm", torch.bfloat16, torch.bfloat16, {}),
         ("rms_norm", torch.bfloat16, torch.float32, {"cast_before_weight": True}),
         ("rms_norm", torch.float16, torch.float32, {"weight_offset": 1.0}),
         ("fused_add_rms_norm", torch.float16, torch.float16, {}),
         ("fused_add_rms_norm", torch.bfloat16, torch.float32, {"cast_before_weight": True}),
         ("layer_norm", torch.bfloat16, torch.bfloat16, {}),
         ("layer_norm", torch.float32, torch.float32, {})]


def _launches(monkeypatch) -> list:
    """The Triton launch steps run from now on (launch.Step calls, in order)."""
    steps = []
    call = launch.Step.__call__

    def counting(self, direct, *args):
        steps.append(self)
        return call(self, direct, *args)

    monkeypatch.setattr(launch.Step, "__call__", counting)
    return steps


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "registered"])
@pytest.mark.parametrize("n", [96, 9000], ids=["rows", "looped"])
@pytest.mark.parametrize("op,dtype,wdtype,form", FORMS, ids=str)
def test_backward_is_two_launches_and_dw_has_the_weights_dtype(op, dtype, wdtype, form, n, fast, monkeypatch):
    """At most two kernel launches (the dx pass writing the partials, their reduction), no torch reduction or cast
    after them, and dw (db) in the parameter's dtype."""
    steps = _launches(monkeypatch)
    w, bwd = _bwd_calls(op, dtype, wdtype, 40, n, form)
    with aten_ops() as seen:
        out = bwd(fast)
    assert len(steps) == 2, steps
    assert steps[-1].kernel is norm_grads._reduce_partials
    assert not [s for s in seen if "sum" in s or "_to_copy" in s or s.startswith("aten.add")], seen
    for g in out[1:]:
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape)


def test_backward_without_parameters_is_one_launch(monkeypatch):
    steps = _launches(monkeypatch)
    x = torch.randn(30, 50)
    dx, dw = trms.rms_norm_bwd_fast(torch.randn_like(x), x, [50], None, 1e-6)
    assert len(steps) == 1 and dw.numel() == 0


# ---- CUDA tier (the lead runs these on a GPU) ----------------------------------------------------------------------
GPU_CASES = [
    ("rms_norm", RMS((8192, 4096))),  # rows >> SMs: every block loops over many rows
    ("rms_norm", RMS((7, 4096))),  # rows < SMs
    ("rms_norm", RMS((1823, 781))),  # odd: the scalar path
    ("rms_norm", RMS((300, 40009))),  # rows longer than a register-resident row
    ("rms_norm", RMS((4096, 2048), weight_offset=1.0)),
    ("rms_norm", RMS((4096, 2048), cast_before_weight=True)),
    ("rms_norm", RMS((64, 5120))),  # the longest row the backward's v2 holds (320 threads)
    ("rms_norm", RMS((531, 4096))),  # 16-bit rows a row ahead: a last row in flight on only some blocks
    ("rms_norm", RMS((3, 5136))),  # one pack a thread past it: v1
    ("rms_norm", RMS((500, 8))),  # one pack a row, most of the block's lanes past the row's end
    ("rms_norm", RMS((300, 1024), weight=False)),  # no weight: no partials
    ("layer_norm", LN((8192, 4096))),
    ("layer_norm", LN((7, 4096))),
    ("layer_norm", LN((1823, 781))),
    ("layer_norm", LN((300, 40009))),
    ("layer_norm", LN((4096, 1))),
    ("layer_norm", LN((4096, 2048), weight=False)),
    ("fused_add_rms_norm", FA((8192, 4096))),
    ("fused_add_rms_norm", FA((7, 4096))),
    ("fused_add_rms_norm", FA((1823, 781))),
    ("fused_add_rms_norm", FA((300, 40009))),
    ("fused_add_rms_norm", FA((4096, 2048), weight_offset=1.0)),
    ("fused_add_rms_norm", FA((4096, 2048), cast_before_weight=True)),
    ("fused_add_rms_norm", FA((64, 5120))),
    ("fused_add_rms_norm", FA((531, 4096))),
    ("fused_add_rms_norm", FA((3, 5136))),
    ("fused_add_rms_norm", FA((500, 8))),
    ("fused_add_rms_norm", FA((300, 1024), weight=False)),
]


@gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("op,problem", GPU_CASES, ids=[f"{op}-{p}" for op, p in GPU_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_param_grads_match_float64(impl, op, problem, dtype):
    assert_matches(op, impl, problem, dtype, seed=5, grad=True)


@gpu
@pytest.mark.parametrize("op,dtype,wdtype,form", FORMS, ids=str)
def test_cuda_param_grads_have_the_weights_dtype(op, dtype, wdtype, form):
    from tiered_ops.tiers import cuda_ext

    bwd = cuda_ext.pybind_function(f"{op}_bwd_cuda")
    n, rows = 4096, 300
    x = torch.randn(rows, n, device="cuda").to(dtype)
    w = torch.ones(n, device="cuda", dtype=wdtype)
    dt = torch.promote_types(wdtype, dtype) if form.get("cast_before_weight") else dtype
    dy = torch.randn(rows, n, device="cuda").to(dt)
    off, cast = form.get("weight_offset", 0.0), form.get("cast_before_weight", False)
    if op == "rms_norm":
        out = bwd(dy, x, [n], w, 1e-6, off, cast)
        want = (dy.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0)
    elif op == "fused_add_rms_norm":
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
        out = bwd(dy, x.clone(), x, [n], w, rstd, off, cast)
        want = (dy.double() * x.double() * rstd.double()[:, None]).sum(0)
    else:
        mean, rstd = x.float().mean(-1), torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5)
        out = bwd(dy, x, [n], w, mean, rstd, True)
        want = (dy.double() * (x.double() - mean.double()[:, None]) * rstd.double()[:, None]).sum(0)
    assert out[1].dtype == wdtype and out[1].shape == w.shape
    err = ((out[1].double() - want).norm() / want.norm()).item()
    assert err < (1e-5 if out[1].dtype == torch.float32 else 1e-2), err
