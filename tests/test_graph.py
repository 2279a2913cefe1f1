"""tiered_ops.<op> inside torch.compile(fullgraph=True) for every tier a decision can pick; opcheck of every op."""

import functools
import time

import pytest
import torch
from helpers import HAS_CUDA, builtin_ops, gpu, op_impls

import tiered_ops
from tiered_ops.decide import decide as sel_mod
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import bucket_str
from tiered_ops.measure.meta import _between_pointwise
from tiered_ops.registry import DTYPE_NAMES, as_outputs
from tiered_ops.runtime import memo
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

OPS = [s.name for s in builtin_ops()]
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def _decide(store_path, op, problem, winner, device, mode="fwd_nograd", dtype=torch.float32):
    """Store rows in which `winner` is the fastest correct implementation of the problem's bucket."""
    spec, fp = get_op(op), fingerprint(device)
    rows = [dict(op=op, impl=i.name, tier=i.tier.label, mode=mode, problem=str(problem),
                 bucket=bucket_str(spec.bucket(problem)), dtype=DTYPE_NAMES[dtype], device_key=fp.key, ok=1,
                 caller_us=1.0 if i.name == winner else 9.0, source_hash=i.source_hash, timestamp=time.time(),
                 context=ctx)
            for i in spec.impls.values() for ctx in ("eager", "compiled")]  # a compiled caller's own rows too
    Store(store_path).add(rows)


def _compiled_public_op(private_store, op, tier, full_compile, train=False, params=None, dtype=torch.float32):
    """tiered_ops.<op> between two pointwise ops: one graph, no break; compiled output (and with ``train`` the
    input gradients through the tier's registered backward) equal to the uncompiled call. ``params``: the problem's
    parameters (its keyword arguments, as make_inputs gives them, are passed to the op)."""
    spec = get_op(op)
    problem = spec.problem((33, 40), **(params or {}))
    _decide(private_store, op, problem, tier, DEV, "fwd+bwd" if train else "fwd_nograd", dtype)
    inp = spec.make_inputs(problem, dtype, DEV, 3)
    args = list(inp.args)
    if train:
        args = [a.detach().requires_grad_(True) if i in spec.grad_args and isinstance(a, torch.Tensor) else a
                for i, a in enumerate(args)]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    public = functools.partial(getattr(tiered_ops, op), **inp.kwargs) if inp.kwargs else getattr(tiered_ops, op)
    model = _between_pointwise(public)
    sel_mod.set_tuning(False)
    try:
        eager_out = model(*args)  # decides outside the compiled region
        for ctx in (0, 1):  # the eager call's selection, and the one it cached for a compiled caller
            key = next(k for k in memo._calls if k[0] == op and k[-1] == ctx)
            assert memo._calls[key].name == tier and memo._calls[key].record["mode"] == (
                "fwd+bwd" if train else "fwd_nograd")
        torch._dynamo.reset()
        e = torch._dynamo.explain(model)(*args)
        assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
        if full_compile:
            out = torch.compile(model, fullgraph=True)(*args)
            torch.testing.assert_close(out, eager_out)
            if train:
                dy = tuple(torch.randn_like(o) for o in as_outputs(out))  # a gradient into every output
                want = torch.autograd.grad(eager_out, leaves, dy)
                got = torch.autograd.grad(out, leaves, dy)
                for w, g in zip(want, got):
                    torch.testing.assert_close(g, w)
    finally:
        sel_mod.set_tuning(None)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("tier", ["eager", "compile", "triton"])
def test_public_op_compiles_fullgraph_on_cpu_tiers(private_store, op, tier):
    if HAS_CUDA:
        pytest.skip("the GPU variant below covers these tiers with the real kernels")
    # inductor cannot run Triton's interpreter on fake tensors: the Triton tier is checked by explain only
    _compiled_public_op(private_store, op, tier, full_compile=tier != "triton")


@gpu
@pytest.mark.parametrize("op,tier", op_impls(OPS, ["eager", "compile", "triton", "cuda"]))
def test_public_op_compiles_fullgraph_on_gpu(private_store, op, tier):
    _compiled_public_op(private_store, op, tier, full_compile=True)


@pytest.mark.parametrize("op,tier", op_impls(OPS, ["triton", pytest.param("cuda", marks=gpu)]))
def test_training_step_compiles_fullgraph_through_registered_backward(private_store, op, tier):
    # on the CPU inductor cannot build the interpreter's kernels: dynamo's trace (explain) is checked there
    _compiled_public_op(private_store, op, tier, full_compile=HAS_CUDA, train=True)


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm"])
@pytest.mark.parametrize("form", [dict(cast_before_weight=True), dict(weight_offset=1.0)], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tier", ["triton", pytest.param("cuda", marks=gpu)])
def test_hf_norm_forms_train_compiled_through_the_registered_backward(private_store, op, form, dtype, tier):
    """The Hugging Face forms (the patched models' norms) in a compiled training step: on a GPU, Inductor builds the
    tier's forward and backward kernels of that form; on the CPU, dynamo's trace is checked."""
    _compiled_public_op(private_store, op, tier, full_compile=HAS_CUDA, train=True, params=form, dtype=dtype)


def test_select_backend_decision_is_used_inside_compiled_region(private_store):
    """Decided with select_backend before compiling: no graph break, no measuring while tracing."""
    x = torch.randn(8, 32, device=DEV)
    sel_mod.set_tuning(False)
    try:
        tiered_ops.select_backend("softmax", (8, 32), torch.float32, DEV)
        model = _between_pointwise(tiered_ops.softmax)
        torch._dynamo.reset()
        assert torch._dynamo.explain(model)(x, -1).graph_break_count == 0
    finally:
        sel_mod.set_tuning(None)


def test_missing_decision_inside_fullgraph_traces_the_eager_tier(private_store):
    """No decision at trace time: the eager tier goes into the graph, under fullgraph=True, nothing measured."""
    x = torch.randn(8, 32, device=DEV)
    torch._dynamo.reset()
    sel_mod.set_tuning(False)
    try:
        out = torch.compile(_between_pointwise(tiered_ops.softmax), fullgraph=True, backend="eager")(x, -1)
    finally:
        sel_mod.set_tuning(None)
    torch.testing.assert_close(out, _between_pointwise(torch.softmax)(x, -1))


_FRESH_PROCESS = """
import sys, tempfile
import torch
import tiered_ops
assert "torch._dynamo" not in sys.modules, "importing tiered_ops imported dynamo"
tiered_ops.use_store(tempfile.mkdtemp() + "/s.sqlite")
tiered_ops.set_tuning(False)
f = lambda x: tiered_ops.softmax(x.sin(), -1).cos()
x = torch.randn(8, 32)
torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x), torch.softmax(x.sin(), -1).cos())
print("ok")
"""


def test_importing_does_not_import_dynamo_and_a_trace_with_no_decision_stays_in_its_graph():
    """A process that never compiles never pays for dynamo's import; one that compiles a call with no decision
    traces the eager tier under fullgraph=True."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def _opcheck_args(op, dtype, device):
    spec = get_op(op)
    problems = [spec.problem((37, 129))] + ([spec.problem((5, 33), dim=0)] if op == "softmax" else [])
    out = []
    for p in problems:  # differentiable inputs require grad: opcheck then checks the registered backward too
        args = list(spec.make_inputs(p, dtype, device, 1).args)
        for i in spec.grad_args:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].detach().requires_grad_(True)
        out.append(spec.kernel_args(*args))
    return out


@pytest.mark.skipif(HAS_CUDA, reason="GPU runs the full opcheck below")
@pytest.mark.parametrize("op", OPS)
def test_opcheck_schema_of_triton_ops_on_cpu(op):
    get_op(op).impls["triton"].why_not(DEV)  # imports the module that registers the op
    for args in _opcheck_args(op, torch.float32, DEV):
        res = torch.library.opcheck(getattr(torch.ops.tiered_ops, f"{op}_triton").default, args,
                                    test_utils=("test_schema",))
        assert res == {"test_schema": "SUCCESS"}


@gpu
@pytest.mark.parametrize("op,tier", op_impls(OPS, ["triton", "cuda"]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_on_gpu(op, tier, dtype):
    assert get_op(op).impls[tier].why_not(DEV) is None
    for args in _opcheck_args(op, dtype, DEV):
        res = torch.library.opcheck(getattr(torch.ops.tiered_ops, f"{op}_{tier}").default, args)
        assert set(res) == {"test_schema", "test_autograd_registration", "test_faketensor",
                            "test_aot_dispatch_dynamic"} and set(res.values()) == {"SUCCESS"}, res
