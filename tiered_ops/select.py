"""select_backend and the per-call dispatch of ``tiered_ops.<op>``.

A decision is keyed by (op, shape bucket, dtype, device fingerprint, mode). The mode is what the call is
for: ``fwd_nograd`` (inference, the default of select_backend) or ``fwd+bwd`` (training), or ``fwd`` / ``bwd``
alone; ``tiered_ops.<op>`` uses the ``fwd+bwd`` decision when grad is enabled and an input requires grad,
else ``fwd_nograd``, so inference and training can run different tiers. Each op documents its bucket
(leading dims rounded up to a power of two, reduced dims exact), so a new batch size reuses the
decision of its bucket. The decision is derived from the freshest stored measurement of every
implementation whose source is unchanged: the correct implementation with the lowest time a caller
sees wins. With no fresh measurement for the bucket it measures then, at the requested shape, and
persists (like ``triton.autotune``), unless tuning is off (``TIERED_OPS_TUNE=0`` or
``set_tuning(False)``): then it decides from the nearest measured bucket (same flags, nearest sizes in log2;
for fp16 or bf16 with nothing measured in that dtype: of the other one), each candidate's time predicted at
the requested shape (``predict``: its launch path, and its kernel time scaled by the bytes moved), or returns
the eager tier when nothing of the op is measured; the record says which. Peers
(``tiered_ops.peers``) are never measured or chosen here.

Which correct implementation wins is the policy's call (``tiered_ops.policy``): ``fastest`` by default,
``cost-aware`` or ``cold-start`` per call of select_backend or for the process (``set_policy`` or
``TIERED_OPS_POLICY``). The record lists each candidate's figure under the policy.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .measure import bucket_str, gate, measure
from .policy import DEFAULT_CALLS, check_policy, choose
from .record import _active as _recorders
from .record import note as _note
from .registry import DTYPE_NAMES, DTYPES, GRAD_MODES, Impl, OpSpec, Problem, Tier, check_mode, get_op
from .store import STORE_ERRORS, Store, open_store
from .timing import caller_range, default_device, fingerprint

log = logging.getLogger(__name__)
_tune: bool | None = None
_policy: tuple[str, int | None] | None = None
_store: Store | None = None
_lock = threading.RLock()
_decisions: dict[tuple, Selection] = {}
_calls: dict[tuple, Selection] = {}  # exact call signature -> Selection (the per-call fast path)
_selects: dict[tuple, Selection] = {}  # exact select_backend arguments -> Selection


def set_tuning(enabled: bool | None) -> None:
    """Switch measuring-on-miss on/off for this process (None: follow TIERED_OPS_TUNE, default on)."""
    global _tune
    _tune = enabled
    clear_cache()


def tuning_enabled() -> bool:
    if _tune is not None:
        return _tune
    return os.environ.get("TIERED_OPS_TUNE", "1").lower() not in ("0", "false", "no", "off")


def set_policy(policy: str | None, calls: int | None = None) -> None:
    """Default policy of this process (None: follow TIERED_OPS_POLICY / TIERED_OPS_CALLS, default fastest)."""
    global _policy
    if policy is not None:
        check_policy(policy, calls)
    _policy = None if policy is None else (policy, calls)
    clear_cache()


def default_policy() -> tuple[str, int | None]:
    if _policy is not None:
        return _policy
    calls = os.environ.get("TIERED_OPS_CALLS")
    policy, n = os.environ.get("TIERED_OPS_POLICY", "fastest"), int(calls) if calls else None
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
    _decisions.clear()
    _calls.clear()
    _selects.clear()


@dataclass
class Selection:
    """A callable bound to the chosen implementation, with the record of why it was chosen."""

    fn: Callable[..., torch.Tensor]
    impl: Impl
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def tier(self) -> Tier:
        return self.impl.tier

    @property
    def name(self) -> str:
        return self.impl.name

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Selection({self.record.get('op')}: {self.name} [{self.tier.label}], {self.record.get('reason')})"


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


def _decide(spec: OpSpec, rows: list[dict], dtype: torch.dtype, device: torch.device, policy: str,
            calls: int | None, store: Store) -> tuple[Impl, str, list]:
    """Choose among the correct fresh timed implementations under ``policy``; (impl, reason, candidates)."""
    cands, ok = [], []
    for r in rows:
        impl = spec.fresh_impl(r)
        fresh = impl is not None
        c = {k: r.get(k) for k in ("impl", "tier", "caller_us", "p50_us", "p20_us", "p80_us", "host_us", "host_p80_us",
                                   "gbps", "frac_copy", "rel_error", "ok", "reason", "first_call_s")} | {"fresh": fresh}
        if fresh and r["ok"] and r["caller_us"] is not None and not r.get("predicted"):
            c["lo"], c["hi"] = caller_range(r)  # a time predicted at another shape has no measured spread
        if fresh and impl.tier == Tier.CUDA and policy == "cold-start":
            meta = store.get_meta(spec.name, impl.name, r["device_key"], impl.source_hash) or {}
            c["build_s"] = meta.get("build_s_extension")
        cands.append(c)
        if (fresh and impl.tier != Tier.PEER and r["ok"] and r["caller_us"] is not None
                and impl.why_not(device, dtype) is None):
            ok.append(c)  # a peer is measured for comparison, never chosen
    best, reason, totals = choose(ok, policy, calls)
    for c in cands:
        c["policy_figure"] = totals.get(c["impl"]) if c in ok else None
    if best is None:
        return spec.impls["eager"], f"{reason}: eager", cands
    return spec.impls[best["impl"]], reason, cands


def _bucket_distance(a: str, b: str) -> float:
    """How far apart two buckets are: the sum of |log2| ratios of their numeric parts; inf when a non-numeric
    part (a flag, a dim) differs."""
    pa, pb = a.split("|"), b.split("|")
    if len(pa) != len(pb):
        return math.inf
    d = 0.0
    for x, y in zip(pa, pb):
        if x.lstrip("-").isdigit() and y.lstrip("-").isdigit():
            d += abs(math.log2(max(int(x), 1)) - math.log2(max(int(y), 1)))
        elif x != y:
            return math.inf
    return d


BANDWIDTH_BOUND = 4.0  # a kernel time this many times an implementation's shortest one is read as bandwidth


def predict(spec: OpSpec, problem: Problem, dtype: torch.dtype, mode: str, near: list[dict], measured: list[dict]
            ) -> list[dict]:
    """The ``near`` rows (the nearest measured bucket's) with each caller time predicted at ``problem`` from every
    fresh measurement of the same implementation at buckets of the same flags (``measured``): the larger of
    its launch path (its fastest host time at any of them: the launch path does not grow with the shape) and its
    kernel time there, its shortest kernel time (the latency) plus the bytes ``problem`` moves at the bandwidth it
    reached beyond that latency in the bucket nearest ``problem`` whose kernel time is at least BANDWIDTH_BOUND x
    that latency (a launch-bound bucket says nothing of bandwidth). On an H100, taking the nearest
    bucket's times as they were chose a Triton softmax of 98 us per call (launch path) over eager's 27 at
    2048x3000, after the bucket 16384x4096 whose kernels dwarf any launch path."""
    target, nbytes = bucket_str(spec.bucket(problem)), spec.mode_bytes(problem, dtype, mode)
    latest: dict[tuple[str, str], dict] = {}
    for r in measured:  # ordered by id: the newest per (implementation, bucket) wins
        if (r["ok"] and r["p50_us"] and r["gbps"] and r["host_us"] is not None and spec.fresh_impl(r) is not None
                and _bucket_distance(target, r["bucket"]) < math.inf):
            latest[(r["impl"], r["bucket"])] = r
    out = []
    for r in near:
        mine = [x for (impl, _), x in latest.items() if impl == r["impl"]]
        if not mine or not r["ok"] or r["caller_us"] is None:
            out.append(r)
            continue
        latency = min(x["p50_us"] for x in mine)
        kernel = latency
        bound = [x for x in mine if x["p50_us"] >= BANDWIDTH_BOUND * latency]
        if bound:
            x = min(bound, key=lambda x: _bucket_distance(target, x["bucket"]))
            moved = x["gbps"] * 1e3 * x["p50_us"]  # bytes: GB/s x us
            kernel = latency + nbytes * (x["p50_us"] - latency) / moved
        out.append(dict(r, caller_us=max(min(x["host_us"] for x in mine), kernel), predicted=True))
    return out


def nearest_bucket(store: Store, spec: OpSpec, bucket: str, dtype: str, device_key: str, mode: str) -> str | None:
    """The measured bucket closest to ``bucket`` (same flags; nearest in log2 of the sizes), or None."""
    best = min(((_bucket_distance(bucket, b), b) for b in store.buckets(spec.name, dtype, device_key, mode)
                if b != bucket), default=(math.inf, None))
    return best[1] if best[0] < math.inf else None


def select_problem(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device,
                   tune: bool | None = None, progress: Callable[[str], None] | None = None,
                   policy: str | None = None, calls: int | None = None, mode: str = "fwd_nograd") -> Selection:
    if policy is None:
        policy, calls = default_policy()
    bucket = spec.bucket(problem)
    key = (spec.name, bucket, dtype, device, policy, calls, mode)
    sel = _decisions.get(key)
    if sel is not None:
        return sel
    if torch.compiler.is_compiling():
        # Measuring needs real tensors and the store, neither of which exists while dynamo traces: leave the
        # graph for it (one graph break; under fullgraph=True an error carrying the reason below).
        return _decide_outside_graph(spec, problem, dtype, device, tune, progress, policy, calls, mode)
    with _lock:
        store = get_store()
        fp = fingerprint(device)
        bkey, dname = bucket_str(bucket), DTYPE_NAMES[dtype]
        rows = store.latest(spec.name, bkey, dname, fp.key, mode)
        have = {r["impl"] for r in rows if spec.fresh_impl(r) is not None}
        missing = [i for i in spec.impls.values() if i.name not in have and i.tier != Tier.PEER]
        tune = tuning_enabled() if tune is None else tune
        if missing and tune:
            log.info("tiered_ops: %s %s %s %s: no stored decision, measuring %d implementations (once; stored in %s)",
                     spec.name, problem, dname, mode, len(missing), store.path)
            new = []
            for impl in missing:
                if progress:
                    progress(f"measuring {spec.name} {impl.name} {problem} {dname} {mode}")
                new.append(measure(spec, impl, problem, dtype, device, mode))
            store.add(new)
            rows = store.latest(spec.name, bkey, dname, fp.key, mode)
        near, near_dtype = None, dname
        if not rows and not tune:
            # the nearest measured bucket of this dtype, else of the other 16-bit dtype (same bytes per element)
            for dn in (dname, *({"fp16": ["bf16"], "bf16": ["fp16"]}.get(dname, []))):
                b = nearest_bucket(store, spec, bkey, dn, fp.key, mode)
                if b is not None:
                    near, rows = (b if dn == dname else f"{b} ({dn})"), store.latest(spec.name, b, dn, fp.key, mode)
                    rows = predict(spec, problem, dtype, mode, rows,
                                   store.rows(op=spec.name, dtype=dn, device_key=fp.key, mode=mode))
                    near_dtype = dn
                    break
        if not rows and not tune:
            impl, reason, cands = spec.impls["eager"], "tuning off and no stored decision for this bucket: eager", []
        else:
            impl, reason, cands = _decide(spec, rows, dtype, device, policy, calls, store)
            if near_dtype != dname:
                impl, reason, cands = _gated(spec, problem, dtype, device, mode, rows, (policy, calls, store),
                                             (impl, reason, cands))
            if near is not None:
                reason = (f"tuning off, nothing measured in this bucket: from the nearest measured bucket {near}, "
                          f"times predicted at this shape (launch path, kernel time by bytes moved): {reason}")
        record = dict(op=spec.name, problem=str(problem), bucket=bkey, dtype=dname, device=fp.key, mode=mode,
                      policy=policy, calls=(calls or DEFAULT_CALLS) if policy == "cold-start" else None,
                      chosen=impl.name, tier=impl.tier.label, reason=reason, candidates=cands)
        sel = Selection(impl.fn, impl, record)
        _decisions[key] = sel
        return sel


def _gated(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, rows: list[dict],
           how: tuple, decided: tuple[Impl, str, list]) -> tuple[Impl, str, list]:
    """A decision read from another dtype's measurements, gated at the requested dtype before it is returned.

    Nothing returns an implementation that never passed the float64 gate at the requested dtype: the choice is
    gated now at ``problem`` (the gate alone, no timing; cached per implementation, dtype and device like every
    gate), and one that fails is struck and the choice made again among the rest, eager last."""
    policy, calls, store = how
    impl, reason, cands = decided
    failed: list[str] = []
    while True:
        _, why = gate(spec, impl, problem, dtype, device, grad=mode in GRAD_MODES)
        if why is None:
            break
        failed.append(f"{impl.name} failed the gate at {DTYPE_NAMES[dtype]}: {why}")
        log.warning("%s %s %s: %s", spec.name, problem, DTYPE_NAMES[dtype], failed[-1])
        rows = [r for r in rows if r["impl"] != impl.name]
        if impl.name == "eager":
            break  # nothing left that passes: eager, with the failures on record
        impl, reason, cands = _decide(spec, rows, dtype, device, policy, calls, store)
    gated = f"gated at {DTYPE_NAMES[dtype]} on first use" + (f" ({'; '.join(failed)})" if failed else "")
    return impl, f"{reason}; {gated}", cands


@torch.compiler.disable(reason="tiered_ops has no decision for this op/shape bucket yet: call "
                         "tiered_ops.select_backend(...) or the op once outside the compiled region first")
def _decide_outside_graph(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device,
                          tune: bool | None, progress: Callable[[str], None] | None, policy: str,
                          calls: int | None, mode: str) -> Selection:
    return select_problem(spec, problem, dtype, device, tune, progress, policy, calls, mode)


def select_backend(op: str, shapes: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype | str | None = None,
                   device: torch.device | str | None = None, *, tune: bool | None = None, policy: str | None = None,
                   calls: int | None = None, mode: str = "fwd_nograd", **params: Any) -> Selection:
    """The implementation to use for ``op`` at ``shapes`` (shape of the first input) on this device.

    ``params`` are the op's non-tensor arguments that shape the work (``dim`` for softmax,
    ``normalized_shape`` and ``weight`` for rms_norm). ``policy`` is ``fastest`` (default), ``cost-aware`` or
    ``cold-start`` (with ``calls``, the expected number of calls). ``mode`` is ``fwd_nograd`` (inference),
    ``fwd+bwd`` (training), ``fwd`` or ``bwd``. Returns a callable with ``.tier``, ``.name`` and
    ``.record`` (every candidate's figures and why the winner won).
    """
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None:  # the key holds the resolved device: set_device changes it
        dev = torch.device("cuda", torch.cuda.current_device())
    try:  # fast path: the same arguments as an earlier call (unhashable params skip it)
        fast = (op, tuple(shapes), dtype, dev, tune, policy, calls, mode, tuple(params.items()))
        sel = _selects.get(fast)
        if sel is not None:
            return sel
    except TypeError:
        fast = None
    # after the fast path: a shape that fails here is never cached
    if any(int(d) < 1 for d in shapes):  # a decision is for a real input: (-1, 64) or (0, 64) is a caller's mistake
        raise ValueError(f"shapes: dims must be positive, got {'x'.join(str(int(d)) for d in shapes)}")
    spec = get_op(op)
    if policy is not None:
        check_policy(policy, calls)
    sel = select_problem(spec, spec.problem(tuple(shapes), **params), _as_dtype(dtype), dev, tune, policy=policy,
                         calls=calls, mode=check_mode(mode))
    if fast is not None:
        if len(_selects) > 4096:
            _selects.clear()
        _selects[fast] = sel
    return sel


def not_tensors(op: str, optional: tuple[str, ...] = (), **args: object) -> TypeError:
    """The error for a tensor argument of ``tiered_ops.<op>`` that is not a tensor (``None`` where ``optional``):
    the hot path reads ``.requires_grad`` of each and lands here on an AttributeError."""
    name, v = next((k, v) for k, v in args.items()
                   if not isinstance(v, torch.Tensor) and not (v is None and k in optional))
    return TypeError(f"{op}: argument '{name}' must be a torch.Tensor{' or None' if name in optional else ''}, "
                     f"got {type(v).__name__}")


def dispatch(spec: OpSpec, key: tuple, x: torch.Tensor, args: tuple, kwargs: dict[str, Any],
             train: bool = False) -> torch.Tensor:
    """Slow path of ``tiered_ops.<op>``: resolve the call's selection, cache it by exact signature.

    ``train`` (the last element of ``key`` too) picks the fwd+bwd decision, else the fwd_nograd one."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{spec.name}: first argument must be a torch.Tensor, got {type(x).__name__}")
    problem = spec.problem_of(*args, **kwargs)  # validates dims/shapes with torch-like errors
    if _recorders:  # tiered_ops.tune is recording a real step's calls
        _note(spec, problem, x.dtype, "fwd+bwd" if train else "fwd_nograd", x.device)
    # no store to measure into: eager (tuning off, nothing stored); a store failing now: eager, said once. While
    # dynamo traces, the store is not looked at (its lock would break the graph): a decision made before is read.
    unusable = not torch.compiler.is_compiling() and get_store().unusable
    try:
        sel = select_problem(spec, problem, _as_dtype(x.dtype), x.device, tune=False if unusable else None,
                             mode="fwd+bwd" if train else "fwd_nograd")
    except STORE_ERRORS as e:
        log.warning("tiered_ops.%s: the store failed while deciding (%s); eager for this call signature", spec.name, e)
        eager = spec.impls["eager"]
        sel = Selection(eager.fn, eager, dict(op=spec.name, problem=str(problem), chosen=eager.name, tier="eager",
                                              reason=f"the store failed: {e}: eager", candidates=[]))
    if len(_calls) > 4096:
        _calls.clear()
    _calls[key] = sel
    return sel.fn(*args, **kwargs)
