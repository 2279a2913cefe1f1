"""The peers (tiered_ops/tiers/peers.py): which ops each covers, why one cannot run here, and that what a peer does
not support is refused before its library is imported. Their kernels run on the GPU only (the sweep gates and times
them there)."""

from pathlib import Path

import pytest
import torch

from tiered_ops.registry import Tier
from tiered_ops.tiers import peers
from tiered_ops.tiers.catalog import all_ops, get_op


def test_each_peer_covers_its_ops_and_nothing_else():
    for name, table in (("liger", peers.LIGER_OPS), ("quack", peers.QUACK_OPS)):
        covered = {s.name for s in all_ops() if name in s.impls}
        assert covered == set(table), name
        for op in covered:
            impl = get_op(op).impls[name]
            assert impl.tier == Tier.PEER and impl.devices == ("cuda",)
    assert peers.register() == []  # registered once, by the catalog


def test_a_peer_says_why_it_cannot_run_here(monkeypatch):
    impl = get_op("softmax").impls["quack"]
    assert impl.why_not(torch.device("cpu")) == "runs on cuda only, not cpu"
    assert peers.quack_available(torch.device("cpu")) == "quack runs on CUDA devices only"
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert peers.quack_available(torch.device("cuda")).startswith("quack is not installed")
    assert peers.liger_available(torch.device("cuda")).startswith("liger_kernel is not installed")
    for op in ("swiglu", "rotary_embedding"):
        impl = get_op(op).impls["liger"]
        assert impl.why_not(torch.device("cpu")) == "runs on cuda only, not cpu"
        assert impl.why_not(torch.device("cuda")).startswith("liger_kernel is not installed (a peer: pip install")


@pytest.mark.parametrize("call, match", [
    (lambda: peers._quack_softmax(torch.randn(4, 5), dim=0), "the last dim only"),
    (lambda: peers._quack_cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), label_smoothing=0.1),
     "no label smoothing"),
    (lambda: peers._quack_rms_norm(torch.randn(4, 5, 6), (5, 6)),
     r"rms_norm \(quack peer\): a single normalized dim only"),
    (lambda: peers._quack_fused_add_rms_norm(torch.randn(4, 6), torch.randn(4, 6), (2, 3)),
     "a single normalized dim only"),
])
def test_what_quack_does_not_support_is_refused_before_it_is_imported(call, match):
    with pytest.raises(NotImplementedError, match=match):  # not ImportError: quack is not installed here
        call()


def _rope_inputs(head_dim=8, cos_dtype=torch.float32, repeat=True):
    q, k = torch.randn(1, 2, 3, head_dim).transpose(1, 2), torch.randn(1, 3, 1, head_dim).transpose(1, 2)
    half = torch.randn(1, 3, 4, dtype=cos_dtype)
    cos = torch.cat((half, half if repeat else half + 1), dim=-1)
    return q, k, cos, cos.clone()


@pytest.mark.parametrize("fn", [peers._liger_swiglu, peers._liger_swiglu_on_copies])
@pytest.mark.parametrize("args, match", [
    ((torch.randn(4, 5), torch.randn(4, 5), "gelu"), "silu and gelu_tanh only, got activation='gelu'"),  # erf GeGLU
    ((torch.randn(2, 65537), torch.randn(2, 65537), "silu"), r"a last dim of 1..65536 only"),  # over one row's block
    ((torch.randn(()), torch.randn(()), "gelu_tanh"), r"a last dim of 1..65536 only .* got shape \[\]"),
])
def test_what_liger_s_swiglu_does_not_claim_is_refused_before_it_is_imported(fn, args, match):
    with pytest.raises(NotImplementedError, match=r"swiglu \(Liger peer\): " + match):
        fn(*args)


@pytest.mark.parametrize("fn", [peers._liger_rotary_embedding, peers._liger_rotary_embedding_on_copies])
@pytest.mark.parametrize("inputs, match", [
    (lambda: _rope_inputs(cos_dtype=torch.float64), "cos and sin of q's dtype torch.float32 only"),  # torch promotes
    (lambda: _rope_inputs(head_dim=9), "an even head_dim only, got 9"),
])
def test_what_liger_s_rope_does_not_claim_is_refused_before_it_is_imported(fn, inputs, match):
    with pytest.raises(NotImplementedError, match=r"rotary_embedding \(Liger peer\): " + match):
        fn(*inputs())


def test_liger_s_rope_checked_call_refuses_cos_whose_halves_differ():
    """Liger reads the first half of cos and sin (transformers repeats the halves); the checked call says so rather
    than answer with other semantics. The timed call runs on the inputs factory's, whose halves repeat."""
    with pytest.raises(NotImplementedError, match="cos and sin whose halves repeat only"):
        peers._liger_rotary_embedding_on_copies(*_rope_inputs(repeat=False))
    spec = get_op("rotary_embedding")
    for seed in (0, 1):
        _, _, cos, sin = spec.make_inputs(spec.problem((2, 4, 9, 64), kv_heads=2, rotary_dim=32), torch.float32,
                                          torch.device("cpu"), seed).args
        assert torch.equal(cos[..., :16], cos[..., 16:]) and torch.equal(sin[..., :16], sin[..., 16:])


def test_liger_s_swiglu_and_rope_are_checked_on_copies_and_timed_as_a_model_runs_them():
    """Both write over their inputs (SwiGLU's backward over gate and up, RoPE over q and k): the gate calls the
    version that gives Liger copies, the timing the one that runs Liger as it is (Impl.unchecked)."""
    for op, checked, timed in (("swiglu", peers._liger_swiglu_on_copies, peers._liger_swiglu),
                               ("rotary_embedding", peers._liger_rotary_embedding_on_copies,
                                peers._liger_rotary_embedding)):
        impl = get_op(op).impls["liger"]
        assert (impl.fn, impl.unchecked, impl.tier, impl.devices) == (checked, timed, Tier.PEER, ("cuda",))
    assert all(get_op(op).impls["liger"].unchecked is None for op in peers.LIGER_OPS if op not in peers.LIGER_TIMED)


def test_a_peer_s_source_hash_covers_its_installed_files_and_nothing_when_absent():
    import pandas

    assert peers._package_files("pandas", ("__init__", "no_such_module")) == (Path(pandas.__file__),)
    assert peers._package_files("no_such_package_here", ("x",)) == ()


def test_a_sweep_where_a_peer_is_not_installed_keeps_its_earlier_rows(private_store, monkeypatch):
    """A sweep resumed on a machine without a peer's package keeps the peer's rows measured where it was installed
    instead of storing "not installed" rows over them; where nothing of it is stored, the reason is stored as before."""
    from tiered_ops.measure.fingerprint import fingerprint
    from tiered_ops.measure.measure import base_row
    from tiered_ops.store.store import Store
    from tiered_ops.sweep.bench import sweep

    cpu = torch.device("cpu")
    spec = get_op("softmax")
    monkeypatch.setattr(spec, "impls", {k: spec.impls[k] for k in ("eager", "liger")})
    kept, fresh = spec.problem((8, 64)), spec.problem((4, 32))
    store = Store(private_store)
    earlier = dict(base_row(spec, spec.impls["liger"], kept, torch.float32, "fwd_nograd", fingerprint(cpu)),
                   ok=1, p20_us=9.0, p50_us=10.0, p80_us=11.0, caller_us=10.0, source_hash="installed")
    store.add([earlier])
    said = []
    sweep([spec], {"softmax": [kept, fresh]}, [torch.float32], cpu, store, progress=False, log=said.append,
          modes=["fwd_nograd"], cost_metadata=False)
    liger = [r for r in store.rows(op="softmax", impl="liger")]
    assert [(r["problem"], r["ok"]) for r in liger if r["problem"] == str(kept)] == [(str(kept), 1)]
    assert [r["reason"] for r in liger if r["problem"] == str(fresh)] == ["unavailable: runs on cuda only, not cpu"]
    assert any("liger: runs on cuda only, not cpu; its rows stored where it was installed are kept" in s for s in said)
