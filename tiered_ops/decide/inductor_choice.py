"""Inductor's choice among an op's tiers inside torch.compile (``TIERED_OPS_COMPILE_CHOICE=inductor``).

Where the installed torch has Inductor's custom-op autotuning (``register_custom_op_autotuning`` in
``torch._inductor.kernel.custom_op``) with ``min_speedup_threshold`` (2.13; 2.11's takes ``configs``, ``dispatch_on``
and ``split_points`` but fails to lower an input that Inductor has not realized), a traced inference call of
``tiered_ops.<op>`` goes into the caller's graph as one custom op, ``tiered_ops::<op>_choice``, whose Inductor choices
are the op's tiers that can run in a graph: the eager tier (and any other plain-torch implementation of the op), traced
into Inductor's IR as the decomposition, and the kernel tiers (Triton, CUDA) where they run on the device and dtype. Its
fallback is the op's plain eager call. Inductor times each choice on the call's sizes while it compiles the caller,
takes the fastest (the fallback unless another beats it by ``TIERED_OPS_COMPILE_CHOICE_MIN_SPEEDUP``, where torch has
the threshold) and inlines a winning decomposition into the graph, where it fuses with its neighbours as any traced code
does.

What Inductor timed is stored as compiled-context rows of the bucket (``origin`` ``inductor``): its winner gated in
float64 (a winner that fails the gate is stored not ok, so no decision takes it), the others timed, not gated (never
chosen: ``rows.UNGATED``), the compile tier priced as the eager tier (the same code in a graph), an implementation
that cannot run here unavailable. The next process, ``select_backend(..., context="compiled")`` and the table mode
read them as any compiled-context decision. Inductor reports the timings of each choice to its feedback savers
(``select_algorithm.add_feedback_saver``), not the choice itself: the winner is taken from them by torch's own rule
(fastest; the fallback unless another beats it by the threshold). A torch without feedback savers stores nothing.

Training calls (``fwd+bwd``), calls that promote mixed dtypes, ops with several outputs and a torch without the API
keep the table mode (``compiled.trace_choice``); the last is said once in an INFO line.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
from typing import Any, Callable

import torch

from .. import envs
from ..measure.fingerprint import fingerprint
from ..measure.gate import gate
from ..measure.measure import base_row, bucket_str
from ..registry import DTYPE_NAMES, DTYPES, Impl, OpSpec, Tier
from ..store.rows import UNAVAILABLE, UNGATED
from ..store.store import STORE_ERRORS
from ..tiers import cuda_ext
from ..tiers.catalog import get_op
from . import decide as _decide
from .compiled import _assume_constant_result, _run_for_real
from .signature import _POSITIONAL, tensor_args

log = logging.getLogger(__name__)
_lock = threading.RLock()
_ops: dict[str, Any] = {}  # op name -> its registered choice op (torch.library CustomOpDef)
_why_not: list[str | None] = []  # [] until checked, then [None] or [why the API is missing]
_told = False
# (op, problem, dtype, device) -> the implementation Inductor chose, for this process (``chosen``)
_chosen: dict[tuple[str, str, str, str], str] = {}
FALLBACK = "fallback"  # Inductor's fallback choice: the op's plain eager call (the eager tier, not fused)
ORIGIN = "inductor"


def unavailable() -> str | None:
    """Why the installed torch has no custom-op autotuning that this mode can use, or None."""
    if not _why_not:
        try:
            from torch._inductor.kernel.custom_op import CustomOpConfig, register_custom_op_autotuning  # noqa: F401
        except ImportError as e:
            _why_not.append(f"torch {torch.__version__} has no Inductor custom-op autotuning ({e})")
        else:
            params = inspect.signature(register_custom_op_autotuning).parameters
            # torch 2.11's has configs but not the threshold, and its lowering raises NotImplementedError (Pointwise)
            # for an input that Inductor has not realized, such as the op's pointwise neighbour (seen on an H200):
            # the threshold's arrival (2.13) marks the API this mode uses
            _why_not.append(None if "configs" in params and "min_speedup_threshold" in params else
                            f"torch {torch.__version__}'s register_custom_op_autotuning lacks "
                            f"{'configs' if 'configs' not in params else 'min_speedup_threshold'} (its lowering "
                            "of an unrealized input fails before 2.13)")
    return _why_not[0]


def _api() -> dict[str, Any]:
    """What the installed torch's registration takes beyond the op and its configs (feature-detected)."""
    from torch._inductor.kernel.custom_op import register_custom_op_autotuning

    params = inspect.signature(register_custom_op_autotuning).parameters
    extra: dict[str, Any] = {}
    if "min_speedup_threshold" in params:
        extra["min_speedup_threshold"] = envs.compile_choice_min_speedup()
    return extra


def routed(spec: OpSpec, mode: str, mixed: bool) -> bool:
    """Whether a traced call of ``spec`` in ``mode`` goes to Inductor's choice: the mode asked for, the API here, an
    inference call of one output without a promotion. Said once (INFO) where the API is missing."""
    global _told
    if envs.compile_choice() != "inductor" or mode != "fwd_nograd" or mixed or len(spec.outputs) != 1:
        return False
    why = unavailable()
    if why is not None:
        if not _told:
            _told = True
            log.info("TIERED_OPS_COMPILE_CHOICE=inductor: %s; compiled callers use the stored decisions (table)", why)
        return False
    return True


@_assume_constant_result
def traced_route(op: str, mode: str, mixed: bool, others: tuple) -> str | None:
    """Called for real while dynamo traces a call of ``tiered_ops.<op>`` (its result a constant of the graph, as
    ``compiled.trace_choice``'s): the call's non-tensor arguments encoded for ``tiered_ops::<op>_choice`` where the
    call goes to Inductor's choice (the op registered then, once), else None (the table mode)."""
    spec = get_op(op)
    with _run_for_real():
        if not routed(spec, mode, mixed):
            return None
        register(spec)
    names = set(tensor_args(spec)[0])
    return encode({k: v for k, v in others if k not in names})


def encode(args: dict[str, Any]) -> str:
    """A call's non-tensor arguments as the choice op's string argument (tuples and dtypes kept)."""
    def enc(v: Any) -> Any:
        if isinstance(v, torch.dtype):
            return {"dtype": DTYPE_NAMES.get(v, str(v).removeprefix("torch."))}
        if isinstance(v, (tuple, list)):
            return {"tuple": [enc(i) for i in v]}
        return v
    return json.dumps({k: enc(v) for k, v in args.items()}, sort_keys=True)


def decode(call: str) -> dict[str, Any]:
    def dec(v: Any) -> Any:
        if isinstance(v, dict) and "dtype" in v:
            return DTYPES.get(v["dtype"]) or getattr(torch, v["dtype"])
        if isinstance(v, dict) and "tuple" in v:
            return tuple(dec(i) for i in v["tuple"])
        return v
    return {k: dec(v) for k, v in json.loads(call).items()}


def _bind(spec: OpSpec, tensors: tuple, kw: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The op's (args, kwargs) from the choice op's: its tensors (positional, the optional ones left out where they
    are None keyword arguments), its ``call`` string and those None tensors as keyword arguments."""
    kw = dict(kw)
    given = decode(kw.pop("call"))
    names = tensor_args(spec)[0]
    present = iter(tensors)
    for n in names:
        given[n] = kw.pop(n) if n in kw else next(present)
    params = inspect.signature(spec.reference).parameters.values()
    args = tuple(given[p.name] for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY and p.name in given)
    return args, {p.name: given[p.name] for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in given}


def _decomposition(spec: OpSpec, impl: Impl) -> Callable[..., torch.Tensor]:
    """One choice: ``impl`` called with the op's arguments (contiguous output: every choice's layout must match)."""
    fn = impl.unchecked or impl.fn

    def choice(*tensors: torch.Tensor, **kw: Any) -> torch.Tensor:
        args, kwargs = _bind(spec, tensors, kw)
        return fn(*args, **kwargs).contiguous()

    choice.__name__ = choice.__qualname__ = f"{spec.name}_{impl.name}"
    choice.impl = impl.name  # type: ignore[attr-defined]
    return choice


def choices(spec: OpSpec, device: torch.device, dtype: torch.dtype) -> list[Impl]:
    """The implementations Inductor chooses among for ``spec`` on ``device`` at ``dtype``: ours that run in a graph
    there (the plain-torch ones, traced; the kernel tiers where they run and can be timed), not the compile tier
    (inside a graph it is the eager tier's code) nor a peer."""
    out = []
    for impl in spec.impls.values():
        if impl.tier in (Tier.PEER, Tier.COMPILE) or impl.why_not(device, dtype) is not None:
            continue
        if _not_here(impl, device):
            continue
        out.append(impl)
    return out


def _not_here(impl: Impl, device: torch.device) -> str | None:
    """Why a kernel tier is no choice on ``device`` (None: it is): unavailable, not timeable (the Triton
    interpreter), or, for the CUDA tier, its extension not built yet (a compile never builds it)."""
    if impl.tier == Tier.CUDA and not cuda_ext.load_if_built(device):
        return "the CUDA extension is not built here"
    if impl.tier in (Tier.TRITON, Tier.CUDA):
        return impl.available(device) or impl.timeable(device)
    return None


def _config_generator(spec: OpSpec) -> Callable[[dict[str, torch.Tensor]], list[Any]]:
    from torch._inductor.kernel.custom_op import CustomOpConfig

    def generate(fakes: dict[str, torch.Tensor]) -> list[Any]:
        x = next(iter(fakes.values()))
        return [CustomOpConfig(_decomposition(spec, i)) for i in choices(spec, x.device, x.dtype)]
    return generate


def register(spec: OpSpec) -> Any:
    """``tiered_ops::<op>_choice`` (the op's tensors and its other arguments as one string; its body the eager tier,
    its fake the eager tier on fake tensors) registered for Inductor's autotuning with the op's tiers as choices;
    once per op. The feedback saver that stores what Inductor chose is added once per process."""
    with _lock:
        if spec.name in _ops:
            return _ops[spec.name]
        from torch._inductor.kernel.custom_op import CustomOpConfig, register_custom_op_autotuning

        names, optional = tensor_args(spec)
        schema = "(" + ", ".join(f"Tensor{'?' if n in optional else ''} {n}" for n in names) + ", str call) -> Tensor"
        eager = spec.impls["eager"]
        fn = eager.unchecked or eager.fn

        def body(*a: Any, **k: Any) -> torch.Tensor:
            bound = dict(zip([*names, "call"], a)) | k
            args, kwargs = _bind(spec, tuple(bound[n] for n in names if bound[n] is not None),
                                 {n: None for n in names if bound[n] is None} | {"call": bound["call"]})
            return fn(*args, **kwargs).contiguous()

        op = torch.library.custom_op(f"tiered_ops::{spec.name}_choice", body, mutates_args=(), schema=schema)
        op.register_fake(body)  # plain torch: runs on fake tensors as it does on real ones
        params = inspect.signature(register_custom_op_autotuning).parameters
        if "config_generator" in params:
            how: dict[str, Any] = dict(config_generator=_config_generator(spec))
        else:  # a torch with static configs only: the tiers of this process's default device
            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            how = dict(configs=[CustomOpConfig(_decomposition(spec, i))
                                for i in choices(spec, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)])
        register_custom_op_autotuning(op, name=f"tiered_ops_{spec.name}_choice", **how, **_api())
        _add_feedback_saver()
        _ops[spec.name] = op
        return op


_saver_added: list[bool] = []


def _add_feedback_saver() -> None:
    if _saver_added:
        return
    _saver_added.append(True)
    try:
        from torch._inductor.select_algorithm import add_feedback_saver
    except ImportError:
        log.info("torch %s reports no autotuning results (no select_algorithm.add_feedback_saver): what Inductor "
                 "chooses for tiered_ops is not stored", torch.__version__)
        return
    add_feedback_saver(_feedback)


def _feedback(timings: dict, name: str, input_nodes: list, choice_callers: list, *_: Any) -> None:
    """Inductor's timings of one autotuned call (every autotuning of the process comes here: ours by name)."""
    if not (name.startswith("tiered_ops_") and name.endswith("_choice")):
        return
    op = name[len("tiered_ops_"):-len("_choice")]
    try:
        with _run_for_real():
            _record(get_op(op), timings, input_nodes, choice_callers)
    except Exception as e:  # noqa: BLE001 (a failure to record must never fail the user's compile)
        log.warning("tiered_ops.%s: what Inductor chose was not stored (%s: %s)", op, type(e).__name__, e)


def winner(timings: dict[str, float], min_speedup: float) -> str:
    """The choice torch's rule takes from the timings (ms by implementation name, ``FALLBACK`` the fallback's):
    the fastest, but the fallback where the fastest beats it by less than ``min_speedup``."""
    best = min(timings, key=timings.__getitem__)
    if best != FALLBACK and FALLBACK in timings and min_speedup > 1.0:
        if timings[best] <= 0 or timings[FALLBACK] / timings[best] < min_speedup:
            return FALLBACK
    return best


def _record(spec: OpSpec, timings: dict, input_nodes: list, choice_callers: list) -> None:
    by_impl: dict[str, float] = {}
    call_kw: dict[str, Any] | None = None
    for c, t in timings.items():
        decomp = getattr(c, "decomposition", None)
        impl = getattr(decomp, "impl", None) if decomp is not None else FALLBACK
        if impl is None or not isinstance(t, (int, float)) or t != t or t == float("inf"):
            continue
        by_impl[impl] = min(t, by_impl.get(impl, float("inf")))
        if decomp is not None and call_kw is None:
            call_kw = dict(getattr(c, "decomposition_kwargs", None) or {})
    if not by_impl or call_kw is None:
        return
    dev, dtype = input_nodes[0].get_device(), input_nodes[0].get_dtype()
    metas = tuple(torch.empty([int(s) for s in n.get_size()], dtype=n.get_dtype(), device="meta")
                  for n in input_nodes)
    args, kwargs = _bind(spec, metas, call_kw)
    problem = spec.problem_of(*args, **kwargs)
    min_speedup = _api().get("min_speedup_threshold", 1.0)
    won = winner(by_impl, min_speedup)
    chosen = "eager" if won == FALLBACK else won
    _chosen[(spec.name, str(problem), DTYPE_NAMES[dtype], str(dev))] = chosen
    log.info("tiered_ops.%s %s %s: Inductor chose %s (%s)", spec.name, problem, DTYPE_NAMES[dtype], won,
             ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in sorted(by_impl.items(), key=lambda kv: kv[1])))
    try:
        _store(spec, problem, dtype, dev, by_impl, chosen)
    except STORE_ERRORS as e:
        log.warning("tiered_ops.%s %s: Inductor's choice not stored: the store failed (%s)", spec.name, problem, e)


def _store(spec: OpSpec, problem: Any, dtype: torch.dtype, device: torch.device, by_impl: dict[str, float],
           chosen: str) -> None:
    """Inductor's timings as the bucket's compiled-context rows (see the module's doc), then the bucket's cached
    decisions dropped so the next one reads them."""
    store = _decide.get_store()
    if store.unusable:
        return
    fp, mode = fingerprint(device), "fwd_nograd"
    eager_ms = min(v for k, v in by_impl.items() if k in ("eager", FALLBACK))  # both run the eager tier's code
    rows = []
    for impl in spec.impls.values():
        if impl.tier == Tier.PEER:
            continue
        row = dict(base_row(spec, impl, problem, dtype, mode, fp), context="compiled", origin=ORIGIN)
        ms = eager_ms if impl.name in ("eager", "compile") else by_impl.get(impl.name)
        if ms is None:
            why = impl.why_not(device, dtype) or _not_here(impl, device) or "not a choice"
            rows.append(dict(row, reason=UNAVAILABLE + f"{why} (not among Inductor's choices here)"))
            continue
        us = ms * 1e3
        row.update(p20_us=us, p50_us=us, p80_us=us, caller_us=us)
        if impl.name == chosen:
            err, why = gate(spec, impl, problem, dtype, device)
            row.update(ok=int(why is None), rel_error=err if err == err and err != float("inf") else None,
                       reason=f"Inductor's choice; {why}" if why else "Inductor's choice, correct")
            if why:
                log.warning("tiered_ops.%s %s: Inductor chose %s, which fails the gate: %s", spec.name, problem,
                            impl.name, why)
        else:
            row.update(reason=f"{UNGATED}timed by Inductor; it chose {chosen}")
        rows.append(row)
    store.add(rows)
    _decide._forget((spec.name, bucket_str(spec.bucket(problem)), DTYPE_NAMES[dtype], fp.key, mode))


def chosen() -> dict[tuple[str, str, str, str], str]:
    """What Inductor chose in this process: (op, problem, dtype, device) -> implementation name (``eager`` for its
    fallback, the eager tier's plain call)."""
    return dict(_chosen)


def call_traced(spec: OpSpec, args: tuple, kwargs: dict[str, Any], mode: str, mixed: bool) -> torch.Tensor | None:
    """Inside a dynamo trace of ``tiered_ops.<op>`` (sizes not symbolic): the call as ``tiered_ops::<op>_choice`` in
    the graph where Inductor chooses (``traced_route``), else None (the caller reads the table)."""
    given = dict(zip(_POSITIONAL[spec.name], args)) | kwargs
    others = tuple((k, v) for k, v in given.items() if not isinstance(v, torch.Tensor))
    call = traced_route(spec.name, mode, mixed, others)
    if call is None:
        return None
    op = getattr(torch.ops.tiered_ops, f"{spec.name}_choice")
    return op(*(given[n] for n in tensor_args(spec)[0]), call=call)
