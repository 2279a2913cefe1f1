"""Peak memory of a measurement: bytes one call allocates above its inputs (GPU), None on the CPU."""

from __future__ import annotations

import torch
from helpers import gpu

from tiered_ops.measure.measure import measure
from tiered_ops.measure.timing import peak_bytes
from tiered_ops.tiers.catalog import get_op


def test_the_cpu_has_no_peak_figure():
    assert peak_bytes(lambda: torch.ones(1000), torch.device("cpu")) is None


@gpu
def test_peak_bytes_counts_what_one_call_allocates_above_its_inputs():
    dev = torch.device("cuda")
    x = torch.randn(1024, 1024, device=dev)
    assert peak_bytes(lambda: x * 2, dev) == x.numel() * 4  # one output, nothing else
    assert peak_bytes(lambda: (x * 2).sum(), dev) >= x.numel() * 4  # the intermediate counts though it is freed


@gpu
def test_every_gpu_measurement_records_its_peak():
    spec = get_op("softmax")
    problem = spec.problem((1024, 4096))
    row = measure(spec, spec.impls["eager"], problem, torch.float32, torch.device("cuda"), "fwd_nograd")
    out_bytes = 1024 * 4096 * 4
    assert row["ok"] == 1 and out_bytes <= row["peak_bytes"] < 4 * out_bytes
