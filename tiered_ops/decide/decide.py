"""select_backend and the per-call dispatch of ``tiered_ops.<op>``.

A decision is keyed by (op, shape bucket, dtype, device fingerprint, mode, context). The context is who launches
the op (``registry.Context``: a Python caller, a torch.compile graph, a CUDA-graph replay; ``in_context`` says what
each pays). The mode is what the call is for: ``fwd_nograd`` (inference, the default of select_backend) or
``fwd+bwd`` (training), or ``fwd`` / ``bwd`` alone; ``tiered_ops.<op>`` uses the ``fwd+bwd`` decision when grad is
enabled and an input requires grad, else ``fwd_nograd``, so inference and training can run different tiers. Each op
documents its bucket (leading dims rounded up to a power of two, reduced dims exact), so a new batch size reuses the
decision of its bucket. The decision is derived from the freshest stored measurement of every
implementation whose source is unchanged: the correct implementation with the lowest time a caller
sees wins. With no fresh measurement for the bucket it measures then, at the requested shape (on a GPU in
background tuning's worker, the call waiting: ``blocking``), and persists (like ``triton.autotune``), unless
tuning is off (``TIERED_OPS_TUNE=0`` or ``set_tuning(False)``): then it decides from the nearest measured
bucket (same flags, nearest sizes in log2; for fp16 or bf16 with nothing measured in that dtype: of the other one;
with nothing of those flags measured: the fewest flags apart, its choice gated at the requested problem), each
candidate's time predicted at the requested shape (``predict``: its launch path, and its kernel time scaled by the
bytes moved), or returns the eager tier when nothing of the op is measured; the record says which. Peers
(``tiered_ops.peers``) are never measured or chosen here. With ``TIERED_OPS_TUNE=background`` (or
``set_tuning("background")``) a miss measures nothing on the calling thread: it decides as with tuning off, from
the nearest measured bucket of its own dtype only (rows that passed the gate at that dtype), else eager, and queues
the bucket for a background thread (``background``); when the bucket's measurements land, its cached selections are
dropped and the next call decides from them (``wait_for_tuning`` waits for the queue).

Which correct implementation wins is the policy's call (``tiered_ops.policy``): ``fastest`` by default,
``cost-aware`` or ``cold-start`` per call of select_backend or for the process (``set_policy`` or
``TIERED_OPS_POLICY``). The record lists each candidate's figure under the policy.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable

import torch

from .. import envs
from ..buckets import encode as bucket_str
from ..environment import environment
from ..measure.case import measure_kept
from ..measure.fingerprint import fingerprint
from ..measure.timing import cuda_index, default_device
from ..measure.verdict import Settings
from ..registry import CONTEXTS, DTYPE_NAMES, DTYPES, OpSpec, Problem, check_context, check_dims, check_mode
from ..store.store import Store, open_store
from ..tiers.catalog import get_op
from . import background, blocking, table
from .asked import Asked, Evidence
from .capture import is_warm, warm
from .choice import choose_gated, in_context, measured_compiled, provisional_decision, runnable, to_measure
from .choice import note as busy_note
from .claimed import measure_compiled, tune_bucket
from .policy import DEFAULT_CALLS, check_policy
from .predict import nearest_rows
from .table import Selection

log = logging.getLogger(__name__)
_tune: bool | str | None = None
_policy: tuple[str, int | None] | None = None
_budget: int | None = None  # the memory policy's budget of the process default
_store: Store | None = None
_lock = threading.RLock()
_told: set[tuple] = set()  # capture fallbacks logged once
_unsaved: list[list[dict]] = []  # rows measured in the background for a store kept in memory (the next decision adds)
_unsaved_lock = threading.Lock()


def set_tuning(enabled: bool | str | None) -> None:
    """Measuring on a miss, for this process: True or ``"blocking"`` (the call measures, then returns),
    ``"background"`` (the call runs a prediction at once; a background thread measures its bucket), False or
    ``"off"`` (predictions only), None (follow TIERED_OPS_TUNE, default blocking)."""
    global _tune
    if not (enabled is None or isinstance(enabled, bool) or enabled in envs.TUNE_MODES):
        raise ValueError(f"set_tuning: expected True, False, None or one of {', '.join(envs.TUNE_MODES)}, "
                         f"got {enabled!r}")
    _tune = enabled
    clear_cache()


def tuning_setting() -> bool | str | None:
    """The process's own tuning setting (``set_tuning``), None where it follows TIERED_OPS_TUNE."""
    return _tune


def tuning_mode() -> str:
    """``off``, ``blocking`` or ``background``: the process's setting, else TIERED_OPS_TUNE's."""
    if _tune is None:
        return envs.tune_mode()
    if isinstance(_tune, bool):
        return "blocking" if _tune else "off"
    return _tune


def tuning_enabled() -> bool:
    """Whether a miss measures on the calling thread (blocking tuning)."""
    return tuning_mode() == "blocking"


def _landed(job: background.Job) -> None:
    """A bucket measured in the background: its rows of a store kept in memory wait for the next decision, and a
    table without the bucket's decisions is published, so the next call decides from them (and a selection that
    waited for a full queue asks again). Not under ``_lock``: a blocking call holds it while it waits for a landing."""
    with _unsaved_lock:
        new = job.unsaved()
        if new:
            _unsaved.append(new)
    _forget(job.key)


def _add_unsaved(store: Store) -> None:
    """The rows measured in the background for a store kept in memory, added to it."""
    with _unsaved_lock:
        new = [r for rows in _unsaved for r in rows]
        _unsaved.clear()
    if new:
        store.add(new)


def _forget(key: tuple[str, str, str, str, str]) -> None:
    """Publish a table without the decisions of the bucket ``key`` (op, bucket, dtype, device key, mode), nor those
    that waited for a full background queue, so the next call decides again."""
    def stale(_: tuple, sel: Selection) -> bool:
        r = sel.record
        return ((r.get("op"), r.get("bucket"), r.get("dtype"), r.get("device"), r.get("mode")) == key
                or str(r.get("tuning", "")).startswith(_FULL))

    table.publish(drop=stale)


# exact select_backend arguments -> the table's Selection, kept while it is the table's decision (``table.derived``)
_selects: dict[tuple, Selection] = table.derived()
_FULL = background.NOT_QUEUED + "the background tuning queue is full"


def set_policy(policy: str | None, calls: int | None = None, budget: int | None = None) -> None:
    """Default policy of this process (None: follow TIERED_OPS_POLICY / TIERED_OPS_CALLS, default fastest);
    ``budget``: the memory policy's bytes."""
    global _policy, _budget
    if policy is not None:
        check_policy(policy, calls, budget)
    _policy = None if policy is None else (policy, calls)
    _budget = budget if policy is not None else None
    clear_cache()


def default_policy() -> tuple[str, int | None]:
    if _policy is not None:
        return _policy
    policy, n = envs.policy(), envs.calls()
    check_policy(policy, n)
    return policy, n


def use_store(store: Store | str | None) -> Store:
    """Point selection at a store (object or path); None re-reads TIERED_OPS_DB. A path where no store can be
    opened raises ``StoreError`` (naming it and what is wrong); a valid store that cannot be written is read-only."""
    global _store
    with _lock:
        if _store is not None and _store is not store:
            _store.close()
        _store = store if isinstance(store, Store) else Store(store)
        clear_cache()
        return _store


def get_store() -> Store:
    """The store in use; first use opens TIERED_OPS_DB's, or where none can be opened there, an empty in-memory
    store (``unusable`` says why, the log warns once), so model code keeps running."""
    with _lock:
        return _store if _store is not None else use_store(open_store())


def clear_cache() -> None:
    """Publish an empty decision table: every call decides again (from the store)."""
    table.publish(clear=True)


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
    return dtype


def select_problem(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device,
                   tune: bool | None = None, progress: Callable[[str], None] | None = None,
                   policy: str | None = None, calls: int | None = None, mode: str = "fwd_nograd",
                   context: str = "eager", budget: int | None = None, warm_graphed: bool = True) -> Selection:
    """The selection for one problem in one context; the decisions of the other contexts are made from the same
    rows at the same time, so a compiled region finds its decision at trace time after any eager call decided.
    ``warm_graphed``: the graphed context's choice is called once on the problem's inputs when it is decided (a
    caller with the call's own arguments warms it with those instead).

    In order: the table's entry, where there is one; else the rows (``_evidence``: stored, measured now, or the
    nearest bucket's), a decision per context from them (``_decide_in``), and a new table published (``_publish``)."""
    process = (*default_policy(), _budget)
    if policy is None:
        policy, calls = process[:2]
        budget = _budget if budget is None else budget
    how = (policy, calls, budget)
    asked = Asked(spec, problem, dtype, device, mode, context, policy, calls, budget,
                  (spec.name, spec.bucket(problem), dtype, device, mode, context), how, published=how == process)
    sel = table.current().decision(asked.key, asked.how) if asked.published else None
    if sel is not None:
        return sel
    if torch.compiler.is_compiling():
        # select_backend called inside a traced function (a trace of ``tiered_ops.<op>`` never comes here: it asks
        # ``compiled.trace_choice``, which stays in the graph). Measuring needs real tensors and the store, neither of
        # which exists while dynamo traces: leave the graph for it (one graph break; under fullgraph=True an error).
        from .outside import outside_graph  # imported while tracing: a process that never compiles never imports dynamo

        return outside_graph(select_problem, spec, problem, dtype, device, tune, progress, policy, calls, mode, context,
                             budget)
    with _lock:
        ev = _evidence(asked, tune, progress)
        made = {ctx: _decide_in(asked, ev, ctx) for ctx in CONTEXTS}
        _publish(asked, ev, made, warm_graphed)
        return made[context]


def _evidence(a: Asked, tune: bool | None, progress: Callable[[str], None] | None) -> Evidence:
    """The rows of the asked bucket: stored; measured now where tuning blocks (or queued where it runs in the
    background); else the nearest measured bucket's."""
    store = get_store()
    _add_unsaved(store)
    spec, problem, dtype, device, mode, context = a.spec, a.problem, a.dtype, a.device, a.mode, a.context
    fp = fingerprint(device)
    bkey, dname = bucket_str(a.key[1]), DTYPE_NAMES[dtype]
    bucket_key = (spec.name, bkey, dname, fp.key, mode)
    rows = store.latest(*bucket_key)
    fresh = spec.freshness(rows)  # the registry asked once per set of rows: which are fresh, what is missing
    # the candidates without a fresh row, and once a busy bucket's back-off has passed every correct one
    missing, _ = to_measure(store, spec, bucket_key, rows, fresh=fresh)
    tmode, asked = tuning_mode(), tune is None
    tune = tmode == "blocking" if tune is None else tune
    tuned_s, job, busy, tuning = None, None, None, None
    provisional = bool(missing) and tmode == "background" and not tune
    if provisional:
        job, tuning = background.request(
            spec, problem, dtype, device, mode, context, bucket_key,
            [i.name for i in missing], store, _landed) if asked else (None, "not queued: tune=False")
    if missing and tune:  # under the bucket's claim in the store: one process of those sharing it measures
        # on a GPU in background tuning's worker (the call waits), else (or where it cannot) in this process
        tuned = blocking.tune_aside(store, spec, problem, dtype, device, mode, context, _landed, progress) if (
            envs.blocking_aside(device.type)) else None
        if tuned is not None:
            _add_unsaved(store)  # a store kept in memory: the worker's rows came back with the job
            tuned = (store.latest(*bucket_key), *tuned[1:])
        read = Settings(envs.gate_bytes(device.type), envs.contention_check(), environment())  # once, passed down
        rows, tuned_s, busy = tuned or tune_bucket(store, spec, problem, dtype, device, mode, context, progress,
                                                   measure_one=measure_kept, key5=bucket_key,
                                                   claim_s=(envs.claim_lease_s(), envs.claim_wait_s()), settings=read)
        fresh = spec.freshness(rows, read.env)
    busy = busy or busy_note(spec, rows, fresh[0])
    # the nearest measured bucket (not another dtype's or other flags' in the background: their choice needs a
    # gate at this problem, on the calling thread)
    near = nearest_rows(store, spec, problem, dtype, dname, fp.key, mode, other_dtype=not provisional) if (
        not rows and not tune) else None
    rows, fresh = (near.rows, spec.freshness(near.rows)) if near is not None else (rows, fresh)
    # the compiled context's rows: each implementation's (measured where missing, for a blocking compiled call) or none
    compiled = store.latest(*bucket_key, context="compiled")
    cfresh, cmissing = spec.freshness(compiled)
    if cmissing and tune and context == "compiled" and near is None:
        compiled = measure_compiled(store, spec, problem, dtype, device, mode, bucket_key, cmissing)
        cfresh, cmissing = spec.freshness(compiled)[0], []
    return Evidence(store, bucket_key, rows, near, compiled if not cmissing else [], tune, tmode, provisional, job,
                    tuning, busy, tuned_s, fresh[0], cfresh if not cmissing else {})


def _decide_in(a: Asked, ev: Evidence, ctx: str) -> Selection:
    """The decision of context ``ctx`` from the evidence: the policy's choice among the rows as that context pays
    them (gated at the problem first where they come from another bucket or a pack), or eager with none."""
    spec, near = a.spec, ev.near
    ctx_rows, why = measured_compiled(ev.compiled, a.mode) if ctx == "compiled" and ev.compiled else in_context(
        ev.rows, ctx)
    fresh = ev.compiled_fresh if ctx == "compiled" and ev.compiled else ev.fresh
    if not ctx_rows and not ev.tune:
        impl, reason, cands = spec.impls["eager"], ("tuning in the background, nothing measured of it yet: "
                                                    "eager" if ev.provisional else
                                                    "tuning off and no stored decision: eager"), []
    else:
        how = (a.policy, a.calls, ev.store, a.budget)
        runs = {i.name: i.why_not(a.device, a.dtype) for i in runnable(ctx_rows, fresh)}  # asked here: values down
        impl, reason, cands = choose_gated(spec, a.problem, a.dtype, a.device, a.mode, ctx_rows, how, fresh,
                                           near is not None and near.gate, runs)
        if near is not None:
            reason = (f"{'tuning in the background' if ev.provisional else 'tuning off'}, nothing measured in "
                      f"this bucket: from the nearest measured bucket {near.label}, times predicted at this "
                      f"shape (launch path, kernel time by bytes moved): {reason}")
    _, bkey, dname, device_key, _ = ev.bucket_key
    record = dict(op=spec.name, problem=str(a.problem), bucket=bkey, dtype=dname, device=device_key, mode=a.mode,
                  context=ctx, policy=a.policy, budget=a.budget,
                  calls=(a.calls or DEFAULT_CALLS) if a.policy == "cold-start" else None,
                  chosen=impl.name, tier=impl.tier.label, reason=f"{why}{reason}", candidates=cands)
    if ev.busy:
        record["provisional"] = ev.busy
    if ev.provisional:
        record["tuning"] = ev.tuning
        if ev.job is not None and ctx == "eager":
            impl = background.counting(ev.job, impl)  # calls counted: the hottest bucket is measured first
    return Selection(impl.fn, impl, record, a.key[:-1] + (ctx,) if a.published else None)


def _publish(a: Asked, ev: Evidence, made: dict[str, Selection], warm_graphed: bool) -> None:
    """A new table with the decisions made (those asked under the process's policy: another's is returned, not
    published); then what is said once (a busy bucket, a tuned one) and, where asked, the graphed context's choice
    warmed."""
    if a.published and (not ev.provisional or ev.job is not None):  # a bucket not queued asks again next time
        table.publish(add={sel.key: sel for sel in made.values()}, how=a.how)
    elif a.published and a.context == "compiled":  # but a compiled caller never queues: asking again would break
        # its graph each call (until a bucket's measurement lands, which drops it)
        table.publish(add={a.key: made[a.context]}, how=a.how)
    if ev.busy:  # said once; forgotten when due to be timed again, so the next call re-times it
        provisional_decision(ev.store, a.spec, ev.bucket_key, ev.rows, ev.busy, ev.tmode != "off",
                             lambda: _forget(ev.bucket_key))
    if warm_graphed:
        warm(a.spec, made["graphed"].impl, a.problem, a.dtype, a.device, a.mode)
    if ev.tuned_s is not None:
        chosen = made[a.context]
        log.info("tiered_ops: tuned %s %s %s %s %s in %.1f s: %s (%s) - %s", a.spec.name, a.problem,
                 DTYPE_NAMES[a.dtype], a.mode, a.context, ev.tuned_s, chosen.name, chosen.tier.label,
                 chosen.record["reason"])


def capture_selection(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device,
                      mode: str, how: tuple = ()) -> Selection:
    """The selection of a call inside a CUDA-graph capture: nothing is measured, compiled or synchronized there.
    The graphed context's decision where it is warm (called outside capture at this problem), else the eager
    context's where warm, else the eager tier; a fallback is logged once."""
    base, process = (spec.name, spec.bucket(problem), dtype, device, mode), (*default_policy(), _budget)
    decisions = table.current()
    for ctx in ("graphed", "eager"):
        sel = decisions.decision(base + (ctx,), process)
        if sel is not None and is_warm(spec, sel.impl, problem, dtype, device, mode, how):
            if ctx == "graphed":
                return sel
            why = "the graphed decision is not warm (never called outside capture at this shape)"
            break
    else:
        eager = spec.impls["eager"]
        sel = Selection(eager.fn, eager, dict(op=spec.name, problem=str(problem), chosen=eager.name, tier="eager",
                                              context="graphed", candidates=[],
                                              reason="inside CUDA-graph capture with no warm decision: eager"))
        why = "no warm decision (call the op or tiered_ops.tune outside capture first)"
    told = (spec.name, problem, dtype, device, mode)
    if told not in _told:
        _told.add(told)
        log.warning("tiered_ops.%s %s %s inside CUDA-graph capture: %s; running %s", spec.name, problem,
                    DTYPE_NAMES[dtype], why, sel.name)
    return sel


def select_backend(op: str, shapes: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype | str | None = None,
                   device: torch.device | str | None = None, *, tune: bool | None = None, policy: str | None = None,
                   calls: int | None = None, mode: str = "fwd_nograd", context: str = "eager",
                   budget: int | None = None, **params: Any) -> Selection:
    """The implementation to use for ``op`` at ``shapes`` (shape of the first input) on this device.

    ``params`` are the op's non-tensor arguments that shape the work (``dim`` for softmax,
    ``normalized_shape`` and ``weight`` for rms_norm). ``policy`` is ``fastest`` (default), ``cost-aware`` or
    ``cold-start`` (with ``calls``, the expected number of calls) or ``memory`` (with ``budget``, bytes the call may
    allocate above its inputs). ``mode`` is ``fwd_nograd`` (inference), ``fwd+bwd`` (training), ``fwd`` or ``bwd``;
    ``context`` is who launches the op (a ``Context`` or its text): ``eager`` (a Python caller), ``compiled`` (traced
    into torch.compile) or ``graphed`` (CUDA-graph replay). Returns a callable with ``.tier``, ``.name`` and
    ``.record`` (every candidate's figures and why the winner won).
    """
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None:  # the key holds the resolved device: set_device changes it
        dev = torch.device("cuda", cuda_index(dev))
    try:  # fast path: the same arguments as an earlier call (unhashable params skip it)
        fast = (op, tuple(shapes), dtype, dev, tune, policy, calls, budget, mode, context, tuple(params.items()))
        sel = _selects.get(fast)
        if sel is not None:
            return sel
    except TypeError:
        fast = None
    # after the fast path: a shape that fails here is never cached
    check_dims("shapes", shapes, positive=True)  # a decision is for a real input: (-1, 64) or (0, 64) is a mistake
    if dev.type == "cuda":
        cuda_index(dev)
    spec = get_op(op)
    takes = list(inspect.signature(spec.problem).parameters)[1:]
    unknown = [k for k in params if k not in takes]
    if unknown:
        raise TypeError(f"select_backend: op {op!r} takes no parameter {unknown[0]!r} (its parameters: "
                        f"{', '.join(takes) or 'none'})")
    if policy is not None or budget is not None:
        check_policy(policy or "fastest", calls, budget)
    sel = select_problem(spec, spec.problem(tuple(shapes), **params), _as_dtype(dtype), dev, tune, policy=policy,
                         calls=calls, mode=check_mode(mode), context=check_context(context), budget=budget)
    if fast is not None:
        table.put(_selects, fast, sel)
    return sel
