"""The shape of the per-call path of ``tiered_ops.<op>`` and of a ``select_backend`` callable: a repeated call of one
signature goes straight to the implementation (neither the op's contract nor the decision runs again), a new
signature is validated once, and what the key leaves out cannot skip a validation. No timing here: the overhead is
``benchmarks/dispatch_overhead.py``'s to measure."""

from __future__ import annotations

import pytest
import torch
from helpers import builtin_ops, gpu

import tiered_ops
from tiered_ops.decide import decide, seam
from tiered_ops.runtime import bound, memo
from tiered_ops.tiers.catalog import get_op

OPS = [s.name for s in builtin_ops()]


@pytest.fixture()
def no_tune():
    decide.set_tuning(False)
    yield
    decide.set_tuning(None)


@pytest.fixture()
def counted(monkeypatch):
    """Counts of the op contract's checks (``spec.validate`` of every op) and of decisions (``select_problem`` as the
    slow path of tiered_ops.<op> calls it)."""
    n = {"validate": 0, "select": 0}
    for spec in builtin_ops():
        if spec.validate is not None:
            def validate(*a, _v=spec.validate, **k):
                n["validate"] += 1
                return _v(*a, **k)
            monkeypatch.setattr(spec, "validate", validate)
    select = seam.select_problem

    def counting(*a, **k):
        n["select"] += 1
        return select(*a, **k)

    monkeypatch.setattr(seam, "select_problem", counting)
    return n


def _inputs(op: str, grad: bool = False):
    spec = get_op(op)
    inp = spec.make_inputs(spec.problem((4, 64)), torch.float32, torch.device("cpu"), 0)
    args = tuple(a.requires_grad_(grad and i in spec.grad_args and a.is_floating_point())
                 if isinstance(a, torch.Tensor) else a for i, a in enumerate(inp.args))
    return args, inp.kwargs


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_a_repeated_call_runs_neither_the_contract_nor_the_decision(op, grad, no_tune, counted):
    decide.clear_cache()
    args, kwargs = _inputs(op, grad)
    public = getattr(tiered_ops, op)
    first = public(*args, **kwargs)
    assert counted["validate"] == (get_op(op).validate is not None) and counted["select"] >= 1
    before, keys = dict(counted), len(memo._calls)
    for _ in range(3):
        again = public(*args, **kwargs)
    assert counted == before and len(memo._calls) == keys  # every repeat hit the cached key
    for a, b in zip(tiered_ops.registry.as_outputs(first), tiered_ops.registry.as_outputs(again)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_cross_entropy_repeated_as_the_benchmark_calls_it_hits_the_cache(no_tune, counted, device):
    """benchmarks/dispatch_overhead.py's cross_entropy call (logits [rows, V], int64 targets, defaults): one
    validation and the first call's decisions, then the cached key on every call (on a GPU too, where the key holds
    the device index and the capture check runs)."""
    decide.clear_cache()
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    t = torch.randint(0, 64, (4,), device=device)
    with torch.no_grad():
        tiered_ops.cross_entropy(x, t)
        first = dict(counted)
        for _ in range(5):
            tiered_ops.cross_entropy(x, t)
    assert first["validate"] == 1 and counted == first
    assert [k[-2:] for k in memo._calls if k[0] == "cross_entropy"] == [(False, 0), (False, 1)]


def test_an_argument_the_key_holds_only_by_type_is_validated_when_its_type_changes(no_tune):
    """ignore_index and eps decide nothing, so their values stay out of the key; their types are in it, since the
    contract checks them: a bool ignore_index after an int one is refused, not run from the cache."""
    x, t = torch.randn(4, 64), torch.randint(0, 64, (4,))
    tiered_ops.cross_entropy(x, t, -100)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        tiered_ops.cross_entropy(x, t, True)
    w = torch.randn(64)
    tiered_ops.rms_norm(x, (64,), w, 1e-6)
    with pytest.raises(TypeError, match="eps must be a float"):
        tiered_ops.rms_norm(x, (64,), w, "1e-6")


class _ArrayLike:
    """Has what the hot path's key reads of a tensor (a shape and a dtype), and is not one."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), "float32"


@pytest.mark.parametrize("grad", [False, True])
def test_an_array_like_in_a_tensor_argument_is_named(no_tune, grad):
    x, w = torch.randn(4, 64), torch.randn(64)
    with torch.set_grad_enabled(grad):
        tiered_ops.rms_norm(x, (64,), w)
        with pytest.raises(TypeError, match="'weight' must be a torch.Tensor or None, got _ArrayLike"):
            tiered_ops.rms_norm(x, (64,), _ArrayLike(w))


# ---- a select_backend callable ------------------------------------------------------------------------------------

def test_a_selection_validates_each_signature_once(no_tune, counted):
    sel = tiered_ops.select_backend("rms_norm", (4, 64), torch.float32, "cpu", normalized_shape=(64,))
    x, w = torch.randn(4, 64), torch.randn(64)
    ref = get_op("rms_norm").reference
    for _ in range(4):
        torch.testing.assert_close(sel(x, (64,), w, 1e-6), ref(x, (64,), w, 1e-6))
    assert counted["validate"] == 1
    sel(torch.randn(8, 64), (64,), w, 1e-6)  # another signature: validated once more
    sel(torch.randn(8, 64), (64,), w, 1e-6)
    assert counted["validate"] == 2


def test_a_selection_refuses_a_call_that_does_not_fit_after_good_ones(no_tune):
    sel = tiered_ops.select_backend("rms_norm", (4, 64), torch.float32, "cpu", normalized_shape=(64,))
    x, w = torch.randn(4, 64), torch.randn(64)
    sel(x, (64,), w)
    with pytest.raises(ValueError, match="normalized_shape"):
        sel(x, (32,), torch.randn(32))
    with pytest.raises(ValueError, match="weight"):
        sel(x, (64,), torch.randn(32))
    with pytest.raises(TypeError, match="'weight' must be a torch.Tensor or None, got list"):
        sel(x, (64,), w.tolist())
    sel2 = tiered_ops.select_backend("softmax", (4, 64), torch.float32, "cpu")
    sel2(x)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16|dtype"):
        sel2(x.to(torch.int32))
    with pytest.raises(TypeError, match="'x' must be a torch.Tensor"):
        sel2([1.0, 2.0])


def test_a_selection_runs_its_implementation_unchecked_once_validated(no_tune, monkeypatch):
    """The call runs ``impl.unchecked`` (the checked ``impl.fn`` would validate every call)."""
    spec = get_op("softmax")
    impl = spec.impls["eager"]
    ran = []
    monkeypatch.setattr(impl, "unchecked", lambda *a, **k: ran.append(a) or torch.softmax(a[0], a[1]))
    sel = bound.bind(decide.Selection(impl.fn, impl, {"op": "softmax"}))  # as tiered_ops.select_backend returns it
    x = torch.randn(3, 5)
    torch.testing.assert_close(sel(x, -1), torch.softmax(x, -1))
    assert len(ran) == 1


def test_a_selection_of_no_catalogued_op_calls_its_fn():
    spec = get_op("softmax")
    sel = bound.bind(decide.Selection(lambda *a: "planted", spec.impls["eager"], {"op": "no_such_op"}))
    assert sel(torch.randn(2)) == "planted"
