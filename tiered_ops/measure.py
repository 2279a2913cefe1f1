"""Correctness gate and measurement of one implementation at one problem: written once, driven by OpSpec.

Gate: before an implementation is timed at a problem it must match the float64 reference on fresh
random inputs (two seeds) at that problem, and on the op's edge problems (checked once per
implementation, dtype and device in a process). The error ||out-ref||/||ref|| must stay under the
dtype's bound and NaN/Inf must appear exactly where the reference has them. In the modes that run a
backward (fwd, bwd, fwd+bwd) every gradient is also compared with float64 autograd of the reference,
for a random output gradient. A NaN-filled block of the
output's size is freed just before each call, so with CUDA's caching allocator an unwritten element
usually reads as NaN (on the CPU it reads as whatever was there, still caught as a wrong value).
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import time
from typing import Any, Callable

import torch

from . import envs
from .buckets import encode
from .environment import environment
from .registry import (
    DTYPE_NAMES,
    GRAD_MODES,
    Impl,
    Inputs,
    OpSpec,
    Problem,
    Tier,
    as_outputs,
    check_context,
    check_mode,
    rel_error,
)
from .timing import COPY_BYTES, Fingerprint, contention_check, copy_bandwidth_gbps, fingerprint, sync, time_call

log = logging.getLogger(__name__)
SEEDS = (1, 2)  # correctness seeds; timing uses seed 0 (fresh random data, never zeros)
_edge_results: dict[tuple, tuple[bool, float, str | None]] = {}
_problem_results: dict[tuple, tuple[float, str | None]] = {}


def _to64(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.to(torch.float64)
    if isinstance(v, (tuple, list)):
        return type(v)(_to64(x) for x in v)
    return v


def _short(e: BaseException) -> str:
    """One line: the exception's type and first line (a Triton compile error's first line is only "at L:C:", its
    message is the last line: both are kept)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and re.fullmatch(r"at \d+:\d+:?", text):
        text = f"{text} {lines[-1]}"
    return f"{type(e).__name__}: {text[:300]}".rstrip(": ")


def _poison(inp: Inputs, device: torch.device) -> None:
    first = inp.args[0]
    if isinstance(first, torch.Tensor) and first.numel():
        torch.full((first.numel(),), math.nan, dtype=first.dtype, device=device)


def arg_names(spec: OpSpec) -> list[str]:
    return list(inspect.signature(spec.reference).parameters)


def output_names(spec: OpSpec) -> tuple[str, ...]:
    """What a check calls each output: "output" for a one-output op, else "output <name>"."""
    return ("output",) if len(spec.outputs) == 1 else tuple(f"output {n}" for n in spec.outputs)


def with_grad(spec: OpSpec, inp: Inputs) -> tuple[Inputs, list[int]]:
    """Inputs whose differentiable tensors are fresh leaves that require grad; their positions."""
    args, pos = list(inp.args), []
    for i in spec.grad_args:
        a = args[i] if i < len(args) else None
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            args[i] = a.detach().requires_grad_(True)
            pos.append(i)
    return Inputs(tuple(args), inp.kwargs), pos


def grad_output(out: torch.Tensor | tuple[torch.Tensor, ...], seed: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A random output gradient (never zeros, never ones: a wrong reduction cannot cancel out); for an op with
    several outputs a tuple of them, each drawn from its own seed."""
    if isinstance(out, (tuple, list)):
        return tuple(grad_output(o, seed + 7919 * k) for k, o in enumerate(out))
    g = torch.Generator(device=out.device).manual_seed(10_000 + seed)
    return torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float32).to(out.dtype)


def grad_norm(dy: torch.Tensor | tuple[torch.Tensor, ...]) -> float:
    """The float64 norm of an output gradient (over all of an op's outputs)."""
    return math.sqrt(sum(torch.linalg.vector_norm(d.double()).item() ** 2 for d in as_outputs(dy)))


EAGER_FACTOR = 2.0  # an implementation may be this many times as far from float64 as eager is at that dtype


class _NoBackward(Exception):
    pass


class _InBackward(Exception):
    pass


def _run(fn: Callable[..., Any], spec: OpSpec, inp: Inputs, grad: bool, seed: int, device: torch.device
         ) -> tuple[Any, tuple, torch.Tensor | None]:
    """(output, gradients, output gradient) of one call; gradients only when ``grad``."""
    pos: list[int] = []
    if grad:
        inp, pos = with_grad(spec, inp)
    _poison(inp, device)
    with torch.set_grad_enabled(grad):
        out = fn(*inp.args, **inp.kwargs)
    outs = as_outputs(out)
    if not grad or not all(isinstance(o, torch.Tensor) for o in outs):
        sync(device)
        return out, (), None
    if not all(o.requires_grad for o in outs):
        raise _NoBackward()
    dy = grad_output(out, seed)
    _poison(inp, device)
    try:
        grads = torch.autograd.grad(out, [inp.args[i] for i in pos], dy, allow_unused=True)
        sync(device)
    except Exception as e:
        raise _InBackward(e) from e
    return out, grads, dy


def check_one(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, seed: int,
              grad: bool = False) -> tuple[float, str | None]:
    """Relative error of impl vs the float64 reference at one problem and seed (output, and each gradient when
    ``grad``); the reason when it fails.

    Bound per checked tensor: the dtype's bound, or EAGER_FACTOR times eager's own error on the same inputs
    when that is larger (torch's CPU kernels accumulate some half-precision reductions in the low dtype, and
    its fp32 layer_norm gradient over one element is roundoff where the exact one is 0). Eager itself, the
    reference tier, is held to the bound on its output; its gradients are what torch computes, and set the
    others' tolerance as above (NaN/Inf and shape mismatches still fail)."""
    inp = spec.make_inputs(problem, dtype, device, seed)
    try:
        out, grads, dy = _run(impl.fn, spec, inp, grad, seed, device)
    except _NoBackward:
        return math.inf, f"no backward at {problem}: the output does not require grad"
    except _InBackward as e:
        return math.inf, f"backward raised at {problem} seed {seed}: {_short(e.__cause__)}"
    except Exception as e:  # a failing candidate is recorded, never raised out of the sweep
        return math.inf, f"raised at {problem} seed {seed}: {_short(e)}"
    outs, out_names = as_outputs(out), output_names(spec)
    if len(outs) != len(out_names):
        return math.inf, f"{len(outs)} outputs at {problem}, expected {len(out_names)} ({', '.join(out_names)})"
    for o, name in zip(outs, out_names):
        if not isinstance(o, torch.Tensor) or o.dtype != dtype:
            got = o.dtype if isinstance(o, torch.Tensor) else type(o).__name__
            return math.inf, f"wrong {name} dtype at {problem}: {got}, expected {dtype}"
    inp64, pos = Inputs(_to64(inp.args), _to64(inp.kwargs)), []
    if grad:
        inp64, pos = with_grad(spec, inp64)
    with torch.set_grad_enabled(grad):
        ref = spec.reference(*inp64.args, **inp64.kwargs)
    names = arg_names(spec)
    eager = spec.impls["eager"]
    eager_res = None if impl is eager else _run(eager.fn, spec, inp, grad, seed, device)
    eager_outs = as_outputs(eager_res[0]) if eager_res is not None else (None,) * len(outs)
    # (what, candidate, float64 reference, bound, zero floor, eager's counterpart or None, a gradient)
    checks = [(name, o, r, spec.rtol[dtype], 0.0, e, False)
              for name, o, r, e in zip(out_names, outs, as_outputs(ref), eager_outs)]
    if grad:
        floor = 1e-6 * grad_norm(dy)  # a gradient below this counts as zero
        refs = torch.autograd.grad(ref, [inp64.args[i] for i in pos], _to64(dy), allow_unused=True)
        eager_grads = eager_res[1] if eager_res is not None else (None,) * len(pos)
        for i, g, r, e in zip(pos, grads, refs, eager_grads):
            r = torch.zeros_like(inp64.args[i]) if r is None else r
            checks.append((f"grad of {names[i]}", g, r, spec.grad_rtol[dtype], floor, e, True))
    worst = 0.0
    for what, o, r, bound, fl, e, is_grad in checks:
        if o is None:
            return math.inf, f"{what} missing at {problem} (backward returned None)"
        if o.dtype != dtype:
            return math.inf, f"{what} has dtype {o.dtype} at {problem}, expected {dtype}"
        if eager_res is not None:
            e_err = rel_error(e, r, fl) if e is not None else math.inf
            if math.isfinite(e_err):
                bound = max(bound, EAGER_FACTOR * e_err)
        err = rel_error(o, r, fl)
        worst = max(worst, err)
        if impl is eager and is_grad and math.isfinite(err):
            continue
        if not err <= bound:
            desc = "NaN/Inf where the reference is finite (or shape mismatch)" if math.isinf(err) else f"{err:.2e}"
            return err, f"wrong {what} at {problem} seed {seed}: rel error {desc} > bound {bound:.1e}"
    return worst, None


# The defaults check runs on inputs scaled by this (exact in binary floats): where a default depends on the dtype
# (rms_norm's eps=None: the compute dtype's eps, 1.2e-7, against bfloat16's 7.8e-3), rows of mean square ~1e-5 show it.
DEFAULTS_SCALE = 2.0 ** -8


def check_defaults(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
                   grad: bool = False) -> tuple[float, str | None]:
    """``impl`` against eager (torch's semantics) at ``dtype`` with each optional argument omitted in turn (the inputs
    factory passes them explicitly): a tier whose own default differs from the declared one fails here. The floating
    inputs are scaled by DEFAULTS_SCALE; the bound is twice the dtype's (both sides carry its rounding)."""
    eager = spec.impls["eager"]
    if impl is eager or impl.tier == Tier.PEER:
        return 0.0, None
    inp = spec.make_inputs(problem, dtype, device, 3)
    args = [a * DEFAULTS_SCALE if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in inp.args]
    params = list(inspect.signature(spec.reference).parameters.values())
    worst = 0.0
    for i, p in enumerate(params):
        if p.default is inspect.Parameter.empty or (i >= len(args) and p.name not in inp.kwargs):
            continue
        kwargs = {k: v for k, v in inp.kwargs.items() if k != p.name}
        kwargs.update({params[j].name: args[j] for j in range(i + 1, len(args))})
        call = Inputs(tuple(args[:i]), kwargs)
        try:
            out, grads, _ = _run(impl.fn, spec, call, grad, 3, device)
        except (_NoBackward, _InBackward) as e:
            cause = e.__cause__ or e
            return math.inf, f"{p.name} omitted at {problem}: backward failed: {_short(cause)}"
        except Exception as e:
            return math.inf, f"raised with {p.name} omitted at {problem}: {_short(e)}"
        want, want_grads, _ = _run(eager.fn, spec, call, grad, 3, device)
        pairs = [(n, o, w, spec.rtol[dtype]) for n, o, w in zip(output_names(spec), as_outputs(out), as_outputs(want))]
        pairs += [(f"grad of {params[j].name}", g, w, spec.grad_rtol[dtype])
                  for j, g, w in zip([k for k in spec.grad_args if k < i and isinstance(args[k], torch.Tensor)
                                      and args[k].is_floating_point()], grads, want_grads) if w is not None]
        for what, o, w, bound in pairs:
            err = rel_error(o, w) if isinstance(o, torch.Tensor) else math.inf
            worst = max(worst, err)
            if not err <= 2 * bound:
                return err, (f"wrong {what} with {p.name} omitted (its default) at {problem}: rel error {err:.2e} from "
                             f"eager's > bound {2 * bound:.1e}")
    return worst, None


def gate_problem(spec: OpSpec, problem: Problem, device: torch.device, grad: bool = False
                 ) -> tuple[Problem, str | None]:
    """The problem the gate checks at ``problem``, and a note where it is not ``problem`` itself: a row-wise problem
    whose float64 check would move more than ``envs.gate_bytes`` is checked on its first rows (as many as fit), so the
    gate's memory and time stay bounded on huge tensors; the edge problems still cover every code path. Not sampled:
    problems of one dim, a reduction over dim 0 (``dim``, or a ``normalized_shape`` of every dim), and ops whose
    problem counts segments of the rows."""
    budget = envs.gate_bytes(device.type)
    need = spec.mode_bytes(problem, torch.float64, "fwd+bwd" if grad else "fwd_nograd")
    shape, kw = problem.shape, problem.kw
    if need <= budget or len(shape) < 2 or shape[0] < 2 or "segments" in kw:
        return problem, None
    dim, ns = kw.get("dim"), kw.get("normalized_shape")
    if (isinstance(dim, int) and dim % len(shape) == 0) or (ns is not None and len(tuple(ns)) >= len(shape)):
        return problem, None
    rows = max(1, shape[0] * budget // need)
    try:
        small = spec.problem((rows, *shape[1:]), **kw)
    except (TypeError, ValueError):
        return problem, None
    return small, (f"gated on the first {rows} of {shape[0]} rows (its float64 check would move "
                   f"{need / 2**20:.0f} MiB, over TIERED_OPS_GATE_BYTES={budget / 2**20:.0f} MiB)")


def gate(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
         grad: bool = False) -> tuple[float, str | None]:
    """Worst relative error over the seeds at ``problem`` and the edge problems (and ``check_defaults`` at the first
    edge problem); reason on failure.

    With ``grad`` the gradients are checked as well (the modes fwd, bwd and fwd+bwd share that gate)."""
    key = (spec.name, impl.name, impl.source_hash, dtype, str(device), grad)
    if key not in _edge_results:
        worst = 0.0
        for edge in spec.edge_problems():
            err, why = check_one(spec, impl, edge, dtype, device, seed=len(edge.shape), grad=grad)
            if why and impl.tier == Tier.PEER and "NotImplementedError" in why:
                continue  # a case the peer declares it does not cover (e.g. a non-last softmax dim); a wrong answer
                # or any other error still fails it
            worst = max(worst, err)
            if why:
                _edge_results[key] = (False, err, f"edge case: {why}")
                break
        else:
            err, why = check_defaults(spec, impl, spec.edge_problems()[0], dtype, device, grad)
            _edge_results[key] = (True, worst, None) if why is None else (False, err, f"defaults: {why}")
    ok, worst, why = _edge_results[key]
    if not ok:
        return worst, why
    pkey = key + (problem,)
    if pkey not in _problem_results:
        res: tuple[float, str | None] = (worst, None)
        checked, note = gate_problem(spec, problem, device, grad)
        if note:
            log.info("%s %s %s %s: %s", spec.name, impl.name, problem, DTYPE_NAMES[dtype], note)
        for seed in SEEDS:
            err, why = check_one(spec, impl, checked, dtype, device, seed, grad)
            res = (max(res[0], err), None)
            if why:
                res = (err, why)
                break
        _problem_results[pkey] = res
    err, why = _problem_results[pkey]
    return max(err, worst) if why is None else err, why


def in_compiled_caller(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a compiled caller runs it: traced into a small torch.compile'd function between two pointwise ops
    (one graph per shape). There the eager and compile tiers fuse with their neighbours, while a Triton or CUDA op
    is a fusion barrier the caller pays for: the same neighbours for every tier make the times comparable."""
    def caller(first: torch.Tensor, *rest: Any, **kw: Any) -> Any:
        out = fn(first * 0.5, *rest, **kw)
        return out * 2 if isinstance(out, torch.Tensor) else tuple(o * 2 for o in out)

    return torch.compile(caller, dynamic=False, fullgraph=True)


_callers: dict[Callable[..., Any], Callable[..., Any]] = {}  # in_compiled_caller per implementation's function


def timed_call(spec: OpSpec, impl: Impl, inp: Inputs, mode: str, context: str = "eager") -> Callable[[], Any]:
    """The call a measurement in ``mode`` times (built once; a bwd call replays a retained graph); ``compiled``:
    inside a compiled caller (``in_compiled_caller``). The harness's inputs are valid: the call is timed as the hot
    path of ``tiered_ops.<op>`` makes it, without the contract check (``Impl.unchecked``)."""
    fn, kwargs = impl.unchecked or impl.fn, inp.kwargs
    if context == "compiled":
        # one compiled caller per implementation in a process: dynamo keeps its graphs per shape there, where a new
        # caller per measurement would compile every shape again (and count toward the recompile limit)
        if impl.fn not in _callers:
            _callers[impl.fn] = in_compiled_caller(impl.fn)
        fn = _callers[impl.fn]
    if mode == "fwd_nograd":
        def call() -> Any:
            with torch.no_grad():
                return fn(*inp.args, **kwargs)
        return call
    ginp, pos = with_grad(spec, inp)
    args = ginp.args
    leaves = [args[i] for i in pos]
    if mode == "fwd":
        return lambda: fn(*args, **kwargs)
    with torch.enable_grad():
        out = fn(*args, **kwargs)
    dy = grad_output(out, 0)
    if mode == "bwd":
        return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)
    return lambda: torch.autograd.grad(fn(*args, **kwargs), leaves, dy)


def base_row(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, mode: str, fp: Fingerprint
             ) -> dict[str, Any]:
    """The identifying columns of a store row, not yet ok (a measurement fills in the rest)."""
    return dict(
        op=spec.name, impl=impl.name, tier=impl.tier.label, mode=mode, problem=str(problem),
        bucket=bucket_str(spec.bucket(problem)), dtype=DTYPE_NAMES[dtype], device_key=fp.key,
        device_type=fp.device_type, gpu_name=fp.name, capability=fp.capability, sm_count=fp.sm_count,
        torch_version=fp.torch, triton_version=fp.triton, cuda_version=fp.cuda, source_hash=impl.source_hash,
        timestamp=time.time(), ok=0,
    )


def measure(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
            mode: str = "fwd_nograd", context: str = "eager", prune_above_us: float | None = None,
            best: str = "") -> dict[str, Any]:
    """Gate, then time one implementation in ``mode`` as a caller in ``context`` runs it (``eager``: called from
    Python; ``compiled``: traced into a compiled caller); returns a store row (never raises for a bad candidate).
    A graphed caller needs no measurement of its own: it pays the kernel time an eager row holds.

    ``prune_above_us`` (successive halving): a short first timing (``time_call(quick=True)``) whose caller p20 lies
    above it ends the measurement there: the row keeps the short timing's figures, with the reason
    ``pruned: ...`` naming ``best`` (what the sweep measured fastest in this case). It is correct and timed, so a
    decision may read it, and it never wins against ``best``: its whole range lies above best's p80."""
    check_mode(mode)
    if check_context(context) == "graphed":
        raise ValueError("context: a graphed caller's figure is the kernel time of the eager measurement")
    row = base_row(spec, impl, problem, dtype, mode, fingerprint(device))
    row["context"] = context
    why = impl.why_not(device, dtype)
    if why:
        row.update(reason=f"unavailable: {why}", env=environment())  # failures that may be the environment's
        return row
    inp = spec.make_inputs(problem, dtype, device, 0)
    t0 = time.perf_counter()
    try:
        call = timed_call(spec, impl, inp, mode, context)
        call()  # warm-up: JIT, torch.compile, autotuning; recorded, not timed
        sync(device)
    except Exception as e:
        row.update(reason=f"first call raised: {_short(e)}", first_call_s=time.perf_counter() - t0, env=environment())
        return row
    row["first_call_s"] = time.perf_counter() - t0
    err, why = gate(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES)
    row["rel_error"] = err if math.isfinite(err) else None
    if why:
        row["reason"] = why
        if "raised at" in why:  # an exception (a build, a compile), not a wrong answer: it may be the environment's
            row["env"] = environment()
        return row
    row["ok"] = 1
    sample_note = gate_problem(spec, problem, device, mode in GRAD_MODES)[1]
    if sample_note:
        row["reason"] = f"correct ({sample_note})"
    not_timeable = impl.timeable(device)
    if not_timeable:
        row["reason"] = f"correct; not timed: {not_timeable}" + (f" ({sample_note})" if sample_note else "")
        return row
    row["peak_bytes"] = peak_bytes(call, device)
    nbytes = spec.mode_bytes(problem, dtype, mode)
    if prune_above_us is not None:
        t = time_call(call, device, quick=True)
        lo = max(t.p20_us, t.host_us)  # the low end of what a caller sees (timing.caller_range)
        if lo > prune_above_us and not (t.contended and contention_check()):
            copy = copy_bandwidth_gbps(device)
            gbps = nbytes / (t.p50_us * 1e-6) / 1e9 if t.p50_us > 0 and context == "eager" else None
            row.update(p20_us=t.p20_us, p50_us=t.p50_us, p80_us=t.p80_us, host_us=t.host_us,
                       host_p20_us=t.host_p20_us, host_p80_us=t.host_p80_us, caller_us=t.caller_us, gbps=gbps,
                       copy_gbps=copy, frac_copy=(gbps / copy) if gbps else None,
                       reason=f"{PRUNED}a short timing's caller p20 {lo:.1f} us is above {prune_above_us:.1f} us "
                              f"({PRUNE_FACTOR:g} x the p80 of {best or 'the fastest so far'}): not timed in full")
            return row
    for attempt in range(1, CONTENDED_TRIES + 1):
        t = time_call(call, device)
        copy = copy_bandwidth_gbps(device)
        gbps = nbytes / (t.p50_us * 1e-6) / 1e9 if t.p50_us > 0 else None
        busy = "; ".join(w for w in (t.contended, _beyond_copy(gbps, copy, nbytes, device)) if w)
        if not busy or not contention_check():
            busy = ""
            break
        log.info("%s %s %s %s %s: %s (attempt %d of %d)", spec.name, impl.name, problem, DTYPE_NAMES[dtype], mode,
                 busy, attempt, CONTENDED_TRIES)
        if attempt < CONTENDED_TRIES:
            time.sleep(CONTENDED_PAUSE_S)
    if context != "eager":
        gbps = None  # the neighbours move bytes too: no bandwidth of the op alone
    row.update(p20_us=t.p20_us, p50_us=t.p50_us, p80_us=t.p80_us, host_us=t.host_us, host_p20_us=t.host_p20_us,
               host_p80_us=t.host_p80_us, caller_us=t.caller_us,
               gbps=gbps, copy_gbps=copy, frac_copy=(gbps / copy) if gbps else None)
    if busy:
        flag_contended(row, f"{busy}; {CONTENDED_TRIES} tries")
    return row


def peak_bytes(call: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes one call allocates above what was allocated before it (its inputs, a retained graph): the CUDA caching
    allocator's peak during the call minus its allocation before. None on the CPU (no allocator statistics)."""
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return int(peak)


PRUNED = "pruned: "  # the reason of a row a sweep stopped after a short timing (successive halving): correct, slower
PRUNE_FACTOR = 1.5  # a candidate whose short timing's p20 is above this x the fastest full timing's p80 is pruned
CONTENDED = "contended: "  # the reason of a row timed while the machine was busy: kept for the record, never used
CONTENDED_TRIES = 3  # a CPU timing that looks contended is taken again up to this many times in all
CONTENDED_PAUSE_S = 0.2
COPY_BOUND = 1.5  # an op moving at least the copy's bytes cannot beat the copy bandwidth by more than this


def _beyond_copy(gbps: float | None, copy: float, nbytes: int, device: torch.device) -> str | None:
    """On the CPU, a bandwidth no memory system gives: above COPY_BOUND x the copy bandwidth for an op that moves at
    least the copy's bytes (beyond every cache), so the copy figure or this timing was taken on a busy machine."""
    if device.type != "cpu" or not gbps or nbytes < 2 * COPY_BYTES["cpu"] or gbps <= COPY_BOUND * copy:
        return None
    return f"{gbps:.1f} GB/s is {gbps / copy:.2f} x the copy bandwidth {copy:.1f} GB/s (limit {COPY_BOUND:g} x)"


def flag_contended(row: dict[str, Any], why: str) -> dict[str, Any]:
    """Mark a timed row as taken on a busy machine: ok stays 1 (the implementation is correct) and the figures stay
    for the record, but it has no caller time, so no decision, winner or prediction can use it (they all need
    one), and a sweep measures it again."""
    row.update(reason=CONTENDED + why, caller_us=None, host_us=None, host_p20_us=None, host_p80_us=None)
    return row


def contended(row: Any) -> bool:
    """Whether a stored row (a dict or attributes) was flagged as timed on a busy machine."""
    reason = row.get("reason") if isinstance(row, dict) else getattr(row, "reason", None)
    return isinstance(reason, str) and reason.startswith(CONTENDED)


def pruned(row: Any) -> bool:
    """Whether a stored row was stopped after a short timing, clearly slower than another candidate of its case."""
    reason = row.get("reason") if isinstance(row, dict) else getattr(row, "reason", None)
    return isinstance(reason, str) and reason.startswith(PRUNED)


def usable(row: Any) -> bool:
    """Whether a decision may use a stored row: correct, timed, not flagged as contended."""
    get = row.get if isinstance(row, dict) else lambda k: getattr(row, k, None)
    caller = get("caller_us")
    return bool(get("ok")) and caller is not None and caller == caller and not contended(row)


def bucket_str(bucket: tuple) -> str:
    """The stored text of a bucket tuple (``tiered_ops.buckets.encode``)."""
    return encode(bucket)
