"""Where the Triton tier's per-call host time goes (the speed targets), on a GPU: host microseconds per call of
softmax at 1x4096 fp32 through each layer, fastest of 5 batches (tiered_ops.measure.timing.host_time_per_call):

  torch.softmax                      the eager floor
  tiered_ops triton impl             our op through torch.library.triton_op (what the sweep times)
  softmax_launch                     the same launcher called bare (no custom-op dispatch)
  JITFunction launch                 _softmax_rows[grid](...) with constexprs: Triton's own launch path
  CompiledKernel runner, all args    the kernel returned by the first launch, launched again through
  CompiledKernel runner, no constexpr    CompiledKernel[grid](...) (skips binding, specialization, cache lookup)

Each variant's output is compared with torch.softmax first: a variant that raises or is wrong prints why and is not
timed. Run: python3 scripts/diag/triton_launch.py (scripts/gpu.sh stage diag).
"""

from __future__ import annotations

import torch
import triton

from tiered_ops.measure.timing import host_time_per_call
from tiered_ops.tiers.catalog import get_op
from triton_src import softmax as ts
from triton_src.common import row_settings


def main() -> None:
    dev = torch.device("cuda")
    x = torch.randn(1, 4096, device=dev)
    rows, n = x.shape
    block, per, warps = row_settings(n, ts.MAX_FUSED_FWD)
    grid = (triton.cdiv(rows, per),)
    grid3 = (grid[0], 1, 1)  # CompiledKernel's runner reads three grid dims
    ref = torch.softmax(x, -1)
    y = torch.empty_like(x)
    ck = ts._softmax_rows[grid](x, y, rows, n, BLOCK_N=block, ROWS=per, num_warps=warps)
    variants = {
        "torch.softmax": lambda: torch.softmax(x, -1),
        "tiered_ops triton impl (triton_op)": lambda: get_op("softmax").impls["triton"].fn(x, -1),
        "softmax_launch (bare)": lambda: ts.softmax_launch(x, -1),
        "JITFunction launch": lambda: ts._softmax_rows[grid](x, y, rows, n, BLOCK_N=block, ROWS=per, num_warps=warps)
        and y,
        "CompiledKernel runner, all args": lambda: ck[grid3](x, y, rows, n, block, per) or y,
        "CompiledKernel runner, no constexpr": lambda: ck[grid3](x, y, rows, n) or y,
    }
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"softmax 1x4096 fp32: BLOCK_N={block} ROWS={per} num_warps={warps}; first launch returned "
          f"{type(ck).__name__}")
    for name, fn in variants.items():
        try:
            y.zero_()
            out = fn()
            torch.cuda.synchronize()
            err = (out - ref).abs().max().item()
            if not err < 1e-5:
                print(f"{name:40s} WRONG: max abs error {err}")
                continue
        except Exception as e:  # a launch API this Triton does not have: say so, time the others
            print(f"{name:40s} raised {type(e).__name__}: {str(e)[:160]}")
            continue
        print(f"{name:40s} {host_time_per_call(fn, dev):7.1f} us/call")


if __name__ == "__main__":
    main()
