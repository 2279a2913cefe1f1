"""How many guards ``tiered_ops.patch`` adds to a compiled model: dynamo evaluates every guard of a graph's cache
entry on each call of the compiled model, so a guard added by the call path is host time on every decode step.

A tiny Llama and a tiny Qwen3 (tests/test_patch.py's), compiled with ``backend="aot_eager", fullgraph=True`` and
called on one token, stock and patched. Two checks:

- what the trace of a call of ``tiered_ops.<op>`` decides is read by a function dynamo calls for real
  (``dispatch.trace_plan``), so no guard reads the op's declaration (``validate``, ``problem_of``, ``bucket``) or
  the signature helpers' tables (``_TENSOR_ARGS``, ``_POSITIONAL``): named sources, stable across torch versions;
- the guard lines of the patched graph (``str`` of each cache entry's guard tree, one guard or accessor a line)
  exceed the stock graph's by no more than ``EXTRA``. The tree's printed form can change with torch, but both
  variants change together: the difference is what the patch adds. ``scripts/diag/guard_count.py`` lists them;
- that difference does not grow with the model's depth (2 and 4 decoder layers): a guard a patched forward adds per
  module (its class read per module, a parameter's type) is paid once per layer, 36 times on a 36-layer model.
"""

import functools

import pytest
import torch

import tiered_ops

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
# patched minus stock guard lines, measured with torch 2.13 / transformers 5.24: 521 (Llama) and 536 (Qwen3) while
# the trace ran the call path's slow path; 224 and 230 with it read at trace time; 183 and 213 before the patched
# forwards' own checks stopped reading globals (dtype tuples, helpers, names of class attributes, the config's ints,
# the stock-traced Qwen3 attention's copied module globals, its projections read apart), 142 and 150 after; 134 and
# 144 with no guard per decoder layer (the norms' weights asked about through stand-ins, the original forwards held by
# the forwards made per class): a margin of ~8 %.
EXTRA = {"llama": 145, "qwen3": 155}
# patched minus stock guard lines per decoder layer, the same measure at 4 layers against 2, halved: 5 (Llama) and 7
# (Qwen3) before those two changes, 0 after
PER_LAYER = 0
READ_AT_TRACE_TIME = ("_TENSOR_ARGS", "_POSITIONAL", "'_SPEC'].validate", "'_SPEC'].problem_of", "'_SPEC'].bucket",
                      "_calls")
# what the patched forwards read as constants without a guard: the dtypes they take (read off the dtype), the names
# of their class attributes (spelled out), the Qwen3 attention's head counts (off the weights' shapes) and its
# stock-traced forward's globals (the modeling module's own, not a copy)
NOT_GUARDED = ("_DTYPES", "._BASE", "._ROUTED", "._STOCK_ROUTED", "original_class", "num_attention_heads",
               "num_key_value_heads", "_tiered_ops_own_norm")


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")


def _model(family: str, layers: int = 2) -> torch.nn.Module:
    t = transformers
    torch.manual_seed(0)
    small = dict(SMALL, num_hidden_layers=layers)
    if family == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**small)).eval()
    return t.Qwen3ForCausalLM(t.Qwen3Config(**small, head_dim=16)).eval()


@functools.lru_cache(maxsize=None)
def _guards(family: str, patched: bool, layers: int = 2) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The guard lines (comments left out) of the compiled model's one cache entry, its output and the stock
    model's output on the same token (made once per process: the compiles are the test's cost)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = _model(family, layers)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 1))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    if patched:
        tiered_ops.patch(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        compiled(ids, use_cache=False)
        got = compiled(ids, use_cache=False).logits
    entries = _debug_get_cache_entry_list(model.forward.__func__.__code__)
    assert len(entries) == 1, f"{len(entries)} cache entries: the second call recompiled"
    lines = [ln.split("  #")[0] for ln in str(entries[0].guard_manager).splitlines() if ln.strip()]
    return lines, got, want


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patched_graph_guards_few_more_than_stock(family):
    stock, _, _ = _guards(family, False, 2)
    patched, got, want = _guards(family, True, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    read = [ln.strip() for ln in patched if any(s in ln for s in READ_AT_TRACE_TIME + NOT_GUARDED)]
    assert not read, f"guards on what the trace should read as constants: {read[:5]}"
    extra = len(patched) - len(stock)
    assert extra <= EXTRA[family], (
        f"{family}: the patched graph carries {extra} guard lines more than stock's {len(stock)} (bound "
        f"{EXTRA[family]}); scripts/diag/guard_count.py --model {family} lists them")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patched_guards_not_per_layer(family):
    """The patched graph's guards over stock's are the same at 4 decoder layers as at 2 (within ``PER_LAYER`` a
    layer): what a patched forward reads of its module is read once per class, not per module."""
    extra = {}
    for layers in (2, 4):
        stock, _, _ = _guards(family, False, layers)
        patched, got, want = _guards(family, True, layers)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        extra[layers] = len(patched) - len(stock)
    assert extra[4] - extra[2] <= 2 * PER_LAYER, (
        f"{family}: {extra[2]} guard lines over stock at 2 layers, {extra[4]} at 4: {(extra[4] - extra[2]) / 2} a "
        f"layer (bound {PER_LAYER}); scripts/diag/guard_count.py --model {family} --layers 4 lists them")


def test_taken_dtypes_read_off_the_dtype():
    """The patched forwards ask ``dt.is_floating_point and dt.itemsize in (2, 4)`` for ``dt in TAKEN`` (no global
    read, so no guard): the two agree on every dtype this torch has."""
    from tiered_ops.models.patch_layers import TAKEN

    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert set(TAKEN) <= dtypes
    for dt in dtypes:
        assert (dt.is_floating_point and dt.itemsize in (2, 4)) == (dt in TAKEN), dt


def test_patched_forwards_refuse_other_dtypes_eagerly():
    """A float64 model runs the original forwards (the dtype check read off the dtype refuses it), the output
    stock's bit for bit."""
    model = _model("qwen3").double()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 5))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        tiered_ops.patch(model)
        got = model(ids, use_cache=False).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_refused_traced_call_raises_its_own_error():
    """The slow path a trace runs outside the trace refuses a call the same way: compiled without fullgraph, the
    caller sees the contract's own error (the call is traced again through ``dispatch``, whose raise dynamo passes on
    after falling back), not dynamo's internal error."""
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    f = torch.compile(lambda t: tiered_ops.rms_norm(t, (32,)), backend="aot_eager")
    with pytest.raises(ValueError, match="normalized_shape"):
        f(x)
    g = torch.compile(lambda t: tiered_ops.rms_norm(t.double(), (64,)), backend="aot_eager")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        g(x)
