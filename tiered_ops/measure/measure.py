"""Measurement of one implementation at one problem, after the gate (``gate``) passed it: written once, driven by
OpSpec. Times the call in the caller's context (``timed_call``) in one call into ``timing`` (``timing.time_row``: the
figures, checked against the copy bandwidth), flags a timing taken on a busy machine (``rows.CONTENDED``), and returns
the store's row."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Callable, NamedTuple

import torch

from ..buckets import encode
from ..environment import environment
from ..envs import gate_bytes
from ..registry import DTYPE_NAMES, GRAD_MODES, Impl, Inputs, OpSpec, Problem, Tier, check_context, check_mode
from ..store.rows import CONTENDED, EDGE_ONLY, PRUNED, UNAVAILABLE, WAITING
from .fingerprint import Fingerprint, fingerprint
from .gate import _short, edges_passed, gate, gate_at_problem, gate_problem, grad_output, with_grad
from .timing import RowFigures, sync, time_row

log = logging.getLogger(__name__)


class Settings(NamedTuple):
    """What a measurement reads from the environment, as a caller that measures several candidates read it once
    (the tuner's miss): the gate's byte budget on the device (``envs.gate_bytes``) and whether a CPU timing taken on
    a busy machine is taken again and flagged (``envs.contention_check``), and the build environment a failure that
    may be the environment's is stored with (``environment.environment``; None: read at the failure). None where a
    measurement takes it: read there, when needed."""

    gate_bytes: int
    contention_check: bool
    env: str | None = None


def _env(settings: Settings | None) -> str:
    return environment() if settings is None or settings.env is None else settings.env


# The neighbours an op has in a transformers decoder compiled by Inductor (default mode: a GEMM is an extern call that
# nothing fuses with), as (a pointwise producer of its first input, a pointwise consumer of its outputs). A norm reads
# the residual stream (an add, which Inductor folds into a traced norm) and feeds GEMMs; the loss reads the LM head's
# logits, the SwiGLU product the gate and up projections, the rotary embedding (with or without the QK norm) the q and
# k projections, GPT-2's gelu its first MLP GEMM, the fused residual add + norm the attention's or MLP's output GEMM,
# and each feeds a GEMM, attention or nothing. Softmax (eager attention: masked scores in, a cast out) and any op not
# named: pointwise on both sides.
DECODER_NEIGHBOURS: dict[str, tuple[bool, bool]] = {
    "rms_norm": (True, False), "layer_norm": (True, False), "fused_add_rms_norm": (False, False),
    "cross_entropy": (False, False), "linear_cross_entropy": (False, False), "swiglu": (False, False),
    "rotary_embedding": (False, False), "qk_norm_rope": (False, False), "gelu": (False, False),
}


def in_compiled_caller(fn: Callable[..., Any], op: str = "") -> Callable[..., Any]:
    """``fn`` as a compiled caller runs it: traced into a small torch.compile'd function (one graph per shape) with
    the neighbours ``op`` has in a decoder (``DECODER_NEIGHBOURS``: a pointwise op before its first input, after each
    output, or neither). There the eager and compile tiers fuse with a pointwise neighbour, while a Triton or CUDA op is
    a fusion barrier the caller pays for, and where a GEMM is the neighbour neither fuses: the same neighbours for
    every tier make the times comparable."""
    before, after = DECODER_NEIGHBOURS.get(op, (True, True))

    def caller(first: torch.Tensor, *rest: Any, **kw: Any) -> Any:
        out = fn(first * 0.5 if before else first, *rest, **kw)
        if not after:
            return out
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
            _callers[impl.fn] = in_compiled_caller(impl.fn, spec.name)
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


def base_row(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, mode: str, fp: Fingerprint,
             bucket: str | None = None) -> dict[str, Any]:
    """The identifying columns of a store row, not yet ok (a measurement fills in the rest). ``bucket``: the bucket's
    stored text where the caller has it (``buckets.encode`` of ``spec.bucket(problem)``), else made here."""
    return dict(
        op=spec.name, impl=impl.name, tier=impl.tier.label, mode=mode, problem=str(problem), dtype=DTYPE_NAMES[dtype],
        bucket=bucket if bucket is not None else bucket_str(spec.bucket(problem)), device_key=fp.key,
        device_type=fp.device_type, gpu_name=fp.name, capability=fp.capability, sm_count=fp.sm_count,
        torch_version=fp.torch, triton_version=fp.triton, cuda_version=fp.cuda, source_hash=impl.source_hash,
        timestamp=time.time(), ok=0,
    )


def measure(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device,
            mode: str = "fwd_nograd", context: str = "eager", prune_above_us: float | None = None,
            best: str = "", gate_first: bool = True, gated: bool = True, edges: float | None = None,
            bucket: str | None = None, settings: Settings | None = None) -> dict[str, Any]:
    """Gate, then time one implementation in ``mode`` as a caller in ``context`` runs it (``eager``: called from
    Python; ``compiled``: traced into a compiled caller); returns a store row (never raises for a bad candidate).
    A graphed caller needs no measurement of its own: it pays the kernel time an eager row holds.

    ``prune_above_us`` (successive halving): a short first timing (``timing.time_call(quick=True)``) whose caller p20
    lies above it ends the measurement there: the row keeps the short timing's figures, with the reason
    ``pruned: ...`` naming ``best`` (what the sweep measured fastest in this case). It is correct and timed, so a
    decision may read it, and it never wins against ``best``: its whole range lies above best's p80.
    A long GPU call (``timing.long_call``) is never pruned: its short timing would cost what its full one does.
    ``gate_first=False``: the short timing comes before the gate, so a pruned candidate costs no gate (its edge
    problems compile and run for a compiled tier): its row is not ok (never gated, never chosen), ``pruned: ...``.
    ``gated=False``: timed without the gate; the row is not ok, its reason ``not gated: ...`` (``rows.UNGATED``), until
    ``gate_row`` runs the gate where the row would be chosen.

    ``edges``: the worst error of the edge problems' pass that the store recorded (``EdgeGates.known``): not checked
    again. A row whose implementation has passed them carries that figure as ``EDGES`` (not a column:
    ``EdgeGates.keep`` records it in the store and drops it from the row). ``bucket``: as ``base_row``'s;
    ``settings``: as ``Settings``."""
    row = _measure(spec, impl, problem, dtype, device, mode, context, prune_above_us, best, gate_first, gated, bucket,
                   settings, edges)
    return _with_edges(spec, impl, dtype, device, mode, row, edges)


def first_call(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str
               ) -> float:
    """Seconds of ``impl``'s first call at ``problem`` in ``mode`` (its JIT or torch.compile at this shape, as
    ``measure`` records it in ``first_call_s``), nothing timed or gated: a gate helper runs it beside the measuring
    worker, so the kernels are in the compilers' on-disk caches when the worker reaches the candidate. A call that
    raises raises here (the worker's own first call then meets it and records why)."""
    inp = spec.make_inputs(problem, dtype, device, 0)
    t0 = time.perf_counter()
    _first(spec, impl, inp, mode, "eager", device)
    return time.perf_counter() - t0


def _first(spec: OpSpec, impl: Impl, inp: Inputs, mode: str, context: str, device: torch.device) -> Callable[[], Any]:
    """The call a measurement times, made once (JIT, torch.compile, autotuning) and synchronized."""
    call = timed_call(spec, impl, inp, mode, context)
    call()
    sync(device)
    return call


def _with_edges(spec: OpSpec, impl: Impl, dtype: torch.dtype, device: torch.device, mode: str,
                row: dict[str, Any], known: float | None) -> dict[str, Any]:
    """``row`` with ``EDGES`` where its implementation passed the edge problems (``known``: the store's pass, noted
    there too): a measurement's one call into the gate's edge bookkeeping besides the gate itself."""
    passed = edges_passed(spec, impl, dtype, device, mode in GRAD_MODES, known)
    if passed is not None:
        row[EDGES] = passed
    return row


def _measure(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
             context: str, prune_above_us: float | None, best: str, gate_first: bool, gated: bool,
             bucket: str | None, settings: Settings | None, edges: float | None = None) -> dict[str, Any]:
    check_mode(mode)
    if check_context(context) == "graphed":
        raise ValueError("context: a graphed caller's figure is the kernel time of the eager measurement")
    row = base_row(spec, impl, problem, dtype, mode, fingerprint(device), bucket)
    row["context"] = context
    why = impl.why_not(device, dtype)
    if why:
        row.update(reason=UNAVAILABLE + why, env=_env(settings))  # failures that may be the environment's
        return row
    inp = spec.make_inputs(problem, dtype, device, 0)
    t0 = time.perf_counter()
    try:
        call = _first(spec, impl, inp, mode, context, device)  # warm-up: recorded in first_call_s, not timed
    except Exception as e:
        row.update(reason=f"first call raised: {_short(e)}", first_call_s=time.perf_counter() - t0, env=_env(settings))
        return row
    row["first_call_s"] = time.perf_counter() - t0
    not_timeable = impl.timeable(device)
    look_first = not gate_first and not not_timeable  # a quick look before the gate: a pruned row costs no gate
    f = time_row(call, device, row["first_call_s"], spec.mode_bytes(problem, dtype, mode), bar_us=prune_above_us,
                 look_first=look_first,
                 between=lambda: _gated(spec, impl, problem, dtype, device, mode, row, settings, edges, gated,
                                        not_timeable),
                 check_busy=None if settings is None else settings.contention_check, tries=CONTENDED_TRIES,
                 pause_s=CONTENDED_PAUSE_S,
                 label=(spec.name, impl.name, problem, DTYPE_NAMES[dtype], mode))
    if f.timing is None:
        return row
    _with_figures(row, f, context)
    if f.pruned_at_us is not None:
        row["reason"] = (f"{PRUNED}a short timing's caller p20 {f.pruned_at_us:.1f} us is above "
                         f"{prune_above_us:.1f} us ({PRUNE_FACTOR:g} x the p80 of {best or 'the fastest so far'}): "
                         "not timed in full" + ("; not gated either (never chosen)" if look_first else ""))
        if look_first:
            row["ok"] = 0
        return row
    if not gated:
        row["reason"] = WAITING
    if f.busy:
        flag_contended(row, f"{f.busy}; {CONTENDED_TRIES} tries")
    return row


def _gated(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
           row: dict[str, Any], settings: Settings | None, edges: float | None, gated: bool, not_timeable: str | None
           ) -> bool:
    """A measurement's gate, where it runs (``gated``, or a row that cannot be timed: nothing later would gate it),
    written into the row: whether the row goes on to be timed. A peer failing only an edge case it does not claim is
    timed; a row that cannot be timed ends here, its reason saying so where the gate passed."""
    if not (gated or not_timeable):
        return True
    edge, sample_note = _gate_into(spec, impl, problem, dtype, device, mode, row, settings, edges)
    if not row["ok"] and not edge:
        return False
    if not_timeable:
        if not edge:
            row["reason"] = f"correct; not timed: {not_timeable}" + (f" ({sample_note})" if sample_note else "")
        return False
    return True


def _with_figures(row: dict[str, Any], f: RowFigures, context: str) -> None:
    """The row's timing columns from ``f``: the peak where it was taken; no bandwidth of the op alone inside a
    compiled caller (the neighbours move bytes too)."""
    t = f.timing
    if f.peaked:
        row["peak_bytes"] = f.peak_bytes
    gbps = f.gbps if context == "eager" else None
    row.update(p20_us=t.p20_us, p50_us=t.p50_us, p80_us=t.p80_us, host_us=t.host_us, host_p20_us=t.host_p20_us,
               host_p80_us=t.host_p80_us, caller_us=t.caller_us,
               gbps=gbps, copy_gbps=f.copy_gbps, frac_copy=(gbps / f.copy_gbps) if gbps else None)


def gate_row(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
             row: dict[str, Any], edges: float | None = None, settings: Settings | None = None) -> dict[str, Any]:
    """The gate of ``row``'s implementation at ``problem`` in ``mode``, written into the row: ok and its relative
    error where it passed (its reason then says what the gate sampled, or nothing), else not ok and why. ``edges``
    and the row's ``EDGES``, and ``settings``, as in ``measure``."""
    _gate_into(spec, impl, problem, dtype, device, mode, row, settings, edges)
    return _with_edges(spec, impl, dtype, device, mode, row, edges)


def _gate_into(spec: OpSpec, impl: Impl, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str,
               row: dict[str, Any], settings: Settings | None = None, edges: float | None = None
               ) -> tuple[bool, str | None]:
    """``gate_row``'s work on the row: (whether it marked the row ``rows.EDGE_ONLY``, what the gate sampled of
    ``problem`` where it passed: None, all of it). ``edges``: as ``gate``'s."""
    budget = gate_bytes(device.type) if settings is None else settings.gate_bytes  # one: the gate's and its note's
    err, why = gate(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES, budget=budget, edges=edges)
    if why and impl.tier == Tier.PEER and why.startswith("edge case: "):
        # a peer is measured for comparison, never chosen: one that fails an edge case it does not claim (Liger at 0
        # rows) is still timed where it is correct, marked, so the reports show it beside ours
        at, wrong = gate_at_problem(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES, budget=budget)
        if wrong is None:
            row.update(ok=0, rel_error=at if math.isfinite(at) else None,
                       reason=EDGE_ONLY + why[len("edge case: "):])
            return True, None
    row["rel_error"] = err if math.isfinite(err) else None
    if why:
        row.update(ok=0, reason=why)
        if "raised at" in why:  # an exception (a build, a compile), not a wrong answer: it may be the environment's
            row["env"] = _env(settings)
        return False, None
    note = gate_problem(spec, problem, device, mode in GRAD_MODES, budget)[1]
    row.update(ok=1, reason=f"correct ({note})" if note else None)
    return False, note


EDGES = "edges_rel_error"  # a row's field (not a store column): its implementation passed the edge problems


def edge_store_key(spec: OpSpec, impl: Impl, dtype: torch.dtype, fp: Fingerprint, mode: str) -> tuple:
    """The store's key (``EDGE_KEY``) of ``impl``'s edge gate at ``dtype`` on the device ``fp`` names in ``mode``."""
    return (spec.name, impl.name, impl.source_hash, DTYPE_NAMES[dtype], fp.key, int(mode in GRAD_MODES),
            fp.torch or "", fp.triton or "")


PRUNE_FACTOR = 1.5  # a candidate whose short timing's p20 is above this x the fastest full timing's p80 is pruned
CONTENDED_TRIES = 3  # a CPU timing that looks contended is taken again up to this many times in all
CONTENDED_PAUSE_S = 0.2


def flag_contended(row: dict[str, Any], why: str) -> dict[str, Any]:
    """Mark a timed row as taken on a busy machine: ok stays 1 (the implementation is correct) and the figures stay
    for the record, but it has no caller time, so no decision, winner or prediction can use it (they all need
    one), and a sweep measures it again."""
    row.update(reason=CONTENDED + why, caller_us=None, host_us=None, host_p20_us=None, host_p80_us=None)
    return row


def bucket_str(bucket: tuple) -> str:
    """The stored text of a bucket tuple (``tiered_ops.buckets.encode``)."""
    return encode(bucket)


def memory_bytes(device: torch.device) -> int | None:
    """The device's total memory in bytes (the host's RAM for the CPU), or None where it cannot be read."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None


def check_fits(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str) -> None:
    """Measuring ``problem`` allocates its inputs and outputs at least: a ValueError saying what was asked and why
    it cannot be where they exceed the device's memory (rather than the allocator's error from inside a measurement)."""
    need, total = spec.mode_bytes(problem, dtype, mode), memory_bytes(device)
    if total is not None and need > total:
        raise ValueError(f"{spec.name} at {problem} {DTYPE_NAMES[dtype]} {mode}: measuring it needs at least "
                         f"{need / 2**30:.3g} GiB of inputs and outputs, more than the {total / 2**30:.3g} GiB of "
                         f"{device} memory; ask for a shape that fits, or decide it where it fits and share the store")
