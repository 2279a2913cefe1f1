"""The per-call key read in C++ (cuda_src/call_key.cpp): built here as a CPU extension of that file alone (its CUDA
part compiled out), then used by tiered_ops.<op> and select_backend callables as the CUDA extension's load does.

What must hold: calls that differ in anything the Python key reads (or grad mode, or requires_grad) get different
keys; calls that differ in nothing get equal keys; an argument it does not encode gives None (the Python key decides);
and the public function and a select_backend callable are served by it after their first call, with the op's
contract still checked on a new signature."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import tiered_ops
from tiered_ops.runtime import dispatch, memo
from tiered_ops.runtime.memo import _calls, _hot
from tiered_ops.tiers import cuda_ext


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    if shutil.which("g++") is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("needs g++ and Python's headers")
    return cuda_ext.build_call_key_cpu(tmp_path_factory.mktemp("call_key"))


@pytest.fixture(scope="module")
def call_key(extension):
    return extension.call_key


@pytest.fixture
def in_use(extension, private_decisions):
    before = dispatch._ckey, dispatch._cached, dispatch._fast, dispatch._python_key
    dispatch.use_call_key(extension.call_key, extension.call_cached, extension.fast_path)
    try:
        yield extension.call_key
    finally:  # as before: a later test (the CUDA extension's) loads its own key where none was asked for
        dispatch.use_call_key(*before[:3])
        dispatch._python_key = before[3]


def _x(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


pytestmark = pytest.mark.slow  # one C++ build (~45 s on two cores)


def test_every_difference_the_python_key_sees_is_a_different_key(call_key):
    x, w = _x(4, 64), _x(64)
    base = ("rms_norm", x, (64,), w, 1e-6, 0.0, False)
    variants = [
        ("layer_norm", x, (64,), w, 1e-6, 0.0, False),  # the op
        ("rms_norm", _x(5, 64), (64,), w, 1e-6, 0.0, False),  # a shape
        ("rms_norm", _x(4, 64, dtype=torch.bfloat16), (64,), w, 1e-6, 0.0, False),  # a dtype
        ("rms_norm", _x(4, 64).to("meta"), (64,), w, 1e-6, 0.0, False),  # a device
        ("rms_norm", _x(4, 64, grad=True), (64,), w, 1e-6, 0.0, False),  # requires_grad
        ("rms_norm", _x(256), (64,), w, 1e-6, 0.0, False),  # the same numel, another rank
        ("rms_norm", x, (4, 64), w, 1e-6, 0.0, False),  # a normalized_shape
        ("rms_norm", x, 64, w, 1e-6, 0.0, False),  # an int where a tuple was
        ("rms_norm", x, (64,), None, 1e-6, 0.0, False),  # None where a tensor was
        ("rms_norm", x, (64,), w, None, 0.0, False),  # None where a float was
        ("rms_norm", x, (64,), w, 1, 0.0, False),  # an int where a float was (equal hashes in Python)
        ("rms_norm", x, (64,), w, True, 0.0, False),  # a bool
        ("rms_norm", x, (64,), w, 1e-5, 0.0, False),  # a float's value
        ("rms_norm", x, (64,), w, 1e-6, 1.0, False),
        ("rms_norm", x, (64,), w, 1e-6, 0.0, True),
        ("rms_norm", x, (64,), w, 1e-6, 0.0),  # one argument fewer
        ("rms_norm", x, (64,), w, 1e-6, 0.0, False, torch.float32),  # a dtype argument more
    ]
    keys = [call_key(*base)] + [call_key(*v) for v in variants]
    assert None not in keys
    assert len(set(keys)) == len(keys)
    with torch.no_grad():
        assert call_key(*base) != keys[0]  # grad mode
    assert call_key("softmax", x, -1) != call_key("softmax", x, -2)  # -1 and -2 hash alike in Python
    assert call_key("cross_entropy", x, None, torch.float32) != call_key("cross_entropy", x, None, torch.bfloat16)
    assert call_key("cross_entropy", x, "mean") != call_key("cross_entropy", x, "sum")


def test_the_same_signature_is_the_same_key(call_key):
    a = call_key("rms_norm", _x(4, 64), (64,), _x(64), 1e-6, 0.0, False)
    b = call_key("rms_norm", _x(4, 64), [64], torch.nn.Parameter(_x(64), requires_grad=False), 1e-6, 0.0, False)
    c = call_key("rms_norm", _x(64, 4).t(), torch.Size([64]), _x(64), 1e-6, 0.0, False)  # strides are not read
    assert a == b == c


@pytest.mark.parametrize("arg", [np.float64(1e-6), object(), 2 ** 70, [64, "a"], {"eps": 1},
                                 torch.randn(4).to_sparse()],
                         ids=["numpy-float", "object", "big-int", "mixed-list", "dict", "sparse"])
def test_what_it_does_not_encode_gives_none(call_key, arg):
    assert call_key("rms_norm", _x(4, 64), (64,), _x(64), arg) is None


def test_traced_tensors_give_none(call_key):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(_x(4, 64))
    assert call_key("softmax", fake, -1) is None  # a fake tensor (export, a trace): the Python key reads the context
    assert call_key("softmax", _x(4, 64), -1) is not None


def test_call_cached_calls_what_its_table_holds_by_position_and_name(extension):
    seen = []

    def fn(x, dim=0, *, half=False):
        seen.append((dim, half))
        return x

    x, table = _x(4, 64), {}
    key = extension.call_cached(table, ("half",), "softmax", x, -1, True)
    assert key == extension.call_key("softmax", x, -1, True) and not seen  # a miss: the key, nothing called
    table[key] = fn
    assert extension.call_cached(table, ("half",), "softmax", _x(4, 64), -1, True) is not None
    assert extension.call_cached(table, (), "softmax", x, -1) == extension.call_key("softmax", x, -1)
    assert seen == [(-1, True)]
    assert extension.call_cached(table, (), "softmax", x, object()) is None  # no key
    with pytest.raises(TypeError, match="kwnames"):
        extension.call_cached(table, ("a", "b", "c"), "softmax", x)
    table[key] = lambda *a, **k: 1 / 0
    with pytest.raises(ZeroDivisionError):  # the function's own error comes through
        extension.call_cached(table, ("half",), "softmax", x, -1, True)


def test_the_public_function_is_served_by_it_after_its_first_call(in_use, monkeypatch):
    x, w = _x(4, 64), _x(64)
    expect = tiered_ops.get_op("rms_norm").reference(x.double(), (64,), w.double(), 1e-6)
    with torch.no_grad():
        first = tiered_ops.rms_norm(x, (64,), w, 1e-6)
        assert list(_hot), "the first call learned no C++ key"
        for k in [k for k in _calls if isinstance(k, tuple) and k[0] == "rms_norm"]:
            del _calls[k]  # the Python key gone: a second call reaching it would dispatch again

        def no_dispatch(*a, **k):
            raise AssertionError("the C++ key missed")

        monkeypatch.setitem(tiered_ops.rms_norm.__globals__, "_dispatch", no_dispatch)
        second = tiered_ops.rms_norm(_x(4, 64), (64,), w, 1e-6)
    torch.testing.assert_close(first.double(), expect, atol=1e-5, rtol=1e-5)
    assert second.shape == (4, 64)


def test_a_new_signature_is_still_checked(in_use):
    x, w = _x(4, 64), _x(64)
    tiered_ops.rms_norm(x, (64,), w, 1e-6)
    with pytest.raises(TypeError, match="weight"):
        tiered_ops.rms_norm(x, (64,), 3, 1e-6)  # an int where the weight goes: a key, but a new one
    with pytest.raises(ValueError, match="normalized_shape"):
        tiered_ops.rms_norm(x, (32,), w, 1e-6)
    with pytest.raises(TypeError, match="weight"):
        tiered_ops.rms_norm(x, (64,), 3, 1e-6)  # nothing was cached for it


def test_a_select_backend_callable_uses_it(in_use):
    sel = tiered_ops.select_backend("softmax", (4, 64), torch.float32, "cpu", dim=-1)
    x = _x(4, 64)
    torch.testing.assert_close(sel(x, -1).double(), torch.softmax(x.double(), -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sel(x, 0).double(), torch.softmax(x.double(), 0), atol=1e-6, rtol=1e-6)
    with pytest.raises(TypeError, match="x"):
        sel([1.0], -1)


def test_a_trace_reads_no_cpp_key(in_use):
    """dynamo reads the C++ call as one that finds nothing: a traced call takes the Python key (the compiled
    context), with no graph break, even where the eager call of the same signature is cached in C++."""
    x = _x(4, 64)
    sel = tiered_ops.select_backend("softmax", (4, 64), torch.float32, "cpu", dim=-1)
    tiered_ops.softmax(x, -1), sel(x, -1)  # cached under their C++ keys
    assert list(_hot)
    # the compiled context's selection planted apart from the eager one: three times the softmax
    from tiered_ops.decide import decide
    from tiered_ops.runtime.hot import _TRACE_FNS

    key = next(k for k in _calls if k[0] == "softmax" and k[-1] == 1)
    impl = dataclasses.replace(_calls[key].impl, unchecked=lambda t, dim: 3 * torch.softmax(t, dim))
    _calls[key] = decide.Selection(impl.unchecked, impl, _calls[key].record)
    memo._traced[key] = "softmax:planted"  # what a trace of the signature calls, by name
    _TRACE_FNS["softmax:planted"] = impl.unchecked
    traced = torch.compile(lambda t: tiered_ops.softmax(t, -1) + sel(t, -1), fullgraph=True, backend="eager")
    torch.testing.assert_close(traced(x).double(), 4 * torch.softmax(x.double(), -1), atol=1e-6, rtol=1e-6)
    assert [k[-1] for k in _calls if k[0] == "softmax"] == [0, 1]  # the eager call cached both; the trace nothing


def test_a_trace_compiles_once_with_the_cpp_key_in_use(in_use):
    """The hot path asks whether to try the C++ key in a way dynamo folds: a trace guards no flag of torch.compiler,
    so the compiled caller's next calls run its graph (a guard on the flag's value while tracing failed at each call
    where dynamo sets it: a recompile per call)."""
    from torch._dynamo.utils import counters

    x = _x(4, 64)
    tiered_ops.softmax(x, -1)  # decided and cached under its C++ key

    def caller(t):
        return tiered_ops.softmax(t, -1) * 2

    torch._dynamo.reset()
    counters.clear()
    traced = torch.compile(caller, fullgraph=True, backend="eager")
    for _ in range(4):
        torch.testing.assert_close(traced(x), 2 * torch.softmax(x, -1))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["recompiles"])


def _caller_of_planted(op, args, where):
    """Plant a function under the C++ key of ``op(*args)`` (grad off) in ``where``; it records its caller's code."""
    callers = []

    def planted(*a, **k):
        callers.append(sys._getframe(1).f_code.co_filename)
        return a[0]

    names = list(inspect.signature(tiered_ops.get_op(op).reference).bind(*args).arguments)
    bound = inspect.signature(tiered_ops.get_op(op).reference).bind(*args)
    bound.apply_defaults()
    with torch.no_grad():
        where[dispatch._ckey(op, *bound.arguments.values())] = planted
    return callers, names


def test_a_hit_runs_no_python_frame_of_the_public_function(in_use, extension):
    """The C fast path (a vectorcall of the generated function) binds positional, keyword and default arguments as
    the function does and calls what the C++ key finds with no frame of its own; without it, the function's frame
    calls it."""
    x, w = _x(4, 64), _x(64)
    callers, _ = _caller_of_planted("rms_norm", (x, (64,), w, None), _hot)
    this = sys._getframe().f_code.co_filename
    with torch.no_grad():
        # star-calls: before Python 3.12 a plain call from Python code runs the function's code whatever its
        # vectorcall (the same path, slower); a call through C takes the fast path on every version
        for a, k in (((x, (64,), w), {}), ((x,), dict(normalized_shape=(64,), weight=w)),
                     ((x, (64,), w, None), dict(weight_offset=0.0, cast_before_weight=False))):
            assert tiered_ops.rms_norm(*a, **k) is x
        assert callers == [this] * 3, callers
        dispatch.use_call_key(extension.call_key, extension.call_cached)  # no fast path: the function's frame
        callers_then, _ = _caller_of_planted("rms_norm", (x, (64,), w, None), _hot)
        tiered_ops.rms_norm(*(x,), **dict(normalized_shape=(64,), weight=w))
        assert callers_then == ["<tiered_ops.rms_norm>"], callers_then


@pytest.mark.parametrize("op", ["softmax", "rms_norm", "layer_norm", "gelu", "muladd", "cross_entropy",
                                "fused_add_rms_norm", "segment_sum"])
def test_a_hit_with_every_default_omitted(in_use, op):
    """The fast path encodes each op's defaults once (int, float, str, None, bool): a call that omits them all hits
    the function planted under the key of the same call with every default given."""
    spec = tiered_ops.get_op(op)
    inp = spec.make_inputs(spec.edge_problems()[0], torch.float32, torch.device("cpu"), 0)
    required = [p for p in inspect.signature(spec.reference).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind != p.KEYWORD_ONLY]
    a = tuple(inp.args[:len(required)])
    callers, _ = _caller_of_planted(op, a, _hot)
    with torch.no_grad():
        assert getattr(tiered_ops, op)(*a) is a[0]
    assert callers == [sys._getframe().f_code.co_filename], callers


@pytest.mark.parametrize("call", [
    lambda x, w: tiered_ops.rms_norm(x, (64,), w, None, 0.0),  # a keyword-only argument given by position
    lambda x, w: tiered_ops.rms_norm(x, (64,), w, bogus=1),
    lambda x, w: tiered_ops.rms_norm(x, (64,), w, weight=w),
    lambda x, w: tiered_ops.rms_norm(x),
    lambda x, w: tiered_ops.rms_norm(x=x, normalized_shape=(64,), weight=w, eps=None, weight_offset=0.0,
                                     cast_before_weight=False, extra=1),
], ids=["kwonly-by-position", "unknown-keyword", "twice", "missing", "one-too-many"])
def test_arguments_that_do_not_bind_get_pythons_error(in_use, call):
    x, w = _x(4, 64), _x(64)
    with torch.no_grad():
        tiered_ops.rms_norm(x, (64,), w)  # cached: a miss is not why it fails
        with pytest.raises(TypeError, match="argument"):
            call(x, w)


def test_a_select_backend_callable_hit_runs_no_python_frame(in_use):
    sel = tiered_ops.select_backend("softmax", (4, 64), torch.float32, "cpu", dim=-1)
    x = _x(4, 64)
    callers, _ = _caller_of_planted("softmax", (x, -1), sel._seen)
    with torch.no_grad():  # the key's grad mode
        assert sel(x, -1) is x and sel(x, dim=-1) is x and sel(x) is x
    assert callers == [sys._getframe().f_code.co_filename] * 3, callers


def _planted(result):
    return lambda *a, **k: result


def test_a_changed_table_is_never_served_from_a_stale_hit(in_use):
    """The fast path keeps hits in a C-side cache (Python 3.12+, kept exact by dict watchers): a function replaced
    under its key, the key deleted, the table cleared, each is seen by the next call; a select_backend callable's
    table likewise, and its table rebound, or the callable freed and another made (its hits are cached by callable).
    (Star-calls: before 3.12 only a call through C takes the fast path.)"""
    if dispatch._fast is None:
        pytest.skip("no C fast path with this torch (no torch.compiler._is_compiling_flag)")
    x, w = _x(4, 64), _x(64)
    a = (x, (64,), w)
    with torch.no_grad():
        key = dispatch._ckey("rms_norm", x, (64,), w, None, 0.0, False)
        _hot[key] = _planted("first")
        assert [tiered_ops.rms_norm(*a) for _ in range(3)] == ["first"] * 3
        _hot[key] = _planted("second")
        assert tiered_ops.rms_norm(*a) == "second"
        del _hot[key]
        assert isinstance(tiered_ops.rms_norm(*a), torch.Tensor)  # a miss: the Python path decides, caches again
        _hot[key] = _planted("third")
        assert tiered_ops.rms_norm(*a) == "third"
        _hot.clear()
        assert isinstance(tiered_ops.rms_norm(*a), torch.Tensor)
        _hot.update({key: _planted("fourth")})
        assert tiered_ops.rms_norm(*a) == "fourth"
        sel = tiered_ops.select_backend("softmax", (4, 64), torch.float32, "cpu", dim=-1)
        skey = dispatch._ckey("softmax", x, -1)
        sel._seen[skey] = _planted("one")
        assert [sel(*(x, -1)) for _ in range(2)] == ["one"] * 2
        sel._seen[skey] = _planted("two")
        assert sel(*(x, -1)) == "two"
        kept = sel._seen  # the old table stays alive: no event on it; the callable's own attributes are watched
        sel._seen = {skey: _planted("three")}
        assert sel(*(x, -1)) == "three" and kept[skey]() == "two"
        made = type(sel), sel.fn, sel.impl, sel.record
        del sel, kept  # a callable freed: one made next (often at the same address) is served its own table
        at = []
        for result in ("four", "five", "six"):
            sel = made[0](*made[1:])
            sel._seen[skey] = _planted(result)
            assert [sel(*(x, -1)) for _ in range(2)] == [result] * 2
            at.append(id(sel))
            del sel


def test_the_compiling_flag_is_read_on_every_call(in_use, monkeypatch):
    """While torch.compiler's flag says a trace runs, a hit is not served from the C side (the function's own code
    decides, in the compiled context); once it is False again, it is."""
    if dispatch._fast is None:
        pytest.skip("no C fast path with this torch (no torch.compiler._is_compiling_flag)")
    x = _x(4, 64)
    with torch.no_grad():
        tiered_ops.softmax(x, -1)
        _hot[dispatch._ckey("softmax", x, -1)] = _planted("hit")
        assert tiered_ops.softmax(*(x, -1)) == "hit"
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
        assert isinstance(tiered_ops.softmax(*(x, -1)), torch.Tensor)
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
        assert tiered_ops.softmax(*(x, -1)) == "hit"


@pytest.mark.gpu
def test_the_cuda_extension_keys_calls_and_steps_aside_in_a_capture():
    from tiered_ops.tiers import cuda_ext

    dev = torch.device("cuda")
    assert cuda_ext.load(dev) is None
    assert dispatch._ckey is not None and dispatch._ckey is cuda_ext.pybind_function("call_key")
    x = torch.randn(8, 256, device=dev)
    assert dispatch._ckey("softmax", x, -1) is not None
    assert dispatch._ckey("softmax", x, -1) != dispatch._ckey("softmax", x.cpu(), -1)
    seen = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            tiered_ops.softmax(x, -1)  # warm-up, as torch's recipe has it
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            seen.append(dispatch._ckey("softmax", x, -1))
            y = tiered_ops.softmax(x, -1)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert seen == [None]  # inside the capture the Python key decides (the capture context)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), atol=1e-6, rtol=1e-6)


def test_under_background_tuning_a_first_cuda_call_does_not_wait_for_the_extension(monkeypatch):
    """The C++ key's extension loads on a thread of its own under background tuning (the first call returns while
    it loads); with tuning blocking or off it loads on the call, as before."""
    import threading
    import time

    from tiered_ops.decide import decide as select
    from tiered_ops.tiers import cuda_ext

    started, release, loads = threading.Event(), threading.Event(), []

    def slow_load(device):
        loads.append((device, threading.current_thread().name))
        started.set()
        return release.wait(30)

    monkeypatch.setattr(cuda_ext, "load_if_built", slow_load)
    dev = torch.device("cuda", 0)
    select.set_tuning("background")
    try:
        t0 = time.perf_counter()
        t = dispatch.load_call_key(dev)
        assert t is not None and t.daemon and started.wait(10) and time.perf_counter() - t0 < 5
        assert t.is_alive() and loads == [(dev, "tiered_ops-load-extension")], loads
        release.set()
        t.join(10)
        select.set_tuning("off")
        assert dispatch.load_call_key(dev) is None and loads[-1] == (dev, threading.current_thread().name)
    finally:
        release.set()
        select.set_tuning(None)
