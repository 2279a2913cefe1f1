"""segment_sum's kernels one by one: GPU time per kernel (torch.profiler, 50 calls after 5, data left in L2) of the
Triton tier's eager path and the CUDA tier, with a copy and a column sum of the same values beside, at a few segment
counts. ``--previous FILE``: also a previous version of ``triton_src/segment_sum.py`` (e.g. from ``git show
<rev>:triton_src/segment_sum.py > FILE``), imported as its own module with its op registration left out.
Run on a GPU: python benchmarks/segment_sum_kernels.py [--previous FILE]"""

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import triton_src.segment_sum as current
from tiered_ops.ops.segment_sum import offsets_for

CASES = [((65536, 128), 4096), ((16384, 64), 1024), ((65536, 128), 64), ((65536, 128), 65536)]


def kernels(fn, n: int = 50) -> dict[str, float]:
    """Mean GPU time (us) per call of each kernel ``fn`` launches."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key[:60]: e.device_time_total / e.count for e in p.key_averages()
            if e.device_type.name == "CUDA" and e.count >= n}


def previous(path: str):
    """The module of an earlier triton_src/segment_sum.py, without its registration (the op name is taken)."""
    src = Path(path).read_text()
    src = src.replace("from .launch import Plans, Step, register_ops", "from .launch import Plans, Step")
    src = "\n".join(line for line in src.splitlines() if 'register_ops("segment_sum"' not in line)
    spec = importlib.util.spec_from_loader("triton_src.segment_sum_previous", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__file__, mod.__package__ = str(Path("triton_src") / "segment_sum_previous.py"), "triton_src"
    sys.modules[spec.name] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - a file of this repository's history
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--previous", help="an earlier triton_src/segment_sum.py to time beside the current one")
    args = ap.parse_args()
    old = previous(args.previous) if args.previous else None
    cuda = None
    from tiered_ops.tiers import cuda_ext

    if not cuda_ext.load():
        cuda = cuda_ext.pybind_function("segment_sum_cuda")
    for (E, D), S in CASES:
        x = torch.randn(E, D, device="cuda")
        off = offsets_for(E, S, "uniform", 0).cuda()
        print(f"== {E}x{D} S={S} uniform fp32", flush=True)
        fns = [("triton", lambda: current.segment_sum_fast(x, off)), ("copy", lambda: x.clone()),
               ("column sum", lambda: x.sum(0))]
        if old is not None:
            fns.insert(1, ("triton previous", lambda: old.segment_sum_fast(x, off)))
        if cuda is not None:
            fns.append(("cuda", lambda: cuda(x, off)))
        for name, fn in fns:
            print(f"  {name}: " + "; ".join(f"{k} {v:.1f} us" for k, v in kernels(fn).items()), flush=True)


if __name__ == "__main__":
    main()
