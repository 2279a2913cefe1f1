"""What a trace of ``tiered_ops.<op>`` calls, decided at trace time without leaving the graph.

While dynamo traces, a call signature with no primed selection (``dispatch.prime_trace``) asks ``trace_choice``, a
function dynamo calls for real with the call's constant description (op, shape, parameters, dtype, device, mode) and
whose result, the name of the implementation the trace calls, it takes as a constant
(``torch.compiler.assume_constant_result``'s mark): no graph break, also under ``fullgraph=True``, and its side effects
happen once, at trace time. It reads the compiled context's decision where one is made or can be made from the
stored rows of the bucket without measuring; else (a miss) it queues the bucket for background tuning (unless tuning
is off) and the trace calls the eager tier, the op's plain torch decomposition, which Inductor fuses with its
neighbours. A later process (or a recompile) reads the measured decision.

Nothing here is read by the trace itself (dynamo does not trace into ``trace_choice``): the caches it reads and fills
add no guard, so filling them never recompiles the graph that asked. For the same reason the trace reaches the
implementation through the op's own table (``spec.impls``), never through a cache this fills (``hot._TRACE_FNS``):
dynamo keeps what it read of a dict before the call and would not see the new entry.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

from ..measure.fingerprint import fingerprint
from ..measure.measure import bucket_str
from ..registry import DTYPE_NAMES, DTYPES, Impl, OpSpec, Problem
from ..store.rows import from_pack
from ..store.store import STORE_ERRORS
from ..tiers.catalog import get_op
from . import background, table
from . import decide as _decide

log = logging.getLogger(__name__)
_told: set[tuple] = set()  # buckets whose traced miss was logged


@contextlib.contextmanager
def _run_for_real() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` False while ``trace_choice`` runs: dynamo calls it for real, outside the
    graph, but torch's flag says a compile session is on, and the deciding code reads it to keep out of traces."""
    tc = torch.compiler
    if not isinstance(getattr(tc, "_is_compiling_flag", None), bool):
        yield  # a torch whose is_compiling() is False outside the traced frames
        return
    old, tc._is_compiling_flag = tc._is_compiling_flag, False
    try:
        yield
    finally:
        tc._is_compiling_flag = old


def _assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result``'s mark, set without importing dynamo (that import takes seconds in
    every process that imports tiered_ops, the measurement workers' included): the mark is all the decorator does
    (``torch/_dynamo/decorators.py``); tests/test_compile_first.py holds it to torch's."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_assume_constant_result
def trace_choice(op: str, bucket: tuple, shape: tuple | None, params: tuple, dtype: str, device: str, mode: str
                 ) -> str:
    """The name of the implementation a trace of one ``tiered_ops.<op>`` call calls: the compiled context's
    decision, else the eager tier. ``shape`` None: the trace's sizes are symbolic (dynamic shapes): only a
    decision made already for the bucket is read, nothing is queued."""
    spec, dev = get_op(op), torch.device(device)
    with _run_for_real():
        try:
            impl = _choose(spec, bucket, None if shape is None else Problem(shape, params), DTYPES[dtype], dev, mode)
        except STORE_ERRORS as e:
            log.warning("tiered_ops.%s traced: the store failed while deciding (%s); eager", op, e)
            impl = spec.impls["eager"]
    return impl.name


def _choose(spec: OpSpec, bucket: tuple, problem: Problem | None, dtype: torch.dtype, device: torch.device,
            mode: str) -> Impl:
    how = (*_decide.default_policy(), _decide._budget)
    sel = table.current().decision((spec.name, bucket, dtype, device, mode, "compiled"), how)
    if sel is not None:
        return sel.impl
    if problem is None:
        return _miss(spec, bucket, None, dtype, device, mode, [], None)
    store = _decide.get_store()
    fp, dname = fingerprint(device), DTYPE_NAMES[dtype]
    key = (spec.name, bucket_str(bucket), dname, fp.key, mode)
    rows = store.latest(*key)
    missing = [i.name for i in spec.unmeasured(rows)]
    if not missing and not any(from_pack(r) for r in rows):
        # the bucket is measured: its decisions are made from the rows (and kept for every context), as an eager
        # call would make them; nothing is measured
        return _decide.select_problem(spec, problem, dtype, device, tune=False, mode=mode, context="compiled",
                                      warm_graphed=False).impl
    return _miss(spec, bucket, problem, dtype, device, mode, missing, (key, store))


def _miss(spec: OpSpec, bucket: tuple, problem: Problem | None, dtype: torch.dtype, device: torch.device, mode: str,
          missing: list[str], where: tuple[tuple, Any] | None) -> Impl:
    """No decision for a traced call: the eager tier, its bucket queued for background tuning (not with tuning off,
    a store that cannot keep rows, or symbolic sizes)."""
    why = "symbolic sizes" if problem is None else "tuning off"
    if problem is not None and where is not None and _decide.tuning_mode() != "off":
        key, store = where
        if store.unusable:
            why = f"the store is unusable ({store.unusable})"
        else:
            _, why = background.request(spec, problem, dtype, device, mode, "compiled", key, missing, store,
                                        _decide._landed)
    told = (spec.name, bucket, dtype, device, mode)
    if told not in _told:
        _told.add(told)
        log.info("tiered_ops.%s %s %s %s traced with no decision: the eager tier goes into the graph (%s)", spec.name,
                 problem if problem is not None else bucket, DTYPE_NAMES[dtype], mode, why)
    return spec.impls["eager"]

