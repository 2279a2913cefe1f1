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
