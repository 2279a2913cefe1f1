"""The CUDA tier's training call through its C++ autograd node (cuda_src/native_autograd.h, tiered_ops/tiers/native.py).

Where an op's wrapper file exports ``<op>_train_cuda``, the eager fast path's training call is one C++ node instead of
a Python ``torch.autograd.Function`` around the same launchers. Both paths run the same kernels, so their outputs and
gradients must be identical bit for bit, for every argument the node saves (weight or none, bias or none, the Hugging
Face forms, a float32 weight over bf16) and every gradient a caller may ask for (x alone, the weight alone, one of two
outputs); the node must be the C++ one, and a call without gradients or inside torch.compile must not create it. On the
CPU: which ops declare a node, and that their source hash covers the Python module that calls it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import cpp_node_name, gpu

from tiered_ops.tiers import cuda_ext, native
from tiered_ops.tiers.catalog import all_ops, get_op
from tiered_ops.tiers.fastpath import tier_fast

NODE_OPS = ("fused_add_rms_norm", "layer_norm", "rms_norm")


def test_the_norms_declare_a_cpp_node_and_their_hash_covers_its_caller():
    ops_with_cuda = [s for s in all_ops() if "cuda" in s.impls]
    declared = sorted(s.name for s in ops_with_cuda if native.declares_node(s.name))
    assert declared == sorted(NODE_OPS)
    caller = Path(native.__file__)
    for spec in ops_with_cuda:
        assert (caller in spec.impls["cuda"].sources) == (spec.name in NODE_OPS), spec.name


def _cases(op: str) -> list[tuple[str, dict]]:
    """(label, case) for op: the call's tensors are made on the GPU by ``_call``."""
    if op == "rms_norm":
        return [("weight", dict(shape=(64, 4096))), ("no weight", dict(shape=(8, 1000), weight=False)),
                ("gemma", dict(shape=(33, 781), weight_offset=1.0)),
                ("llama fp32 weight", dict(shape=(33, 781), cast_before_weight=True, w32=True)),
                ("looped rows", dict(shape=(2, 40009))), ("non-contiguous", dict(shape=(64, 256), strided=True)),
                ("empty", dict(shape=(0, 64)))]
    if op == "layer_norm":
        return [("weight and bias", dict(shape=(64, 4096))), ("no bias", dict(shape=(8, 1000), bias=False)),
                ("neither", dict(shape=(8, 1000), weight=False, bias=False)),
                ("two dims", dict(shape=(4, 6, 33), normalized=(6, 33))), ("looped rows", dict(shape=(2, 40009))),
                ("empty", dict(shape=(0, 64)))]
    return [("weight", dict(shape=(64, 4096))), ("no weight", dict(shape=(8, 1000), weight=False)),
            ("llama", dict(shape=(33, 781), cast_before_weight=True)), ("gemma", dict(shape=(33, 781),
                                                                                      weight_offset=1.0)),
            ("empty", dict(shape=(0, 64)))]


def _call(op: str, case: dict, dtype: torch.dtype, seed: int) -> tuple[tuple, dict]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = case["shape"]
    ns = case.get("normalized", shape[-1:])

    def randn(s, dt=dtype):
        return torch.randn(s, device="cuda", generator=g, dtype=torch.float32).to(dt)

    x = randn(shape)
    if case.get("strided"):
        x = randn((shape[0], 2 * shape[1]))[:, ::2]
    w_dtype = torch.float32 if case.get("w32") else dtype
    w = 1 + 0.5 * randn(ns, w_dtype) if case.get("weight", True) else None
    form = {k: case[k] for k in ("weight_offset", "cast_before_weight") if k in case}
    if op == "rms_norm":
        return (x, ns, w, 1e-6), form
    if op == "layer_norm":
        b = randn(ns) if case.get("bias", True) else None
        return (x, ns, w, b, 1e-5), {}
    return (x, randn(shape), ns, w, 1e-6), form


def _grads(fast, args: tuple, kwargs: dict, leaves: list[int], seed: int, outputs: list[int]) -> list[torch.Tensor]:
    """The outputs of fast(*args) and the gradients of ``leaves`` (argument positions) from ``outputs`` (output
    positions), with fixed random output gradients."""
    args = tuple(a.detach().clone().requires_grad_(i in leaves) if isinstance(a, torch.Tensor) else a
                 for i, a in enumerate(args))
    out = fast(*args, **kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dys = [torch.randn(outs[i].shape, device="cuda", generator=g).to(outs[i].dtype) for i in outputs]
    grads = torch.autograd.grad([outs[i] for i in outputs], [args[i] for i in leaves], dys, allow_unused=True)
    return [o.detach() for o in outs] + [gr for gr in grads]


def _leaf_sets(op: str, args: tuple) -> list[list[int]]:
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    params = [i for i in tensors if i >= 2]  # the weight and bias (x and residual come first)
    inputs = [i for i in tensors if i not in params]
    return [tensors, inputs[:1]] + ([params[:1]] if params else [])


@gpu
@pytest.mark.parametrize("op", NODE_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpp_node_trains_as_the_python_function(op, dtype):
    if cuda_ext.load() is not None:
        pytest.skip("the CUDA extension is not built here")
    spec = get_op(op)
    node = native.native_fast(spec, fallback=lambda *a, **k: pytest.fail("the fallback ran outside a trace"))
    python = tier_fast(spec, "cuda", spec.first_output)
    assert node is not None and python is not None
    for seed, (label, case) in enumerate(_cases(op)):
        if case.get("w32") and dtype == torch.float32:
            continue
        args, kwargs = _call(op, case, dtype, seed)
        outputs = [[0], [0, 1], [1]] if op == "fused_add_rms_norm" else [[0]]
        for leaves in _leaf_sets(op, args):
            for outs in outputs:
                a = _grads(node, args, kwargs, leaves, seed, outs)
                b = _grads(python, args, kwargs, leaves, seed, outs)
                what = f"{op} {label} {dtype} leaves {leaves} outputs {outs}"
                assert len(a) == len(b), what
                for u, v in zip(a, b):
                    assert (u is None) == (v is None), what
                    if u is not None:
                        assert u.dtype == v.dtype and u.shape == v.shape, what
                        assert torch.equal(u, v), what


@gpu
@pytest.mark.parametrize("op", NODE_OPS)
def test_the_node_is_cpp_and_made_only_where_a_gradient_is_needed(op):
    if cuda_ext.load() is not None:
        pytest.skip("the CUDA extension is not built here")
    spec = get_op(op)
    traced: list[str] = []
    node = native.native_fast(spec, fallback=lambda *a, **k: traced.append("fallback") or spec.impls["eager"].fn(*a,
                                                                                                               **k))
    args, kwargs = _call(op, _cases(op)[0][1], torch.bfloat16, 0)
    x = args[0].detach().requires_grad_()
    out = node(x, *args[1:], **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    assert first.grad_fn is not None and first.grad_fn.name() == cpp_node_name(op), first.grad_fn.name()
    assert not isinstance(first.grad_fn, torch.autograd.function.BackwardCFunction)  # not a Python Function's
    with torch.no_grad():
        out = node(x, *args[1:], **kwargs)
    assert (out[0] if isinstance(out, tuple) else out).grad_fn is None
    assert not traced
    compiled = torch.compile(lambda *a: node(*a, **kwargs), backend="eager", fullgraph=True)
    compiled(*args)
    assert traced == ["fallback"]


@gpu
def test_the_cuda_tier_of_a_declaring_op_runs_the_node():
    if cuda_ext.load() is not None:
        pytest.skip("the CUDA extension is not built here")
    x = torch.randn(16, 256, device="cuda", requires_grad=True)
    w = torch.ones(256, device="cuda", requires_grad=True)
    y = get_op("rms_norm").impls["cuda"].fn(x, (256,), w, 1e-6)
    assert y.grad_fn.name() == "RmsNormNode", y.grad_fn.name()
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


@gpu
@pytest.mark.parametrize("op", NODE_OPS)
def test_the_node_frees_its_graph_and_guards_its_saved_tensors(op):
    """The node holds its saved tensors until its backward and no longer (a saved output, fused_add_rms_norm's
    new_residual, must not keep its own node alive), refuses a second backward through a freed graph and a saved input
    changed in place after the forward, and names forward-mode AD as unsupported instead of dropping the tangent."""
    if cuda_ext.load() is not None:
        pytest.skip("the CUDA extension is not built here")
    spec = get_op(op)
    node = native.native_fast(spec, fallback=lambda *a, **k: pytest.fail("the fallback ran outside a trace"))
    args, kwargs = _call(op, _cases(op)[0][1], torch.bfloat16, 0)
    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        y = first(node(*leaves, **kwargs))
        grads = torch.autograd.grad(y, [leaves[0]], torch.ones_like(y))
        del y, grads
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base  # nothing of the three graphs is left

    y = first(node(*leaves, **kwargs))
    y.backward(torch.ones_like(y))
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(torch.ones_like(y))

    y = first(node(*leaves, **kwargs))
    with torch.no_grad():
        leaves[0].mul_(2)  # saved by rms_norm and layer_norm; fused_add_rms_norm saves x + residual instead
    if op == "fused_add_rms_norm":
        y.backward(torch.ones_like(y))
    else:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(torch.ones_like(y))

    with fwAD.dual_level():
        dual = fwAD.make_dual(leaves[0], torch.ones_like(leaves[0]))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            node(dual, *leaves[1:], **kwargs)
