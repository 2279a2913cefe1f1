"""Tune from a real step: record the tiered_ops calls of one forward (and backward), measure exactly those.

    tiered_ops.patch(model)
    report = tiered_ops.tune(model, (ids,))          # or train=True for a training step
    print(report)                                    # what was measured, what each call will run

``tune`` clears the call cache, runs the step with tuning off under a ``Recorder`` (so the step itself measures
nothing), then measures every recorded (op, problem, dtype, mode) that has no stored measurement and stores the
decisions, so the model's first real call reads them instead of measuring. The context (eager, compiled,
graphed) is recorded with each call (else the context the call was made in) and decided for.

``tiered-ops tune --module pkg.mod:make_model_and_inputs [--train]`` does the same from the command line
(``cli.tune``): the function returns ``(model, example_inputs)``.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from ..decide import decide
from ..registry import CONTEXTS, DTYPE_NAMES, Context, check_context
from ..runtime.dispatch import prime_trace
from ..runtime.memo import cache_state, keep_unchanged
from ..runtime.record import RecordedCall, Recorder
from ..tiers.catalog import get_op

log = logging.getLogger(__name__)


@dataclass
class TunedCall:
    """One recorded call, what measuring it took, and what it will run."""

    call: RecordedCall
    chosen: str
    tier: str
    reason: str
    measured: int  # measurements taken now (0: every implementation was stored already)
    seconds: float


@dataclass
class TuneReport:
    train: bool
    context: Context | None  # None: each call in the context it was made in
    record_seconds: float
    seconds: float  # recording and measuring
    calls: list[TunedCall] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> int:
        return sum(c.measured for c in self.calls)

    def __str__(self) -> str:
        head = (f"tune ({'training step' if self.train else 'inference'}, context {self.context or 'unset'}): "
                f"{len(self.calls)} distinct call(s), {self.measured} measurement(s) taken, "
                f"{self.seconds:.1f} s (recording {self.record_seconds:.1f} s)")
        lines = [head]
        for c in self.calls:
            lines.append(f"  {c.call}: {c.chosen} [{c.tier}]"
                         f" ({'measured ' + str(c.measured) if c.measured else 'stored'}, {c.seconds:.1f} s)"
                         f" - {c.reason}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _run(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _tensors(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):  # transformers' ModelOutput is a dict too
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            yield from _tensors(v)


def _loss(out: Any) -> torch.Tensor:
    """The step's loss: the output's ``loss`` where it has one, else the sum of the means of its floating tensors
    that require grad."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    parts = [t.float().mean() for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ValueError("tune: train=True needs a model output with a floating tensor that requires grad "
                         "(the parameters require grad, and the step runs outside torch.no_grad)")
    return torch.stack(parts).sum()


def _step(model: torch.nn.Module, inputs: Any, train: bool) -> None:
    if not train:
        with torch.no_grad():
            _run(model, inputs)
        return
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        _loss(_run(model, inputs)).backward()
    finally:
        for p, g in grads:  # the recording step leaves the parameters' gradients as they were
            p.grad = g


def record_step(model: torch.nn.Module, example_inputs: Any, train: bool = False,
                context: Context | str | None = None) -> list[RecordedCall]:
    """The distinct tiered_ops calls of one step of ``model`` (forward, and backward when ``train``), recorded
    with tuning off: nothing is measured, and the call cache is cleared before and after."""
    previous = decide.tuning_setting()  # the process setting (None: follow TIERED_OPS_TUNE)
    decide.clear_cache()
    decide.set_tuning(False)
    try:
        with Recorder(None if context is None else check_context(context)) as rec:
            _step(model, example_inputs, train)
    finally:
        decide.set_tuning(previous)  # clears the call cache: the decisions made without tuning are dropped
    return rec.calls


def _progress(calls: Sequence[RecordedCall]) -> Iterable[tuple[int, RecordedCall]]:
    if sys.stderr.isatty():
        from ..progress import Progress

        yield from enumerate(Progress(calls, desc="tune", unit="call", dynamic_ncols=True))
        return
    for i, call in enumerate(calls):
        log.info("tune: [%d/%d] %s", i + 1, len(calls), call)
        yield i, call


def tune(model: torch.nn.Module, example_inputs: Any, train: bool = False, context: Context | str | None = None
         ) -> TuneReport:
    """Record the tiered_ops calls of one step of ``model`` on ``example_inputs`` (a tuple of positional
    arguments, a dict of keyword arguments, or one tensor), measure each that has no stored measurement, and
    store the decisions. ``train``: a training step (forward and backward; the decisions for fwd+bwd), else
    inference under no_grad. ``context``: how the model will run, a ``Context`` or its text ("eager", "compiled",
    "graphed"); None: each call in the context it is made in."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tune: model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        context = None if context is None else check_context(context)
    except ValueError:
        raise ValueError(f"tune: context must be one of {', '.join(CONTEXTS)} or None (each call's own), got "
                         f"{context!r}") from None
    start = time.perf_counter()
    kept = cache_state()  # recording clears the caches: what this tune leaves unchanged comes back after it
    calls = record_step(model, example_inputs, train, context)
    report = TuneReport(train=train, context=context, record_seconds=time.perf_counter() - start, seconds=0.0)
    if not calls:
        report.notes.append("the step made no tiered_ops call: is the model patched (tiered_ops.patch)?")
    store = decide.get_store()
    for _, call in _progress(calls):
        t0, dname = time.perf_counter(), DTYPE_NAMES[call.dtype]
        before = {r["id"] for r in store.rows(op=call.op, dtype=dname, mode=call.mode)}
        sel = decide.select_backend(call.op, call.problem.shape, call.dtype, call.device, tune=True, mode=call.mode,
                                    context=call.context or Context.EAGER, **call.problem.kw)
        # implementations measured now (a candidate timed before its gate is stored again once gated: one measurement)
        taken = len({r["impl"] for r in store.rows(op=call.op, dtype=dname, mode=call.mode) if r["id"] not in before})
        report.calls.append(TunedCall(call, sel.name, sel.tier.label, str(sel.record.get("reason", "")), taken,
                                      time.perf_counter() - t0))
    keep_unchanged(kept)
    for call in calls:  # a later trace of the step finds its selections cached (kept ones are not made again)
        for signature, mixed in call.signatures:
            prime_trace(get_op(call.op), signature, mixed, call.problem, call.dtype, call.device, call.mode)
    report.seconds = time.perf_counter() - start
    log.info("tune: %d call(s), %d measurement(s), %.1f s", len(report.calls), report.measured, report.seconds)
    return report
