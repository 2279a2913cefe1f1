"""Host time per call of the kernel tiers' eager fast paths against eager torch (the speed targets), on a GPU.

For each op at 1x4096, 32x4096, 16384x4096 and 65536x256 (bf16), in fwd_nograd (grad mode off around the timing
loop) and fwd+bwd (a fresh forward and torch.autograd.grad, as the sweep times a training step): eager, our Triton op
through torch.library (triton_op), the Triton fast path (tiered_ops.tiers.fastpath over triton_src.<op>_fast), our
CUDA op through torch.library, and the CUDA fast path (the extension's pybind11 functions + one autograd.Function).
host us: fastest of 5 batches of back-to-back calls timed to the return of the last one, the GPU not waited for
(tiered_ops.measure.timing.batch_times_us, wait=False): what a caller pays to issue the call; the variants are timed in
turn, 3 rounds, and each keeps its fastest. <tier>_fwd_only (fwd_nograd): the fast path's forward_only, the call a
selection layer that has already found that no gradient is needed makes. Each fast path's output (and
gradients) is compared with eager's before it is timed; a wrong one is reported and not timed.
Targets: Triton fast path <= 1.2x eager in fwd_nograd and <= 1.3x in fwd+bwd; CUDA fast path <= 1.0x and <= 1.1x.

Then the launch layers of one case (softmax 1x4096 fp32, as scripts/diag/triton_launch.py), throughput us per call
(host_time_per_call, GPU waited for) and issue us: torch.softmax, the triton_op, the JITFunction launch,
CompiledKernel[grid], the DirectKernel, the compiled kernel's launcher called with everything precomputed (the floor
of Triton's launcher), softmax_fast, the fast path, a CUDA-graph replay of the fast path, and the pieces of a call.

Run: python3 scripts/diag/launch_layers.py [--shapes 1x4096,32x4096] [--ops softmax,rms_norm] (CPU: interpreter,
correctness only, small shapes).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch

from tiered_ops.measure.gate import grad_output, with_grad
from tiered_ops.measure.timing import batch_times_us, host_time_per_call
from tiered_ops.registry import rel_error
from tiered_ops.tiers import cuda_ext
from tiered_ops.tiers.catalog import get_op
from tiered_ops.tiers.fastpath import tier_fast

OPS = ["softmax", "rms_norm", "layer_norm", "gelu", "muladd"]
SHAPES = [(1, 4096), (32, 4096), (16384, 4096), (65536, 256)]
TARGETS = {("triton", "fwd_nograd"): 1.2, ("triton", "fwd+bwd"): 1.3, ("cuda", "fwd_nograd"): 1.0,
           ("cuda", "fwd+bwd"): 1.1}
VARIANTS = ["eager", "triton_op", "triton_fast", "triton_fwd_only", "cuda_op", "cuda_fast", "cuda_fwd_only"]
ROUNDS = 3  # every variant timed once per round, round after round: a drift of the host hits all of them alike


def issue_us(fn: Callable[[], Any], dev: torch.device, budget_s: float = 0.02) -> float:
    return min(batch_times_us(fn, dev, budget_s))


def variants(op: str, dev: torch.device) -> dict[str, Callable[..., Any] | str]:
    """Each variant's function, or why it is missing."""
    spec = get_op(op)
    first = op == "layer_norm"
    out: dict[str, Callable[..., Any] | str] = {"eager": spec.impls["eager"].fn}
    for tier in ("triton", "cuda"):
        impl = spec.impls.get(tier)
        why = f"{op} has no {tier} tier" if impl is None else impl.why_not(dev, torch.bfloat16)
        if why:
            out[f"{tier}_op"] = out[f"{tier}_fast"] = out[f"{tier}_fwd_only"] = why
            continue
        out[f"{tier}_op"] = impl.fn
        fast = tier_fast(spec, tier, first)
        out[f"{tier}_fast"] = fast if fast is not None else "no fast path"
        out[f"{tier}_fwd_only"] = fast.forward_only if fast is not None else "no fast path"
    return out


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict, mode: str, pos: list[int], dy: torch.Tensor | None
          ) -> Callable[[], Any]:
    if mode == "fwd_nograd":
        return lambda: fn(*args, **kwargs)
    leaves = [args[i] for i in pos]
    return lambda: torch.autograd.grad(fn(*args, **kwargs), leaves, dy)


def check(name: str, fn: Callable[..., Any], eager: Callable[..., Any], args: tuple, kwargs: dict, mode: str,
          pos: list[int], dy: torch.Tensor | None, rtol: float) -> str | None:
    """None when fn's output (and gradients in fwd+bwd) are within rtol of eager's, else what differs."""
    try:
        with torch.set_grad_enabled(mode != "fwd_nograd"):
            got, want = fn(*args, **kwargs), eager(*args, **kwargs)
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"output {tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} {want.dtype}"
        err = rel_error(got.float(), want.double())
        if not err <= rtol:
            return f"output rel error {err:.2e} against eager"
        if mode != "fwd_nograd":
            leaves = [args[i] for i in pos]
            for i, g, w in zip(pos, torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
                e = rel_error(g.float(), w.double())
                if not e <= 4 * rtol:
                    return f"gradient of argument {i}: rel error {e:.2e} against eager"
    except Exception as e:  # a failing variant is reported, the others still timed
        return f"raised {type(e).__name__}: {str(e)[:200]}"
    return None


def table(ops: list[str], shapes: list[tuple[int, ...]], dev: torch.device, dtype: torch.dtype) -> list[str]:
    lines, misses = [], []
    head = f"{'op':10s} {'shape':10s} {'mode':10s} " + " ".join(f"{v:>15s}" for v in VARIANTS)
    head += "   triton fast (fwd_only) / eager   cuda fast (fwd_only) / eager"
    print(head, flush=True)
    lines.append(head)
    for op in ops:
        spec = get_op(op)
        fns = variants(op, dev)
        for v, f in fns.items():
            if isinstance(f, str) and not v.endswith("fwd_only"):
                print(f"# {op}: {v} unavailable: {f}", flush=True)
        for shape in shapes:
            inp = spec.make_inputs(spec.problem(shape), dtype, dev, 0)
            ginp, pos = with_grad(spec, inp)
            with torch.enable_grad():
                dy = grad_output(spec.impls["eager"].fn(*ginp.args, **ginp.kwargs), 0)
            for mode in ("fwd_nograd", "fwd+bwd"):
                args = inp.args if mode == "fwd_nograd" else ginp.args
                calls: dict[str, Callable[[], Any]] = {}
                for v in VARIANTS:
                    f = fns[v]
                    if isinstance(f, str) or (mode != "fwd_nograd" and v.endswith("fwd_only")):
                        continue
                    if v != "eager":
                        bad = check(v, f, fns["eager"], args, inp.kwargs, mode, pos, dy, 2 * spec.rtol[dtype])
                        if bad:
                            print(f"# {op} {shape} {mode} {v} WRONG: {bad}", flush=True)
                            continue
                    calls[v] = _call(f, args, inp.kwargs, mode, pos, dy)
                us: dict[str, float | None] = dict.fromkeys(VARIANTS)
                with torch.set_grad_enabled(mode != "fwd_nograd"):
                    for _ in range(ROUNDS):
                        for v, call in calls.items():
                            call()
                            t = issue_us(call, dev, 0.02)
                            us[v] = t if us[v] is None else min(us[v], t)
                cells = " ".join(f"{us[v]:15.1f}" if us[v] is not None else f"{'-':>15s}" for v in VARIANTS)
                verdicts = []
                for tier in ("triton", "cuda"):
                    e, t = us["eager"], TARGETS[(tier, mode)]
                    cell = []
                    for v in (f"{tier}_fast", f"{tier}_fwd_only"):
                        f = us[v]
                        if f is None or not e:
                            continue
                        r = f / e
                        if r > t:
                            misses.append(f"{op} {'x'.join(map(str, shape))} {mode} {v}: {r:.2f}x > {t}x")
                        cell.append(f"{r:.2f}x {'ok' if r <= t else 'MISS'}")
                    verdicts.append(f"{' / '.join(cell) or '-':>30s}")
                line = f"{op:10s} {'x'.join(map(str, shape)):10s} {mode:10s} {cells}   " + " ".join(verdicts)
                print(line, flush=True)
                lines.append(line)
    print(f"\ntargets missed: {len(misses)}" + "".join(f"\n  {m}" for m in misses), flush=True)
    return lines


def layers(dev: torch.device) -> None:
    """The launch layers of softmax 1x4096 fp32, then of the fast paths' pieces."""
    import triton

    from triton_src import softmax as ts
    from triton_src.common import row_settings
    from triton_src.launch import bound, c_launch, c_launch_args, direct

    spec = get_op("softmax")
    x = torch.randn(1, 4096, device=dev)
    rows, n = x.shape
    block, per, warps = row_settings(n, ts.MAX_FUSED_FWD)
    grid = (triton.cdiv(rows, per), 1, 1)
    y = torch.empty_like(x)
    ck = ts._softmax_rows[grid](x, y, rows, n, BLOCK_N=block, ROWS=per, num_warps=warps)
    dk = direct(ts._softmax_rows, warps, BLOCK_N=block, ROWS=per)
    dk(grid, x, y, rows, n)
    bk = bound(ts._softmax_rows, grid, warps, BLOCK_N=block, ROWS=per)
    bk(x, y, rows, n)
    run, fn, packed = ck.run, ck.function, ck.packed_metadata
    launcher_info(ck)
    stream = torch._C._cuda_getCurrentRawStream(x.get_device())
    fast = tier_fast(spec, "triton")
    cuda_fast = tier_fast(spec, "cuda") if cuda_ext.load() is None else None
    ref = torch.softmax(x, -1)
    v: dict[str, Callable[[], Any]] = {
        "torch.softmax": lambda: torch.softmax(x, -1),
        "triton_op (torch.library)": lambda: spec.impls["triton"].fn(x, -1),
        "JITFunction launch": lambda: ts._softmax_rows[grid](x, y, rows, n, BLOCK_N=block, ROWS=per,
                                                             num_warps=warps) and y,
        "CompiledKernel[grid]": lambda: ck[grid](x, y, rows, n, block, per) or y,
        "DirectKernel (full key)": lambda: dk(grid, x, y, rows, n) or y,
        "Bound (plan's launch: alignment check)": lambda: bk(x, y, rows, n) or y,
        "compiled launcher, all precomputed": lambda: run(grid[0], 1, 1, stream, fn, packed, None, None, None, x, y,
                                                          rows, n, block, per) or y,
        "softmax_fast": lambda: ts.softmax_fast(x, -1),
        "triton fast path": lambda: fast(x, -1),
    }
    c = c_launch(run)
    if c is not None:
        xp, yp = x.data_ptr(), y.data_ptr()
        c_args = c_launch_args(c, grid, stream, fn, packed, (x, y, rows, n, block, per))
        c_ints = c_launch_args(c, grid, stream, fn, packed, (xp, yp, rows, n, block, per))
        v["C launch under it, all precomputed"] = lambda: c[0](*c_args) or y
        v["C launch, pointers as ints"] = lambda: c[0](*c_ints) or y
    if cuda_fast is not None:
        v["cuda op (torch.library)"] = lambda: spec.impls["cuda"].fn(x, -1)
        v["cuda pybind softmax_cuda"] = lambda: cuda_ext.pybind_function("softmax_cuda")(x, -1)
        v["cuda fast path"] = lambda: cuda_fast(x, -1)
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fast(x, -1)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            gy = fast(x, -1)
        v["CUDA graph replay of the fast path"] = lambda: g.replay() or gy
    except Exception as e:  # graphs unavailable: say so, time the rest
        print(f"# CUDA graph capture raised {type(e).__name__}: {e}")
    print(f"\nlaunch layers, softmax 1x4096 fp32: BLOCK_N={block} ROWS={per} num_warps={warps}")
    print(f"{'layer':40s} {'throughput us':>14s} {'issue us':>9s}")
    for name, f in v.items():
        try:
            y.zero_()
            out = f()
            torch.cuda.synchronize()
            err = (out - ref).abs().max().item()
            if not err < 1e-5:
                print(f"{name:40s} WRONG: max abs error {err}")
                continue
        except Exception as e:
            print(f"{name:40s} raised {type(e).__name__}: {str(e)[:160]}")
            continue
        print(f"{name:40s} {host_time_per_call(f, dev):14.1f} {issue_us(f, dev):9.1f}", flush=True)
    pieces(dev)


def launcher_info(ck: Any) -> None:
    """What the compiled kernel's launcher is in this Triton (its Python layer, if any, above the C launch)."""
    import inspect

    run = ck.run
    md = ck.metadata
    print(f"\nlauncher: {type(run).__module__}.{type(run).__qualname__}; metadata: "
          + ", ".join(f"{k}={getattr(md, k, None)}" for k in ("num_warps", "num_ctas", "shared", "global_scratch_size",
                                                              "profile_scratch_size", "launch_cooperative_grid",
                                                              "launch_pdl")))
    for attr in ("launch", "arg_annotations", "kernel_signature"):
        if hasattr(run, attr):
            print(f"  run.{attr}: {str(getattr(run, attr))[:200]}")
    try:
        print("  " + inspect.getsource(type(run).__call__).replace("\n", "\n  "))
    except (TypeError, OSError) as e:
        print(f"  no Python source for the launcher ({type(e).__name__})")


def pieces(dev: torch.device) -> None:
    """The per-call pieces of the fast paths (issue us, nothing waited for): where the rest of the time goes."""
    from triton_src import rms_norm as tr

    spec = get_op("rms_norm")
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps
    fast = tier_fast(spec, "triton")
    cuda_fast = tier_fast(spec, "cuda")
    p: dict[str, Callable[[], Any]] = {
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "x.contiguous()": lambda: x.contiguous(),
        "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "rms_norm kernel_args": lambda: spec.kernel_args(x, (4096,), w, eps),
        "F.rms_norm (eager)": lambda: spec.impls["eager"].fn(x, (4096,), w, eps),
        "rms_norm_fast (direct, no wrapper)": lambda: tr.rms_norm_fast(x, [4096], w, eps),
        "triton fast path (wrapper + kernel_args)": lambda: fast(x, (4096,), w, eps),
        "triton fast path .forward_only": lambda: fast.forward_only(x, (4096,), w, eps),
    }
    if cuda_fast is not None:
        pyb = cuda_ext.pybind_function("rms_norm_cuda")
        p["pybind rms_norm_cuda (no wrapper)"] = lambda: pyb(x, [4096], w, eps)
        p["cuda fast path (wrapper + kernel_args)"] = lambda: cuda_fast(x, (4096,), w, eps)
        p["cuda fast path .forward_only"] = lambda: cuda_fast.forward_only(x, (4096,), w, eps)
        p["cuda op (torch.library)"] = lambda: spec.impls["cuda"].fn(x, (4096,), w, eps)
    print("\npieces, rms_norm 1x4096 bf16 with weight, no grad (issue us per call)")
    with torch.no_grad():
        for name, f in p.items():
            f()
            print(f"{name:45s} {min(issue_us(f, dev) for _ in range(3)):7.2f}", flush=True)

    # fwd+bwd: what a Python autograd.Function costs around the same eager kernels (torch's softmax forward and
    # backward), against eager's own C++ autograd node and our fast paths.
    class EagerKernels(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
            y = torch._softmax(x, dim, False)
            ctx.save_for_backward(y)
            ctx.dim = dim
            return y

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple:
            (y,) = ctx.saved_tensors
            return torch._softmax_backward_data(g, y, ctx.dim, y.dtype), None

    sm = get_op("softmax")
    sm_triton = tier_fast(sm, "triton")
    xs = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    q: dict[str, Callable[[], Any]] = {
        "eager softmax": lambda: torch.autograd.grad(torch.softmax(xs, -1), [xs], dy),
        "autograd.Function around eager's kernels": lambda: torch.autograd.grad(EagerKernels.apply(xs, -1), [xs], dy),
        "triton fast path": lambda: torch.autograd.grad(sm_triton(xs, -1), [xs], dy),
    }
    sm_cuda = tier_fast(sm, "cuda")
    if sm_cuda is not None:
        q["cuda fast path"] = lambda: torch.autograd.grad(sm_cuda(xs, -1), [xs], dy)
    print("\npieces, softmax 1x4096 bf16 fwd+bwd (issue us per step)")
    for name, f in q.items():
        f()
        print(f"{name:45s} {min(issue_us(f, dev) for _ in range(3)):7.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    import triton

    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter: correctness only)"
    print(f"triton {triton.__version__}, torch {torch.__version__}, {name}", flush=True)
    if cuda:
        t0 = time.perf_counter()
        why = cuda_ext.load()
        print(f"CUDA extension: {why or 'loaded'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    table(a.ops.split(","), shapes, dev, torch.bfloat16)
    if cuda:
        layers(dev)


if __name__ == "__main__":
    sys.exit(main())
