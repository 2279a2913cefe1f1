"""rms_norm's CUDA forward at launch layouts set by environment knobs (knobs.patch, applied to b978cc5's cuda_src),
kernel time per call by torch.profiler (60 calls after 5, data left in L2), beside the Triton tier's kernel.

    git checkout b978cc5 -- cuda_src && git apply reports/nvidia-h200/rms_norm_layouts/knobs.patch
    export TIERED_OPS_BUILD_DIR=/tmp/tiered_ops_build PYTHONPATH=$PWD
    python3 reports/nvidia-h200/rms_norm_layouts/layouts.py --set 2

--set 1: packs a thread x threads a block x a grid of at most 16 blocks per SM for short rows (RMS_P, RMS_THREADS,
RMS_BPS), with the first set of shapes; --set 2: threads a row (RMS_TPR) and the weight read before the reduction
(RMS_WPRE), with more widths. Both: rows of over 32 threads (RMS_T32: threads a multiple of 32, RMS_PM: packs a
thread, RMS_BPS). The run of set 1 also printed a "compile" column (every kernel of a compiled call summed); this
script leaves it out, as the run of set 2 did (its column reads 0.00).
"""
import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
import triton_src.rms_norm as tr  # noqa: E402
from tiered_ops.tiers import cuda_ext  # noqa: E402

KNOBS = ["RMS_P", "RMS_THREADS", "RMS_T32", "RMS_PM", "RMS_BPS", "RMS_TPR", "RMS_WPRE"]


def ktime(fn, n=60):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    tot = sum(e.device_time_total for e in p.key_averages() if e.device_type.name == "CUDA")
    return tot / n


def setk(**kw):
    for k in KNOBS:
        os.environ.pop(k, None)
    for k, v in kw.items():
        os.environ[k] = str(v)


DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SETS = {
    1: ([(65536, 96, "fp32"), (65536, 64, "fp32"), (32768, 128, "bf16"), (65536, 256, "fp32"), (16384, 512, "bf16"),
         (8192, 32, "fp32"), (65536, 96, "bf16"), (4096, 1024, "fp32")],
        [{}] + [dict(RMS_P=p, RMS_THREADS=t, **({"RMS_BPS": b} if b else {}))
                for p, t, b in itertools.product([1, 2, 4, 8], [128, 256, 512], [0, 16])],
        [{}] + [dict(RMS_T32=1, **({"RMS_PM": p} if p else {})) for p in [0, 1, 2, 4]]
        + [dict(RMS_PM=p) for p in [1, 2]] + [dict(RMS_T32=1, RMS_PM=p, RMS_BPS=b) for p in [2, 4] for b in [8, 16]]),
    2: ([(65536, 96, "fp32"), (65536, 32, "fp32"), (65536, 64, "fp32"), (65536, 128, "fp32"), (32768, 192, "fp32"),
         (32768, 256, "fp32"), (16384, 512, "fp32"), (8192, 1024, "fp32"), (65536, 96, "bf16"), (65536, 128, "bf16"),
         (32768, 192, "bf16"), (32768, 256, "bf16"), (16384, 384, "bf16"), (16384, 512, "bf16"),
         (8192, 1024, "bf16"), (262144, 96, "fp32"), (262144, 128, "bf16")],
        [{}, dict(RMS_WPRE=1)] + [dict(RMS_TPR=t, **({"RMS_WPRE": 1} if wp else {}))
                                  for t, wp in itertools.product([1, 2, 4, 8, 16, 32], [0, 1])],
        [{}, dict(RMS_WPRE=1), dict(RMS_T32=1), dict(RMS_T32=1, RMS_WPRE=1),
         dict(RMS_T32=1, RMS_PM=2, RMS_BPS=8), dict(RMS_T32=1, RMS_PM=2, RMS_BPS=8, RMS_WPRE=1)]),
}
MEDIUM = [(333, 7168, "bf16"), (5000, 5120, "fp16"), (1024, 20000, "bf16"), (8192, 1536, "fp32"), (4096, 4096, "bf16"),
          (8192, 2048, "bf16"), (1, 2048, "bf16")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", type=int, choices=sorted(SETS), default=2)
    short, short_variants, medium_variants = SETS[ap.parse_args().set]
    err = cuda_ext.load()
    assert not err, err
    cu = cuda_ext.pybind_function("rms_norm_cuda")
    for group, shapes, variants in (("short", short, short_variants), ("medium", MEDIUM, medium_variants)):
        for R, N, dt in shapes:
            x = torch.randn(R, N, device="cuda", dtype=DT[dt])
            w = torch.randn(N, device="cuda", dtype=DT[dt])
            ref = F.rms_norm(x.double(), (N,), w.double(), 1e-6)
            base = {"triton": ktime(lambda: tr.rms_norm_fast(x, [N], w, 1e-6)), "compile": 0.0}
            gb = 2 * x.numel() * x.element_size() / 1e3
            line = [f"{group} {R}x{N} {dt}: triton {base['triton']:.2f} compile {base['compile']:.2f}"]
            res = []
            for v in variants:
                setk(**v)
                y = cu(x, [N], w, 1e-6, 0.0, False)
                e = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                bad = "" if e < 2e-2 else f" BAD {e:.1e}"
                t = ktime(lambda: cu(x, [N], w, 1e-6, 0.0, False))
                name = ",".join(f"{k[4:]}={val}" for k, val in v.items()) or "default"
                res.append((t, name + bad))
            setk()
            d = res[0][0]
            best = sorted(res)[:6]
            line.append(f"  cuda default {d:.2f} ({gb / d:.0f} GB/s); best: " +
                        "; ".join(f"{n} {t:.2f}" for t, n in best))
            print("\n".join(line), flush=True)
            print("  all: " + "; ".join(f"{n} {t:.2f}" for t, n in res), flush=True)


if __name__ == "__main__":
    main()
