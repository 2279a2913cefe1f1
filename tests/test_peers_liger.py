"""Liger-Kernel's SwiGLU / GeGLU and RoPE as peers of swiglu and rotary_embedding, with Liger itself.

On the CPU: Liger's wheel (``.whl/liger_kernel-*.whl``, scripts/fetch_peers.sh; skipped without it) unpacked into the
test's folder and imported; its RoPE kernel runs on the Triton interpreter in fp32 (the interpreter's bfloat16
arithmetic is not Triton's, and its SwiGLU / GeGLU kernels do not run there: a scalar argument's ``.to``, libdevice's
tanh), so their checks there are of the peer's plumbing, with a stand-in that writes over its inputs as Liger's do.
On a GPU (``-m gpu``, Liger installed as scripts/gpu.sh installs it): the gate and the timing of each, and that the
timed call computes what the gated one does.
"""

from __future__ import annotations

import sys
import types
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tiered_ops.measure import gate
from tiered_ops.tiers import peers
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")
WHEELS = sorted((Path(__file__).resolve().parents[1] / ".whl").glob("liger_kernel-*.whl"))


@pytest.fixture(autouse=True)
def fresh_gates(monkeypatch):
    monkeypatch.setattr(gate, "_edge_results", {})
    monkeypatch.setattr(gate, "_problem_results", {})


@pytest.fixture(scope="module")
def liger_wheel(tmp_path_factory):
    """Liger imported from its wheel, unpacked for this module; its modules forgotten afterwards."""
    if not WHEELS:
        pytest.skip("no .whl/liger_kernel-*.whl (bash scripts/fetch_peers.sh downloads it)")
    site = tmp_path_factory.mktemp("liger_site")
    with zipfile.ZipFile(WHEELS[-1]) as z:
        z.extractall(site)
    sys.path.insert(0, str(site))
    yield site
    sys.path.remove(str(site))
    for name in [n for n in sys.modules if n == "liger_kernel" or n.startswith("liger_kernel.")]:
        del sys.modules[name]


def _on_the_cpu(op: str):
    """The op's Liger peer, allowed on the CPU (its kernels on the Triton interpreter)."""
    spec = get_op(op)
    return spec, replace(spec.impls["liger"], devices=("cpu", "cuda"), available=lambda device: None)


@pytest.mark.parametrize("grad", [False, True])
def test_liger_s_rope_passes_our_gate_on_every_edge_problem(liger_wheel, grad):
    """Layout (q and k as the attention's transposed views), grouped-query k, partial rotary (40 of 80), head_dim
    256, a decode token, no rows: forward and, with ``grad``, q's and k's gradients, against the float64 reference."""
    spec, impl = _on_the_cpu("rotary_embedding")
    err, why = gate.gate(spec, impl, spec.problem((2, 4, 8, 64), kv_heads=2), torch.float32, CPU, grad=grad)
    assert why is None and err < 1e-5, why


def test_liger_s_rope_rotates_in_place_where_it_is_timed_and_on_copies_where_it_is_checked(liger_wheel):
    """At one token of one head q, k and the output gradient are all in the layout Liger writes over: the timed call
    rotates q and k in place (a model's activations); the checked call leaves them and the gradient as they were,
    with the same values."""
    spec = get_op("rotary_embedding")
    q, k, cos, sin = spec.make_inputs(spec.problem((1, 1, 1, 64)), torch.float32, CPU, 0).args
    want = spec.reference(q.double(), k.double(), cos.double(), sin.double())
    q0, k0 = q.clone(), k.clone()
    ql, kl = q.detach().requires_grad_(), k.detach().requires_grad_()
    out = peers._liger_rotary_embedding_on_copies(ql, kl, cos, sin)
    dy = tuple(torch.randn_like(o) for o in out)
    dy0 = tuple(d.clone() for d in dy)
    grads = torch.autograd.grad(out, (ql, kl), dy)
    assert torch.equal(q, q0) and torch.equal(k, k0) and all(torch.equal(d, d0) for d, d0 in zip(dy, dy0))
    for o, w in zip(out, want):
        torch.testing.assert_close(o.double(), w, rtol=1e-5, atol=1e-6)
    qd, kd = q0.double().requires_grad_(), k0.double().requires_grad_()
    ref_grads = torch.autograd.grad(spec.reference(qd, kd, cos.double(), sin.double()), (qd, kd),
                                    tuple(d.double() for d in dy0))
    for g, w in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)
    timed = peers._liger_rotary_embedding(q, k, cos, sin)
    assert not torch.equal(q, q0) and timed[0].data_ptr() == q.data_ptr()  # Liger as a model runs it: in place
    torch.testing.assert_close(timed[0].double(), want[0], rtol=1e-5, atol=1e-6)


def test_liger_s_rope_reads_the_first_half_of_cos_only(liger_wheel):
    """Why the checked call refuses cos and sin whose halves differ: Liger's answer there is not the op's."""
    spec = get_op("rotary_embedding")
    q, k, cos, sin = spec.make_inputs(spec.problem((1, 2, 3, 8), kv_heads=1), torch.float32, CPU, 0).args
    cos, sin = cos + torch.arange(8.0) / 8, sin - torch.arange(8.0) / 8  # halves no longer equal
    want = spec.reference(q.double(), k.double(), cos.double(), sin.double())
    got = peers._liger_rotary_embedding(q.clone(), k.clone(), cos, sin)
    assert not torch.allclose(got[0].double(), want[0], rtol=1e-3, atol=1e-3)
    with pytest.raises(NotImplementedError, match="halves repeat only"):
        peers._liger_rotary_embedding_on_copies(q, k, cos, sin)


class _InPlaceGLU(torch.autograd.Function):
    """A stand-in for Liger's LigerSiLUMulFunction: its backward writes dgate and dup over the saved gate and up."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        s = torch.sigmoid(a)
        da, db = dc * b * (s + a * s * (1 - s)), dc * a * s
        a.copy_(da)
        b.copy_(db)
        return a, b


@pytest.fixture
def in_place_glu(monkeypatch):
    """``liger_kernel.transformers.functional`` as a stand-in whose SwiGLU writes over its inputs as Liger's does."""
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_swiglu = _InPlaceGLU.apply
    functional.liger_geglu = None
    for name, mod in (("liger_kernel", types.ModuleType("liger_kernel")),
                      ("liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")),
                      ("liger_kernel.transformers.functional", functional)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_the_swiglu_peer_s_checked_call_gives_liger_copies_and_its_timed_call_does_not(in_place_glu):
    spec = get_op("swiglu")
    g, u, act = spec.make_inputs(spec.problem((4, 8)), torch.float32, CPU, 0).args
    g0, u0 = g.clone(), u.clone()
    gl, ul = g.detach().requires_grad_(), u.detach().requires_grad_()
    y = peers._liger_swiglu_on_copies(gl, ul, act)
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (gl, ul), dy)
    assert torch.equal(g, g0) and torch.equal(u, u0)
    gd, ud = g0.double().requires_grad_(), u0.double().requires_grad_()
    want = torch.autograd.grad(spec.reference(gd, ud, act), (gd, ud), dy.double())
    for got, w in zip((dg, du), want):
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no backward to follow: no copies
        torch.testing.assert_close(peers._liger_swiglu_on_copies(g, u, act), spec.reference(g, u, act))
    y = peers._liger_swiglu(gl, ul, act)
    torch.autograd.grad(y, (gl, ul), dy)
    assert not torch.equal(g, g0)  # the timed call: Liger as a model runs it, over the harness's own inputs


CASES = [("swiglu", (64, 4096), {"activation": "silu"}), ("swiglu", (64, 4096), {"activation": "gelu_tanh"}),
         ("rotary_embedding", (2, 8, 128, 128), {"kv_heads": 2}),
         ("rotary_embedding", (2, 4, 9, 64), {"kv_heads": 2, "rotary_dim": 32})]  # partial rotary: the Triton path


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd_nograd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op, shape, kw", CASES)
def test_liger_s_glu_and_rope_pass_our_gate_and_are_timed_on_the_gpu(op, shape, kw, dtype, mode):
    pytest.importorskip("liger_kernel")
    from tiered_ops.measure.measure import measure

    spec = get_op(op)
    row = measure(spec, spec.impls["liger"], spec.problem(shape, **kw), dtype, torch.device("cuda"), mode)
    assert row["ok"] == 1 and row["caller_us"] > 0, row.get("reason")


@pytest.mark.gpu
@pytest.mark.parametrize("op, shape, kw", CASES)
def test_the_timed_call_computes_what_the_checked_call_does_on_the_gpu(op, shape, kw):
    """Same kernels, same inputs: the timed call (over its inputs) and the gated one (on copies) agree bit for bit,
    output and gradients."""
    pytest.importorskip("liger_kernel")
    spec, cuda = get_op(op), torch.device("cuda")
    impl = spec.impls["liger"]
    results = []
    for fn in (impl.fn, impl.unchecked):
        inp = spec.make_inputs(spec.problem(shape, **kw), torch.bfloat16, cuda, 5)
        args = [a.detach().requires_grad_() if i in spec.grad_args else a for i, a in enumerate(inp.args)]
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        dy = tuple(gate.grad_output(o, 5) for o in outs)
        grads = torch.autograd.grad(outs, [args[i] for i in spec.grad_args], dy)
        results.append([o.detach().clone() for o in outs] + list(grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["fwd_nograd", "fwd", "bwd", "fwd+bwd"])
def test_liger_s_rope_is_gated_and_timed_in_every_mode_on_the_interpreter(liger_wheel, mode):
    """The harness's measurement end to end: the gate on copies, the timing as a model runs it (in place over the
    harness's own q and k, through autograd in the grad modes)."""
    from tiered_ops.measure.measure import measure

    spec, impl = _on_the_cpu("rotary_embedding")
    row = measure(spec, impl, spec.problem((1, 4, 8, 64), kv_heads=2), torch.float32, CPU, mode)
    assert row["ok"] == 1 and row["caller_us"] > 0, row.get("reason")
