"""Correctness gate and measurement of one implementation at one problem: written once, driven by OpSpec.

Gate: before an implementation is timed at a problem it must match the float64 reference on fresh
random inputs (two seeds) at that problem, and on the op's edge problems (checked once per
implementation, dtype and device in a process; a pass the store recorded is not checked again, ``_noted``).
The error ||out-ref||/||ref|| must stay under the
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
from typing import Any, Callable, Iterable

import torch

from .. import envs
from ..registry import DTYPE_NAMES, Impl, Inputs, OpSpec, Problem, Tier, as_outputs, rel_error

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


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
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


def _sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU's kernels; nothing on the CPU), as ``timing.sync`` does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        _sync(device)
        return out, (), None
    if not all(o.requires_grad for o in outs):
        raise _NoBackward()
    dy = grad_output(out, seed)
    kept = _clone(dy)  # what the reference's backward gets: a backward that writes into its dy cannot change it
    _poison(inp, device)
    try:
        grads = torch.autograd.grad(out, [inp.args[i] for i in pos], dy, allow_unused=True)
        _sync(device)
    except Exception as e:
        raise _InBackward(e) from e
    return out, grads, kept


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
    # the reference and eager read these: an implementation that writes into its inputs cannot move them
    pristine = Inputs(_clone(inp.args), {k: _clone(v) for k, v in inp.kwargs.items()})
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
    inp64, pos = Inputs(_to64(pristine.args), _to64(pristine.kwargs)), []
    if grad:
        inp64, pos = with_grad(spec, inp64)
    with torch.set_grad_enabled(grad):
        ref = spec.reference(*inp64.args, **inp64.kwargs)
    names = arg_names(spec)
    eager = spec.impls["eager"]
    eager_res = None if impl is eager else _run(eager.fn, spec, pristine, grad, seed, device)
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


def gate_problem(spec: OpSpec, problem: Problem, device: torch.device, grad: bool = False,
                 budget: int | None = None) -> tuple[Problem, str | None]:
    """The problem the gate checks at ``problem``, and a note where it is not ``problem`` itself: a row-wise problem
    whose float64 check would move more than ``envs.gate_bytes`` is checked on its first rows (as many as fit), so the
    gate's memory and time stay bounded on huge tensors; the edge problems still cover every code path. Not sampled:
    problems of one dim, a reduction over dim 0 (``dim``, or a ``normalized_shape`` of every dim), and ops whose
    problem counts segments of the rows. ``budget``: ``envs.gate_bytes`` where the caller read it (None: read here)."""
    if budget is None:
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


def _edge_key(spec: OpSpec, impl: Impl, dtype: torch.dtype, device: torch.device, grad: bool) -> tuple:
    return (spec.name, impl.name, impl.source_hash, dtype, str(device), grad)


def edges_passed(spec: OpSpec, impl: Impl, dtype: torch.dtype, device: torch.device, grad: bool,
                 known: float | None = None) -> float | None:
    """The worst relative error over the edge problems where this process checked them and they passed, else None.
    ``known``: a pass the store recorded (``_noted`` first: a measurement's one call here)."""
    key = _noted(_edge_key(spec, impl, dtype, device, grad), known)
    ok, worst, _ = _edge_results.get(key, (False, 0.0, None))
    return worst if ok else None


def _noted(key: tuple, known: float | None) -> tuple:
    """``key`` (``_edge_key``'s), its edge problems noted as passed where ``known`` (the worst error of a pass an
    earlier process recorded in the store) is given: ``gate`` does not check them again here."""
    if known is not None:
        _edge_results.setdefault(key, (True, known, None))
    return key


def edge_checks(spec: OpSpec) -> int:
    """How many checks ``check_edges`` numbers: one per edge problem, then the defaults' check at the first."""
    return len(spec.edge_problems()) + 1


def check_edges(spec: OpSpec, impl: Impl, dtype: torch.dtype, device: torch.device, grad: bool,
                which: Iterable[int] | None = None) -> tuple[float, str | None]:
    """The worst relative error over the edge checks numbered ``which`` (default: all, ``edge_checks``), in order,
    stopping at the first failure: its error and why ("edge case: ..." or "defaults: ..."). ``gate`` runs them all;
    background tuning splits them over several worker processes."""
    edges = spec.edge_problems()
    worst = 0.0
    for i in range(len(edges) + 1) if which is None else which:
        if i == len(edges):
            err, why = check_defaults(spec, impl, edges[0], dtype, device, grad)
            if why:
                return err, f"defaults: {why}"
            continue
        err, why = check_one(spec, impl, edges[i], dtype, device, seed=len(edges[i].shape), grad=grad)
        if why and impl.tier == Tier.PEER and "NotImplementedError" in why:
            continue  # a case the peer declares it does not cover (e.g. a non-last softmax dim); a wrong answer
            # or any other error still fails it
        if why:
            return err, f"edge case: {why}"
        worst = max(worst, err)
    return worst, None


def gate(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
         grad: bool = False, budget: int | None = None, edges: float | None = None) -> tuple[float, str | None]:
    """Worst relative error over the seeds at ``problem`` and the edge problems (and ``check_defaults`` at the first
    edge problem); reason on failure.

    With ``grad`` the gradients are checked as well (the modes fwd, bwd and fwd+bwd share that gate). ``budget``: as
    ``gate_problem``'s. ``edges``: a pass of the edge problems the store recorded (``_noted``): not checked
    again."""
    key = _noted(_edge_key(spec, impl, dtype, device, grad), edges)
    if key not in _edge_results:
        worst, why = check_edges(spec, impl, dtype, device, grad)
        _edge_results[key] = (why is None, worst, why)
    ok, worst, why = _edge_results[key]
    if not ok:
        return worst, why
    err, why = gate_at_problem(spec, impl, problem, dtype, device, grad, budget)
    return max(err, worst) if why is None else err, why


def gate_at_problem(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
                    grad: bool = False, budget: int | None = None) -> tuple[float, str | None]:
    """``gate``'s check at ``problem`` alone (its seeds, sampled as ``gate_problem`` says), without the edge problems:
    worst relative error, reason on failure."""
    pkey = _edge_key(spec, impl, dtype, device, grad) + (problem,)
    if pkey not in _problem_results:
        res: tuple[float, str | None] = (0.0, None)
        checked, note = gate_problem(spec, problem, device, grad, budget)
        if note:
            log.info("%s %s %s %s: %s", spec.name, impl.name, problem, DTYPE_NAMES[dtype], note)
        for seed in SEEDS:
            err, why = check_one(spec, impl, checked, dtype, device, seed, grad)
            res = (max(res[0], err), None)
            if why:
                res = (err, why)
                break
        _problem_results[pkey] = res
    return _problem_results[pkey]
