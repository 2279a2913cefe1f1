"""How much of a norm's training step a C++ autograd node would save over the CUDA tier's Python one.

The CUDA tier's eager path wraps the extension's launchers in one Python ``torch.autograd.Function``
(``tiered_ops/tiers/fastpath.py``); torch's own norms go through C++ autograd nodes. This builds, inline and apart from
the extension, a C++ ``torch::autograd::Function`` per op whose forward and backward call the extension's registered
ops (``tiered_ops::<op>_cuda`` / ``<op>_bwd_cuda``) through the dispatcher: the same kernels, a C++ node instead of a
Python one. It times, as the harness times a training step (the forward, then ``torch.autograd.grad`` of its output;
``time_call``: kernel p50, host time, caller time), in one process over ``--rounds`` interleaved rounds:
- the op's eager, Triton and CUDA tiers;
- ``cuda-cpp``: the same CUDA kernels under the C++ node;
- ``null-aten``: a C++ autograd node that launches nothing, the floor of the step itself.
``--parts``: layer_norm 8192x768 bf16 part by part, without the profiler (host us per call of back-to-back calls): each
path's forward with and without a graph, its backward alone, the wrappers through the dispatcher and through pybind11,
aten's own ops, and the step's allocations alone; ``--parts-only`` skips the steps.
Nothing here is used by the library: it tells whether moving the CUDA tier's autograd into the extension pays.
Usage (GPU machine, from the repository root):
    PYTHONPATH=$PWD python3 scripts/diag/cpp_autograd.py --rounds 7 [--profile 50] [--parts]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from step_floor import case_calls  # scripts/diag, this script's folder
from torch.utils.cpp_extension import load_inline

from tiered_ops.measure.gate import grad_output
from tiered_ops.measure.recheck import interleaved
from tiered_ops.measure.timing import copy_bandwidth_gbps, time_call
from tiered_ops.tiers import cuda_ext
from tiered_ops.tiers.catalog import get_op

CPP = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using T2 = std::tuple<at::Tensor, at::Tensor>;

static Opt opt(const at::Tensor& t) { return t.defined() ? Opt(t) : Opt(); }

static auto& ln_fwd() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tiered_ops::layer_norm_cuda", "")
      .typed<T3(const at::Tensor&, c10::IntArrayRef, const Opt&, const Opt&, double)>();
  return op;
}
static auto& ln_bwd() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tiered_ops::layer_norm_bwd_cuda", "")
      .typed<T3(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, const Opt&, const at::Tensor&,
                const at::Tensor&, bool)>();
  return op;
}
static auto& rms_fwd() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tiered_ops::rms_norm_cuda", "")
      .typed<at::Tensor(const at::Tensor&, c10::IntArrayRef, const Opt&, double, double, bool)>();
  return op;
}
static auto& rms_bwd() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tiered_ops::rms_norm_bwd_cuda", "")
      .typed<T2(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, const Opt&, double, double, bool)>();
  return op;
}

struct LayerNorm : torch::autograd::Function<LayerNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                            c10::IntArrayRef ns, double eps) {
    auto [y, mean, rstd] = ln_fwd().call(x, ns, opt(w), opt(b), eps);
    ctx->save_for_backward({x, w, mean, rstd});
    ctx->saved_data["ns"] = ns.vec();
    ctx->saved_data["has_bias"] = b.defined();
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto ns = ctx->saved_data["ns"].toIntVector();
    bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [dx, dw, db] = ln_bwd().call(grads[0], s[0], ns, opt(s[1]), s[2], s[3], has_bias);
    return {dx, s[1].defined() ? dw : at::Tensor(), has_bias ? db : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, c10::IntArrayRef ns,
                            double eps, double w_offset, bool cast) {
    auto y = rms_fwd().call(x, ns, opt(w), eps, w_offset, cast);
    ctx->save_for_backward({x, w});
    ctx->saved_data["ns"] = ns.vec();
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["w_offset"] = w_offset;
    ctx->saved_data["cast"] = cast;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto ns = ctx->saved_data["ns"].toIntVector();
    auto [dx, dw] = rms_bwd().call(grads[0], s[0], ns, opt(s[1]), ctx->saved_data["eps"].toDouble(),
                                   ctx->saved_data["w_offset"].toDouble(), ctx->saved_data["cast"].toBool());
    return {dx, s[1].defined() ? dw : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Each takes its op's kernel schema (the declaration's kernel_args of the Python call).
at::Tensor layer_norm(const at::Tensor& x, std::vector<int64_t> ns, const Opt& w, const Opt& b, double eps) {
  return LayerNorm::apply(x, w.value_or(at::Tensor()), b.value_or(at::Tensor()), ns, eps);
}
at::Tensor rms_norm(const at::Tensor& x, std::vector<int64_t> ns, const Opt& w, double eps, double w_offset,
                    bool cast) {
  return RmsNorm::apply(x, w.value_or(at::Tensor()), ns, eps, w_offset, cast);
}
"""

CASES = [("layer_norm", (8192, 768)), ("rms_norm", (8192, 4096)), ("layer_norm", (4096, 4096))]
IMPLS = ["eager", "triton", "cuda"]


def build() -> object:
    why = cuda_ext.load()
    if why:
        raise SystemExit(f"the CUDA extension did not load: {why}")
    t = time.time()
    mod = load_inline("tiered_ops_cpp_autograd_diag", cpp_sources=[CPP], functions=["layer_norm", "rms_norm"],
                      extra_cflags=["-O3"], verbose=False)
    print(f"C++ autograd module built in {time.time() - t:.1f} s")
    return mod


def cpp_call(mod: object, op: str, args: tuple, kwargs: dict | None = None) -> Callable[[], torch.Tensor]:
    """The C++ node's call of the op's Python arguments, mapped onto its kernel schema by the declaration's own
    ``kernel_args``."""
    ka = get_op(op).kernel_args(*args, **(kwargs or {}))
    fn = getattr(mod, op)
    return lambda: fn(*ka)


def profile(name: str, fn: object, steps: int, top: int = 14) -> None:
    """Host time per step of the profiler's events (self time: an event's own, without the events inside it), the
    largest first, and the GPU kernels one step launches. The profiler adds its own cost to every event: read the
    events against each other, not against the timings above."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    host = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:top]
    kernels = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_cpu_time_total for e in ev) / steps
    print(f"    {name} profiled: {total:.1f} us of host events per step; kernels per step: "
          + ", ".join(f"{e.key[:48]} x{e.count / steps:g}" for e in kernels))
    for e in host:
        print(f"      {e.self_cpu_time_total / steps:7.1f} us  x{e.count / steps:<4g} {e.key[:90]}")


def parts(mod: object, dev: torch.device, rounds: int) -> None:
    """layer_norm 8192x768 bf16, part by part (see the module's docstring)."""
    _, calls, ginp, leaves = case_calls("layer_norm", (8192, 768), dev, ["eager", "cuda"])
    x, ns, w, b, eps = ginp.args
    ns = list(ns)
    xd, wd, bd = (t.detach() for t in (x, w, b))
    cuda = get_op("layer_norm").impls["cuda"].unchecked
    cpp = cpp_call(mod, "layer_norm", ginp.args, ginp.kwargs)
    dy = grad_output(torch.empty_like(xd), 0)
    outs = {"eager": F.layer_norm(x, ns, w, b, eps), "cuda": cuda(x, ns, w, b, eps), "cuda-cpp": cpp()}
    ext_fwd, ext_bwd = cuda_ext.pybind_function("layer_norm_cuda"), cuda_ext.pybind_function("layer_norm_bwd_cuda")
    _, mean, rstd = ext_fwd(xd, ns, wd, bd, eps)
    _, amean, arstd = torch.ops.aten.native_layer_norm.default(xd, ns, wd, bd, eps)
    # the backward's fp32 partials of dw and db: (blocks, n), 16 blocks an SM at n = 768 (binding.h's norm_bwd_blocks)
    partial = (min(8192, torch.cuda.get_device_properties(dev).multi_processor_count * 16), 768)

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return fn()
        return call

    def grad_of(out: torch.Tensor) -> Callable[[], object]:
        return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)

    table: dict[str, Callable[[], object]] = {
        "step eager": calls["eager"],
        "step cuda": calls["cuda"],
        "step cuda-cpp": lambda: torch.autograd.grad(cpp(), leaves, dy),
        "step null-aten": calls["null-aten"],
        "fwd eager (graph)": lambda: F.layer_norm(x, ns, w, b, eps),
        "fwd cuda (graph)": lambda: cuda(x, ns, w, b, eps),
        "fwd cuda-cpp (graph)": cpp,
        "fwd eager (no grad)": no_grad(lambda: F.layer_norm(x, ns, w, b, eps)),
        "fwd cuda (no grad)": no_grad(lambda: cuda(x, ns, w, b, eps)),
        "fwd aten::native_layer_norm": lambda: torch.ops.aten.native_layer_norm.default(xd, ns, wd, bd, eps),
        "fwd tiered_ops::layer_norm_cuda": lambda: torch.ops.tiered_ops.layer_norm_cuda.default(xd, ns, wd, bd, eps),
        "fwd pybind layer_norm_cuda": lambda: ext_fwd(xd, ns, wd, bd, eps),
        "bwd eager (graph)": grad_of(outs["eager"]),
        "bwd cuda (graph)": grad_of(outs["cuda"]),
        "bwd cuda-cpp (graph)": grad_of(outs["cuda-cpp"]),
        "bwd aten::native_layer_norm_backward": lambda: torch.ops.aten.native_layer_norm_backward.default(
            dy, xd, ns, amean, arstd, wd, bd, [True, True, True]),
        "bwd pybind layer_norm_bwd_cuda": lambda: ext_bwd(dy, xd, ns, wd, mean, rstd, True),
        "8 allocations of the step's sizes": lambda: [torch.empty_like(xd), torch.empty_like(mean),
                                                      torch.empty_like(rstd), torch.empty_like(xd),
                                                      torch.empty_like(wd), torch.empty_like(bd),
                                                      torch.empty(partial, device=dev),
                                                      torch.empty(partial, device=dev)],
    }
    for fn in table.values():
        fn()
    torch.cuda.synchronize()
    rows = interleaved(table, rounds, lambda f: time_call(f, dev))
    print(f"\nlayer_norm 8192x768 bf16, part by part: host us per call (kernel p50 us), median of {rounds} rounds")
    for name, ts in rows.items():
        h, k = statistics.median(t.host_us for t in ts), statistics.median(t.p50_us for t in ts)
        print(f"  {name:>38}: host {h:7.1f}  (kernel p50 {k:7.1f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS steps of each variant (torch.profiler: host time per event, per step)")
    ap.add_argument("--parts", action="store_true", help="layer_norm 8192x768's step part by part, after the steps")
    ap.add_argument("--parts-only", action="store_true", help="the parts alone")
    args = ap.parse_args()
    dev = torch.device("cuda")
    mod = build()
    if args.parts_only:
        parts(mod, dev, args.rounds)
        return
    copy = copy_bandwidth_gbps(dev)
    print(f"{torch.cuda.get_device_name()}; copy {copy:.0f} GB/s; caller us, median of {args.rounds} rounds "
          "(host us, kernel p50 us)")
    for op, shape in CASES:
        nbytes, calls, ginp, leaves = case_calls(op, shape, dev, IMPLS)
        fwd = cpp_call(mod, op, ginp.args, ginp.kwargs)
        with torch.enable_grad():
            out = fwd()
        dy = grad_output(out, 0)
        # the C++ node's gradients against the CUDA tier's (the same kernels: equal bits)
        ref = calls["cuda"]()
        got = torch.autograd.grad(fwd(), leaves, dy)
        same = all(torch.equal(a, b) for a, b in zip(ref, got))
        calls["cuda-cpp"] = lambda: torch.autograd.grad(fwd(), leaves, dy)
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        rows = interleaved(calls, args.rounds, lambda f: time_call(f, dev))
        copy_us = nbytes / (copy * 1e3)
        eager = statistics.median(t.caller_us for t in rows["eager"])
        print(f"\n{op} {'x'.join(map(str, shape))} bf16 fwd+bwd: {nbytes / 1e6:.1f} MB, copy time {copy_us:.1f} us; "
              f"cuda-cpp gradients equal to the cuda tier's: {same}")
        for name, ts in rows.items():
            c, h = statistics.median(t.caller_us for t in ts), statistics.median(t.host_us for t in ts)
            k = statistics.median(t.p50_us for t in ts)
            print(f"  {name:>10}: caller {c:7.1f}  (host {h:7.1f}, kernel p50 {k:7.1f})  x eager {eager / c:5.2f}  "
                  f"copy {copy_us / c:5.2f}")
        if args.profile:
            for name in ("eager", "cuda", "cuda-cpp", "null-aten"):
                profile(name, calls[name], args.profile)
    if args.parts:
        parts(mod, dev, args.rounds)


if __name__ == "__main__":
    main()
