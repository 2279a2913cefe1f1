"""select_backend and the per-call dispatch of ``tiered_ops.<op>``.

A decision is keyed by (op, shape bucket, dtype, device fingerprint). Each op documents its bucket
(leading dims rounded up to a power of two, reduced dims exact), so a new batch size reuses the
decision of its bucket. The decision is derived from the freshest stored measurement of every
implementation whose source is unchanged: the correct implementation with the lowest time a caller
sees wins. With no fresh measurement for the bucket it measures then, at the requested shape, and
persists (like ``triton.autotune``), unless tuning is off (``TIERED_OPS_TUNE=0`` or
``set_tuning(False)``): then it returns the eager tier and the record says so.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .measure import bucket_str, measure
from .registry import DTYPE_NAMES, DTYPES, Impl, OpSpec, Problem, Tier, get_op
from .store import Store
from .timing import default_device, fingerprint

_tune: bool | None = None
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


def use_store(store: Store | str | None) -> Store:
    """Point selection at a store (object or path); None re-reads TIERED_OPS_DB."""
    global _store
    with _lock:
        if _store is not None and _store is not store:
            _store.close()
        _store = store if isinstance(store, Store) else Store(store)
        clear_cache()
        return _store


def get_store() -> Store:
    with _lock:
        return _store if _store is not None else use_store(None)


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


def _decide(spec: OpSpec, rows: list[dict], dtype: torch.dtype, device: torch.device) -> tuple[Impl, str, list]:
    """Pick the fastest correct fresh implementation; returns (impl, reason, candidate summaries)."""
    cands, best = [], None
    for r in rows:
        impl = spec.fresh_impl(r)
        fresh = impl is not None
        cands.append({k: r.get(k) for k in ("impl", "tier", "caller_us", "p50_us", "host_us", "gbps", "frac_copy",
                                            "rel_error", "ok", "reason")} | {"fresh": fresh})
        if fresh and r["ok"] and r["caller_us"] is not None and impl.why_not(device, dtype) is None:
            if best is None or r["caller_us"] < best["caller_us"]:
                best = r
    if best is None:
        return spec.impls["eager"], "no correct timed implementation: eager", cands
    return spec.impls[best["impl"]], f"fastest correct ({best['caller_us']:.1f} us per call)", cands


def select_problem(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device,
                   tune: bool | None = None, progress: Callable[[str], None] | None = None) -> Selection:
    bucket = spec.bucket(problem)
    key = (spec.name, bucket, dtype, device)
    sel = _decisions.get(key)
    if sel is not None:
        return sel
    with _lock:
        store = get_store()
        fp = fingerprint(device)
        bkey, dname = bucket_str(bucket), DTYPE_NAMES[dtype]
        rows = store.latest(spec.name, bkey, dname, fp.key)
        have = {r["impl"] for r in rows if spec.fresh_impl(r) is not None}
        missing = [i for i in spec.impls.values() if i.name not in have]
        tune = tuning_enabled() if tune is None else tune
        if missing and tune:
            new = []
            for impl in missing:
                if progress:
                    progress(f"measuring {spec.name} {impl.name} {problem} {dname}")
                new.append(measure(spec, impl, problem, dtype, device))
            store.add(new)
            rows = store.latest(spec.name, bkey, dname, fp.key)
        if not rows and not tune:
            impl, reason, cands = spec.impls["eager"], "tuning off and no stored decision for this bucket: eager", []
        else:
            impl, reason, cands = _decide(spec, rows, dtype, device)
        record = dict(op=spec.name, problem=str(problem), bucket=bkey, dtype=dname, device=fp.key,
                      chosen=impl.name, tier=impl.tier.label, reason=reason, candidates=cands)
        sel = Selection(impl.fn, impl, record)
        _decisions[key] = sel
        return sel


def select_backend(op: str, shapes: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype | str | None = None,
                   device: torch.device | str | None = None, *, tune: bool | None = None, **params: Any
                   ) -> Selection:
    """The implementation to use for ``op`` at ``shapes`` (shape of the first input) on this device.

    ``params`` are the op's non-tensor arguments that shape the work (``dim`` for softmax,
    ``normalized_shape`` and ``weight`` for rms_norm). Returns a callable with ``.tier``, ``.name`` and
    ``.record`` (every candidate's figures and why the winner won).
    """
    try:  # fast path: the same arguments as an earlier call (unhashable params skip it)
        fast = (op, tuple(shapes), dtype, device, tune, tuple(params.items()))
        sel = _selects.get(fast)
        if sel is not None:
            return sel
    except TypeError:
        fast = None
    spec = get_op(op)
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    sel = select_problem(spec, spec.problem(tuple(shapes), **params), _as_dtype(dtype), dev, tune)
    if fast is not None:
        if len(_selects) > 4096:
            _selects.clear()
        _selects[fast] = sel
    return sel


def dispatch(spec: OpSpec, key: tuple, x: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """Slow path of ``tiered_ops.<op>``: resolve the call's selection, cache it by exact signature."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{spec.name}: first argument must be a torch.Tensor, got {type(x).__name__}")
    problem = spec.problem_of(*args, **kwargs)  # validates dims/shapes with torch-like errors
    sel = select_problem(spec, problem, _as_dtype(x.dtype), x.device)
    if len(_calls) > 4096:
        _calls.clear()
    _calls[key] = sel
    return sel.fn(*args, **kwargs)
