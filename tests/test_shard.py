"""Sharding a sweep and spreading it over GPUs: the shards of a sweep cover its cases exactly once, by a hash that is
the same in every process; the deal over GPUs gives each case to one GPU; the options are checked."""

import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from helpers import builtin_ops

from tiered_ops.cli.args import build_parser
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import base_row
from tiered_ops.registry import DTYPES
from tiered_ops.store.store import Store
from tiered_ops.sweep import bench
from tiered_ops.sweep.shards import case_id, gpu_devices, in_shard, shard_of, spread
from tiered_ops.tiers.catalog import get_op

CPU = torch.device("cpu")


def _cases():
    """The default GPU sweep's cases in every dtype (the largest case list the package has)."""
    return [(s, p, dt) for s in builtin_ops() for p in s.default_problems("cuda") for dt in DTYPES.values()]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_the_shards_of_a_sweep_cover_its_cases_exactly_once(n):
    cases = _cases()
    assert len({case_id(c) for c in cases}) == len(cases) > 50
    got = Counter(case_id(c) for i in range(1, n + 1) for c in in_shard(cases, (i, n)))
    assert got == Counter(case_id(c) for c in cases)
    if n > 1:
        sizes = [len(in_shard(cases, (i, n))) for i in range(1, n + 1)]
        assert min(sizes) > 0 and max(sizes) < 2 * len(cases) / n  # a hash spreads them, none gets everything


def test_a_case_falls_in_the_same_shard_in_another_process():
    cases = _cases()[:40]
    code = ("from tiered_ops.registry import DTYPES\nfrom tiered_ops.tiers.catalog import all_ops\n"
            "from tiered_ops.sweep.shards import shard_of\n"
            "cases = [(s, p, dt) for s in all_ops() for p in s.default_problems('cuda') for dt in DTYPES.values()]\n"
            "print(','.join(str(shard_of(c, 5)) for c in cases[:40]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == ",".join(str(shard_of(c, 5)) for c in cases)


def test_spreading_over_gpus_deals_each_case_to_one_gpu():
    cases = _cases()
    for n in (1, 2, 3, 8):
        shares = spread(cases, n)
        assert sorted(case_id(c) for s in shares for c in s) == sorted(case_id(c) for c in cases)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="at least one worker"):
        spread(cases, 0)


def test_a_sweep_of_one_shard_measures_only_its_cases(monkeypatch, tmp_path):
    def fake_measure(spec, impl, problem, dtype, device, mode="fwd_nograd", **kw):
        return dict(base_row(spec, impl, problem, dtype, mode, fingerprint(device)), ok=1, p50_us=1.0, caller_us=1.0)

    monkeypatch.setattr(bench, "measure", fake_measure)
    muladd = get_op("muladd")
    problems = [muladd.problem((64 * 2**i,)) for i in range(12)]
    store = Store(tmp_path / "s.sqlite")
    for i in (1, 2, 3):
        df = bench.sweep([muladd], {"muladd": problems}, [torch.float32], CPU, store, shard=(i, 3), progress=False,
                         log=lambda s: None, modes=["fwd_nograd"], impls=["eager"], cost_metadata=False)
        assert set(df.problem) == {str(c[1]) for c in in_shard([(muladd, p, torch.float32) for p in problems],
                                                                (i, 3))}
    assert sorted(r["problem"] for r in store.rows()) == sorted(str(p) for p in problems)


def test_several_devices_need_a_worker_process_each(tmp_path):
    with pytest.raises(ValueError, match="isolate=True"):
        bench.sweep_devices([], [CPU, CPU], Store(tmp_path / "s.sqlite"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
@pytest.mark.parametrize("gpus, what", [("all", "torch sees 0 CUDA"), ("2", "torch sees 0 CUDA"),
                                        ("0", "at least 1"), ("many", "'all' or a number")])
def test_gpus_asked_for_that_are_not_there_are_an_error(gpus, what):
    with pytest.raises(ValueError, match=what):
        gpu_devices(gpus)


def test_the_bench_options_parse_and_refuse_bad_values(capsys):
    args = build_parser().parse_args(["bench", "--shard", "2/4", "--gpus", "all"])
    assert (args.shard, args.gpus) == ((2, 4), "all")
    for bad in (["--shard", "5/4"], ["--shard", "0/4"], ["--shard", "half"], ["--gpus", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", *bad])
    assert "shard i/n needs 1 <= i <= n, got 5/4" in capsys.readouterr().err


def test_a_sweep_over_two_devices_measures_each_case_once_in_a_worker_per_device(store_target):
    """The multi-GPU path with the CPU standing in for two devices: one worker process each, one store."""
    muladd = get_op("muladd")
    problems = [muladd.problem((64 * 2**i,)) for i in range(4)]
    said = []
    df = bench.sweep([muladd], {"muladd": problems}, [torch.float32], CPU, Store(store_target), devices=[CPU, CPU],
                     log=said.append, modes=["fwd_nograd"], impls=["eager"], isolate=True, cost_metadata=False)
    assert sorted(df.problem) == sorted(str(p) for p in problems) and df.ok.all()
    assert sorted(r["problem"] for r in Store(store_target).rows()) == sorted(str(p) for p in problems)
    assert sum("1 worker process(es) used" in s for s in said) == 2, said


@pytest.mark.parametrize("visible, extra, spread_over", [
    (2, [], [torch.device("cuda", 0), torch.device("cuda", 1)]),  # several GPUs: all of them, said so
    (1, [], None),  # one GPU: as before
    (2, ["--gpus", "1"], [torch.device("cuda", 0)]),  # the user's --gpus wins
    (2, ["--device", "cuda:1"], None),  # a named device: that one alone
    (2, ["--shard", "1/2"], None),  # a shard: one device, as the shard's runner chose
])
def test_bench_spreads_over_every_visible_gpu_unless_told_otherwise(monkeypatch, capsys, tmp_path, visible, extra,
                                                                    spread_over):
    """What `bash scripts/bench.sh` does on a host of several GPUs: the sweep is handed every visible GPU and stdout
    says so; --gpus, --device and --shard keep their meaning. The sweep itself is stood in for (no GPU here)."""
    from tiered_ops.cli import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(cli, "default_device", lambda: torch.device("cuda", 0))
    seen = {}

    class Stop(Exception):
        pass

    def fake_sweep(*a, devices=None, **kw):
        seen["devices"] = devices
        raise Stop

    monkeypatch.setattr(cli, "sweep", fake_sweep)
    with pytest.raises(Stop):
        cli.main(["bench", "--db", str(tmp_path / "s.sqlite"), "--ops", "muladd", *extra])
    assert seen["devices"] == spread_over
    said = capsys.readouterr().out
    assert ("GPUs visible: the cases are spread over all of them" in said) == (spread_over is not None and not extra)
