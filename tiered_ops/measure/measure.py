"""Measurement of one implementation at one problem, after the gate (``gate``) passed it: written once, driven by
OpSpec. Times the call in the caller's context (``timed_call``) in one call into ``timing`` (``timing.time_row``: the
figures, checked against the copy bandwidth), which runs the gate where it is due (``verdict.gate_if_due``: its
verdict written into the row), flags a timing taken on a busy machine (``rows.CONTENDED``), and returns the store's
row."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import torch

from ..buckets import encode
from ..registry import DTYPE_NAMES, GRAD_MODES, Impl, Inputs, OpSpec, Problem, check_context, check_mode
from ..store.rows import CONTENDED, PRUNED, UNAVAILABLE, WAITING
from .fingerprint import Fingerprint, fingerprint
from .gate import _short, edges_passed, grad_output, with_grad
from .timing import RowFigures, sync, time_row
from .verdict import EDGES, Settings, env_of, gate_if_due

log = logging.getLogger(__name__)


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
    ``verdict.gate_row`` runs the gate where the row would be chosen.

    ``edges``: the worst error of the edge problems' pass that the store recorded (``case.EdgeGates.known``): not
    checked again. A row whose implementation has passed them carries that figure as ``EDGES`` (not a column:
    ``case.EdgeGates.keep`` records it in the store and drops it from the row). ``bucket``: as ``base_row``'s;
    ``settings``: as ``verdict.Settings``."""
    row = _measure(spec, impl, problem, dtype, device, mode, context, prune_above_us, best, gate_first, gated, bucket,
                   settings, edges)
    passed = edges_passed(spec, impl, dtype, device, mode in GRAD_MODES, edges)  # its gate's, or the store's noted
    if passed is not None:
        row[EDGES] = passed
    return row


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
        row.update(reason=UNAVAILABLE + why, env=env_of(settings))  # failures that may be the environment's
        return row
    inp = spec.make_inputs(problem, dtype, device, 0)
    t0 = time.perf_counter()
    try:
        call = _first(spec, impl, inp, mode, context, device)  # warm-up: recorded in first_call_s, not timed
    except Exception as e:
        row.update(reason=f"first call raised: {_short(e)}", first_call_s=time.perf_counter() - t0,
                   env=env_of(settings))
        return row
    row["first_call_s"] = time.perf_counter() - t0
    not_timeable = impl.timeable(device)
    look_first = not gate_first and not not_timeable  # a quick look before the gate: a pruned row costs no gate
    nbytes = spec.mode_bytes(problem, dtype, mode)
    f = time_row(call, device, row["first_call_s"], nbytes, bar_us=prune_above_us, look_first=look_first,
                 between=lambda: gate_if_due(spec, impl, problem, dtype, device, mode, row, settings, edges, gated,
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
