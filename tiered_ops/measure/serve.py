"""The worker process's side of isolated measurement (``worker.Worker`` starts it as
``python -m tiered_ops.measure.serve <device> <modules>``): it imports torch and the ops once, then answers one task
at a time over the protocol of ``worker`` (a task in, its reply and the state of the CUDA context out), and exits when
its context breaks or its stdin closes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from .worker import HarnessError, recv_blocking, send


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the parent dies, so a killed sweep leaves no orphan on the GPU."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _healthy(device: Any) -> str | None:
    import torch

    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        if torch.ones(1, device=device).add_(1).item() != 2.0:
            return "a tiny kernel gave a wrong answer"
    except Exception as e:  # a sticky CUDA error: this context is done
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return None


def serve(device_str: str, modules: list[str]) -> None:
    # The worker process's imports happen here, not at the top: torch, the catalog and the modules to measure are
    # loaded only after stdout is redirected and faulthandler is on, so that a crash while importing is reported.
    proto = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints from kernels and libraries go to the log, not into the protocol
    _die_with_parent()
    import faulthandler
    import importlib

    faulthandler.enable()  # a fatal signal writes its name and the Python stack to the log the parent reads

    parts = _Parts()
    import torch

    parts.done("torch import")
    from ..registry import DTYPES
    from ..tiers.catalog import load

    for m in modules:
        importlib.import_module(m)
    OPS = load()  # the built-in ops and those the modules declared, built into their tiers
    parts.done("catalog")
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context, made here so that its seconds are said apart
        parts.done("CUDA context")
    stdin = sys.stdin.buffer
    while True:
        try:
            task = recv_blocking(stdin)
        except EOFError:
            return
        try:
            reply = _do(task, device, OPS, DTYPES)
            if task[0] == "hello" and isinstance(reply, dict):
                reply["start_parts"] = {**parts.took, **reply.get("start_parts", {})}
        except Exception:  # a harness error, not a candidate's: the parent raises it
            import traceback

            reply = HarnessError(traceback.format_exc())
        sick = _healthy(device)
        send(proto, (reply, sick))
        if sick:
            return


class _Parts:
    """The seconds of the worker's start, part by part (``done(name)`` closes the part since the last one): the hello
    reply carries them as ``start_parts``, so that a slow start says where it went."""

    def __init__(self) -> None:
        self.took: dict[str, float] = {}
        self._t = time.perf_counter()

    def done(self, name: str) -> None:
        t = time.perf_counter()
        self.took[name], self._t = round(t - self._t, 3), t


def _warm_up(device: Any) -> None:
    """One tiny function compiled and run: the first compile of a process pays for importing dynamo and Inductor,
    their caches and (on a GPU) Triton's driver, seconds that would otherwise fall on the first compiled candidate."""
    import torch

    fn = torch.compile(lambda x: x * 2.0 + 1.0, dynamic=False)
    fn(torch.ones(8, device=device))
    torch._dynamo.reset()  # nothing of it stays in the caches the candidates use


def _do(task: tuple, device: Any, OPS: dict, DTYPES: dict) -> Any:
    kind = task[0]
    if kind == "hello":
        from .fingerprint import fingerprint
        from .timing import copy_bandwidth_gbps

        parts = _Parts()
        if device.type == "cuda":
            from ..tiers import cuda_ext

            cuda_ext.load(device)  # build or load the extension here, not inside a candidate's timeout
            parts.done("extension load")
        info = dict(fingerprint=fingerprint(device))
        parts.done("fingerprint")
        info.update(copy_gbps=copy_bandwidth_gbps(device), pid=os.getpid())
        parts.done("copy probe")
        if len(task) > 1 and task[1]:
            _warm_up(device)
            parts.done("compiler warm-up")
        return dict(info, start_parts=parts.took)
    if kind == "measure":
        from .measure import measure

        _, op, impl, problem, dtype, mode, *kw = task  # kw: measure's keywords (the pruning bar), when any
        spec = OPS[op]
        return measure(spec, spec.impls[impl], problem, DTYPES[dtype], device, mode, **(kw[0] if kw else {}))
    if kind == "first_call":  # a candidate's first call beside the measuring worker (measure.first_call)
        from .measure import first_call

        _, op, impl, problem, dtype, mode = task
        return first_call(OPS[op], OPS[op].impls[impl], problem, DTYPES[dtype], device, mode)
    if kind == "host":  # launch-bound candidates of one case timed again side by side (recheck.side_by_side)
        from .recheck import side_by_side

        _, op, names, problem, dtype, mode = task
        return side_by_side(OPS[op], list(names), problem, DTYPES[dtype], device, mode)
    if kind == "gate":  # a row timed without its gate (measure's gated=False): the row back, gated
        from .verdict import gate_row

        _, op, impl, problem, dtype, mode, row, *edges = task  # edges: a pass the store recorded, when any
        spec = OPS[op]
        return gate_row(spec, spec.impls[impl], problem, DTYPES[dtype], device, mode, dict(row), *edges)
    if kind == "edges":  # a share of an implementation's edge checks (gate.check_edges): (worst error, why)
        from .gate import check_edges

        _, op, impl, dtype, grad, which = task
        spec = OPS[op]
        return check_edges(spec, spec.impls[impl], DTYPES[dtype], device, grad, which)
    if kind == "meta":
        from .meta import collect

        spec = OPS[task[1]]
        return collect(spec, spec.impls[task[2]], device)
    if kind == "run":  # tests: call a function by module and name inside the worker
        import importlib

        return getattr(importlib.import_module(task[1]), task[2])(*task[3:])
    raise ValueError(f"unknown task {kind!r}")


if __name__ == "__main__":
    from tiered_ops.measure.serve import serve as _serve  # classes by their module's name, not __main__'s

    _serve(sys.argv[1], sys.argv[2:])
