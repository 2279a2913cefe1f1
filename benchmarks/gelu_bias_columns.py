"""gelu forward with bias: the Triton tier against its kernel before the bias length became a constant (int64 flat
offsets, a modulo by the run-time length) and an int32 variant, kernel time (do_bench median, L2 flushed) in one
process; compile and a copy beside. Run on a GPU: python benchmarks/gelu_bias_columns.py"""

import torch
import triton
import triton.language as tl

import triton_src.gelu as cur


@triton.jit
def _erf_gelu(v):
    y = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    return tl.where(v == -float("inf"), 0.0, y)


@triton.jit
def old_tier(x_ptr, b_ptr, y_ptr, numel, n_cols, BLOCK: tl.constexpr):  # the tier before: int64, run-time modulo
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    b = tl.load(b_ptr + offs % n_cols, mask=m, other=0.0).to(tl.float32)
    v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) + b
    tl.store(y_ptr + offs, _erf_gelu(v).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def flat32(x_ptr, b_ptr, y_ptr, numel, n_cols, BLOCK: tl.constexpr):  # int32 offsets and modulo
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    b = tl.load(b_ptr + offs % n_cols, mask=m, other=0.0).to(tl.float32)
    v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) + b
    tl.store(y_ptr + offs, _erf_gelu(v).to(y_ptr.dtype.element_ty), mask=m)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


CASES = [((65536, 300), torch.float32), ((65536, 300), torch.bfloat16), ((65536, 256), torch.float32),
         ((16384, 4096), torch.float32), ((16384, 4096), torch.bfloat16), ((4096, 11008), torch.bfloat16),
         ((1000, 1000), torch.float32), ((65536, 96), torch.float32), ((4096, 3000), torch.bfloat16),
         ((8192, 1000), torch.float32), ((777, 333), torch.float32)]

for (rows, n), dt in CASES:
    x = torch.randn(rows, n, device="cuda", dtype=dt)
    b = torch.randn(n, device="cuda", dtype=dt)
    y = torch.empty_like(x)
    numel, block = x.numel(), 4096
    ref = torch.nn.functional.gelu(x.double() + b.double()).to(dt)
    comp = torch.compile(lambda x, b: torch.nn.functional.gelu(x + b))
    grid = (triton.cdiv(numel, block),)
    cands = {
        "triton_tier": lambda: cur.gelu_fast(x, b, "none"),
        "old_tier": lambda: old_tier[grid](x, b, y, numel, n, BLOCK=block, num_warps=8),
        "flat32": lambda: flat32[grid](x, b, y, numel, n, BLOCK=block, num_warps=8),
        "compile": lambda: comp(x, b),
        "copy": lambda: y.copy_(x),
    }
    res = {}
    for k, f in cands.items():
        out = f()
        got = out if k in ("triton_tier", "compile") else y
        if k != "copy":
            err = (got.double() - ref.double()).abs().max().item()
            assert err < (1e-5 if dt == torch.float32 else 2e-2), (k, err)
        res[k] = bench(f)
    print(f"{rows}x{n} {str(dt)[6:]}: " + "  ".join(f"{k} {v:.1f}" for k, v in res.items()) + "  (us)", flush=True)
