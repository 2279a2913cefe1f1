"""What the call path (``tiered_ops.runtime``) asks the tuner: on a miss, the selection of one call's problem in one
context (``ask``); while dynamo traces a call, the name of the implementation the trace calls (``trace_choice``,
``compiled``'s: a function dynamo calls for real and takes the result of as a constant, ``assume_constant_result``'s
mark, so nothing it reads becomes a guard). Deciding publishes the decisions made (``table``); what is returned is
the table's entry, or, where none can be made now, what runs meanwhile (the eager tier where the store fails, with
the reason)."""

from __future__ import annotations

import logging

import torch

from ..registry import Context, OpSpec, Problem
from ..store.store import STORE_ERRORS
from .compiled import _assume_constant_result as assume_constant_result
from .compiled import trace_choice
from .decide import Selection, capture_selection, get_store, select_problem

__all__ = ["ask", "assume_constant_result", "trace_choice"]

log = logging.getLogger(__name__)


def ask(spec: OpSpec, problem: Problem, dtype: torch.dtype, device: torch.device, mode: str, context: Context,
        capturing: tuple | None = None) -> Selection:
    """The selection for a call of ``spec`` at ``problem`` in ``context``, decided from the store without measuring
    on the calling thread, except an eager call under blocking tuning, which measures its bucket first. Inside a
    CUDA-graph capture (``capturing``: the call's tensor flavours, ``capture.flavor``) only a warm decision is taken,
    nothing decided. A store that fails: the eager tier (said in the log for an eager call)."""
    if capturing is not None:
        return capture_selection(spec, problem, dtype, device, mode, capturing)
    try:
        # no store to measure into: eager (tuning off, nothing stored); a compiled or graphed decision made for an
        # eager call is read from the rows there are
        tune = None if context == Context.EAGER and not get_store().unusable else False
        return select_problem(spec, problem, dtype, device, tune=tune, mode=mode, context=context,
                              warm_graphed=False)
    except STORE_ERRORS as e:
        if context == Context.EAGER:
            log.warning("tiered_ops.%s: the store failed while deciding (%s); eager for this call signature",
                        spec.name, e)
        eager = spec.impls["eager"]
        return Selection(eager.fn, eager, dict(op=spec.name, problem=str(problem), chosen=eager.name, tier="eager",
                                               reason=f"the store failed: {e}: eager", candidates=[]))
