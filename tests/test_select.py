"""select_backend's decisions with tuning off and its per-call fast path."""

import pytest
import torch

import tiered_ops
from tiered_ops.decide import decide as sel_mod
from tiered_ops.measure.measure import measure
from tiered_ops.registry import Impl, Tier
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


def _right_in_bf16_wrong_in_fp16(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    y = torch.softmax(x, dim)
    return y * 1.5 if x.dtype == torch.float16 else y


def _timed_rows(spec, problem, figures, dtype=torch.float32):
    """Each implementation measured (gated) at ``problem``, its times set to the figure given."""
    rows = []
    for impl, us in figures:
        r = measure(spec, spec.impls[impl], problem, dtype, CPU)
        assert r["ok"] == 1, r["reason"]
        r.update(p50_us=us, host_us=us, caller_us=us, gbps=1.0)
        rows.append(r)
    return rows


def test_tuning_off_never_returns_an_implementation_ungated_at_the_requested_dtype(private_store, monkeypatch):
    """Nothing stored in fp16; bf16 has a bucket where a planted implementation (correct in bf16, wrong in fp16) is
    the fastest. Tuning off reads the bf16 decision for an fp16 request: the planted one must be gated at fp16
    first, fail there, and give way to the next fastest that passes; the record says which and why."""
    spec = get_op("softmax")
    plant = Impl("plant_fp16", Tier.TRITON, _right_in_bf16_wrong_in_fp16, (spec.source,))
    monkeypatch.setitem(spec.impls, "plant_fp16", plant)
    # the plant passes the gate in bf16 (_timed_rows asserts each row correct)
    Store(private_store).add(_timed_rows(spec, spec.problem((8, 64)),
                                         (("plant_fp16", 1.0), ("compile", 3.0), ("eager", 5.0)), torch.bfloat16))
    sel_mod.set_tuning(False)
    try:
        bf16 = tiered_ops.select_backend("softmax", (8, 100), "bf16", "cpu")
        fp16 = tiered_ops.select_backend("softmax", (8, 100), "fp16", "cpu")
    finally:
        sel_mod.set_tuning(None)
    assert bf16.name == "plant_fp16"  # gated at bf16 already: read from the nearest bf16 bucket as it is
    assert fp16.name == "compile"
    assert "plant_fp16 failed the gate at fp16" in fp16.record["reason"] and "(bf16)" in fp16.record["reason"]
    x = torch.randn(8, 100, dtype=torch.float16)
    torch.testing.assert_close(fp16(x, -1), torch.softmax(x, -1))


def test_tuning_off_scales_bandwidth_bound_buckets_from_the_devices_launch_latency(private_store):
    """An implementation measured only where its kernels are bandwidth-bound has no latency of its own: the device's
    shortest kernel (any op, any tier) stands for it, and its time at a smaller shape is scaled by the bytes. Taking
    its shortest bandwidth-bound kernel as the latency predicted compile at 2x4096 at most of its 16x4096 time."""
    spec = get_op("softmax")
    rows = []
    # (problem, {impl: (host us, kernel us)}): eager measured launch-bound at 8x64, compile only at bandwidth-bound
    # buckets, where it moves bytes 1.5x eager's speed
    for shape, figures in (((8, 64), {"eager": (1.0, 1.0)}),
                           ((16, 4096), {"eager": (1.0, 30.0), "compile": (2.0, 20.0)}),
                           ((64, 4096), {"compile": (2.0, 80.0)})):
        problem = spec.problem(shape)
        nbytes = spec.mode_bytes(problem, torch.float32, "fwd_nograd")
        base = measure(spec, spec.impls["eager"], problem, torch.float32, CPU)
        for impl, (host, kernel) in figures.items():
            rows.append(dict(base, impl=impl, tier=impl, ok=1, reason=None, p50_us=kernel, host_us=host,
                             caller_us=max(host, kernel), gbps=nbytes / kernel / 1e3))
    Store(private_store).add(rows)
    sel_mod.set_tuning(False)
    try:
        sel = tiered_ops.select_backend("softmax", (2, 4096), "fp32", "cpu")
    finally:
        sel_mod.set_tuning(None)
    got = {c["impl"]: c["caller_us"] for c in sel.record["candidates"]}
    # the device's launch latency is eager's 1.0 us; 2x4096 moves an eighth of 16x4096's bytes
    assert got["eager"] == pytest.approx(1.0 + 29.0 / 8) and got["compile"] == pytest.approx(1.0 + 19.0 / 8)
    assert sel.name == "compile" and "[16,4096,true]" in sel.record["reason"]


def _wrong_when_summed(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)
    return loss * 1.5 if reduction == "sum" and logits.shape[0] == 16 else loss  # right at every edge problem


def test_tuning_off_reads_a_bucket_of_another_variant_and_gates_its_choice_there(private_store, monkeypatch):
    """Only reduction "mean" is measured; a reduction "sum" call with tuning off reads the nearest "mean" bucket (a
    named variant: the same kernel with another epilogue) instead of falling back to eager, and gates the choice at
    the requested problem first: a plant wrong there (and right at every edge problem) is struck, the next fastest
    chosen. A bool flag apart (label smoothing on) is still not read from those buckets."""
    spec = get_op("cross_entropy")
    plant = Impl("plant_sum", Tier.TRITON, _wrong_when_summed, (spec.source,))
    monkeypatch.setitem(spec.impls, "plant_sum", plant)
    Store(private_store).add(_timed_rows(spec, spec.problem((8, 64), reduction="mean"),
                                      (("plant_sum", 1.0), ("compile", 3.0), ("eager", 5.0))))
    sel_mod.set_tuning(False)
    try:
        mean = tiered_ops.select_backend("cross_entropy", (16, 64), "fp32", "cpu", reduction="mean")
        summed = tiered_ops.select_backend("cross_entropy", (16, 64), "fp32", "cpu", reduction="sum")
        smoothed = tiered_ops.select_backend("cross_entropy", (16, 64), "fp32", "cpu", reduction="mean",
                                             label_smoothing=0.1)
    finally:
        sel_mod.set_tuning(None)
    assert mean.name == "plant_sum" and "(other flags)" not in mean.record["reason"]
    assert summed.name == "compile", summed.record["reason"]
    assert "(other flags)" in summed.record["reason"] and "plant_sum failed the gate at fp32" in summed.record["reason"]
    assert smoothed.name == "eager" and "no stored decision" in smoothed.record["reason"]
    logits, target = torch.randn(16, 64), torch.randint(0, 64, (16,))
    torch.testing.assert_close(summed(logits, target, -100, "sum"),
                               torch.nn.functional.cross_entropy(logits, target, reduction="sum"))


def test_select_backend_fast_path_keys_on_the_resolved_device(monkeypatch):
    """device=None means the current device: after the current device changes, the decision is made for the new
    one, not returned from the fast path of the old one."""
    current = [torch.device("cuda", 0)]
    seen = []
    monkeypatch.setattr(sel_mod, "default_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CUDA devices named, never touched
    monkeypatch.setattr(sel_mod, "select_problem", lambda spec, problem, dtype, dev, *a, **k: seen.append(dev) or dev)
    sel_mod.clear_cache()
    try:
        first = tiered_ops.select_backend("softmax", (4, 8), "fp32")
        current[0] = torch.device("cuda", 1)
        second = tiered_ops.select_backend("softmax", (4, 8), "fp32")
        again = tiered_ops.select_backend("softmax", (4, 8), "fp32")
    finally:
        sel_mod.clear_cache()
    assert (first, second, again) == (torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1))
    assert seen == [torch.device("cuda", 0), torch.device("cuda", 1)]  # the third call took the fast path


def test_the_first_call_that_measures_says_so_once(private_store, caplog):
    """A first call with no stored decision measures every implementation (seconds on a GPU): one log line names the
    op, shape, dtype and how many implementations it measures; the second call of that bucket is silent."""
    x = torch.randn(3, 17)
    with caplog.at_level("INFO", logger="tiered_ops.decide.decide"):
        tiered_ops.softmax(x)
        tiered_ops.softmax(torch.randn(4, 17))  # same bucket: decided already
    lines = [r.getMessage() for r in caplog.records if "measuring" in r.getMessage()]
    n = sum(1 for i in get_op("softmax").impls.values() if i.tier != Tier.PEER)
    assert len(lines) == 1 and "softmax 3x17" in lines[0] and "fp32" in lines[0] and f"measuring {n} impl" in lines[0]
