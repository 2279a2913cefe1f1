"""Isolated measurement: each candidate is gated and timed in a worker process, so one that crashes (illegal
address, abort, segfault) or hangs costs that candidate only.

The parent (``sweep(isolate=True)``, the CLI's default) starts one worker per device with
``CUDA_VISIBLE_DEVICES`` set to that GPU and sends it one task at a time. A worker that dies is recorded
against the candidate it was running (signal or exit code, and the last lines it wrote to stderr, where
CUDA's error text lands); one that does not answer within the per-candidate timeout is killed and recorded
as "timed out after N s". After a task the worker checks its CUDA context (a synchronize and a tiny kernel);
when that fails (an illegal address poisons the context for good) it says so and exits. The next task gets
a fresh worker. Tasks and replies are pickled, length-prefixed, over the worker's stdin and a private copy
of its stdout; anything a kernel or library prints goes to the worker's stderr log instead.

The worker registers ops by importing the modules that define them (``tiered_ops.ops``, and for ops
declared elsewhere, the module of each spec's reference), with the parent's ``sys.path``. This module is the
parent's side and the protocol; the worker's own side (its imports, its task loop) is ``serve``.
"""

from __future__ import annotations

import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<Q")


def send(f: Any, obj: Any) -> None:
    """One message of the protocol both sides share: its pickled length, then the pickle."""
    data = pickle.dumps(obj)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def recv_blocking(f: Any) -> Any:
    """The next message from ``f``, waiting for it; EOFError when the other side has gone."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    return pickle.loads(f.read(_HEADER.unpack(head)[0]))


class WorkerDied(Exception):
    """The worker exited (or was killed) before it answered; the message says how."""


class WorkerTimeout(Exception):
    pass


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


class Worker:
    """One worker process for one device; replaced by the caller when it dies or times out."""

    def __init__(self, device: str, modules: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # Inductor compiles in-process: its pool of compile workers would start (one process per core, each
        # importing torch) while the next candidate's host time is being measured.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        local = device
        if device.startswith("cuda"):
            index = device.split(":")[1] if ":" in device else "0"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[int(index)] if visible else index
            local = "cuda:0"
        self.log = tempfile.NamedTemporaryFile(prefix="tiered_ops_worker_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiered_ops.measure.serve", local, *modules], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, env=env, start_new_session=True,  # Ctrl-C is the parent's
        )
        self._buf = b""
        self._task_start = 0
        self._busy = False  # a task was sent and its reply not read: the worker reads no EOF until it is done

    def stderr_tail(self, n: int = 3) -> str:
        """What the worker wrote to stderr during the current task: its error lines (a fatal signal's line from
        faulthandler, CUDA's error text), else its last ``n`` lines."""
        try:
            with open(self.log.name, "rb") as f:
                f.seek(self._task_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
        errors = [ln for ln in lines if re.search(r"Fatal Python error|[Ee]rror\b|Abort|illegal", ln)]
        return " | ".join((errors or lines)[-n:])[-600:]

    def call(self, task: tuple, timeout_s: float) -> Any:
        """Send one task and wait for its reply; WorkerDied / WorkerTimeout when there is none."""
        self._task_start = os.path.getsize(self.log.name)
        self._busy = True
        try:
            send(self.proc.stdin, task)
        except (BrokenPipeError, OSError):
            raise WorkerDied(self._death()) from None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            if len(self._buf) >= _HEADER.size:
                size = _HEADER.unpack(self._buf[:_HEADER.size])[0]
                if len(self._buf) >= _HEADER.size + size:
                    data = self._buf[_HEADER.size:_HEADER.size + size]
                    self._buf = self._buf[_HEADER.size + size:]
                    self._busy = False
                    return pickle.loads(data)
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerTimeout(f"timed out after {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise WorkerDied(self._death())
                self._buf += chunk

    def _death(self) -> str:
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.returncode
        tail = self.stderr_tail()
        return f"worker {_signal_name(rc)}" + (f"; its stderr: {tail}" if tail else "")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None and not self._busy:  # interrupted mid-task (Ctrl-C): kill, do not wait for it
            try:
                self.proc.stdin.close()  # EOF: the worker exits on its own
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.proc.stdout.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class Pool:
    """Isolated measurement on one device: a worker that is replaced whenever it dies, hangs or breaks its CUDA
    context. ``run`` returns (reply, None), or (None, why) when the worker died or timed out on that task."""

    def __init__(self, device: Any, modules: list[str], timeout_s: float = 300.0, start_timeout_s: float = 900.0,
                 log: Any = print, warm_up: bool = False) -> None:
        self.device, self.modules, self.timeout_s, self.start_timeout_s = str(device), modules, timeout_s, \
            start_timeout_s
        self.log, self.worker, self.info, self.started = log, None, None, 0
        self.warm_up = warm_up  # the first worker's start also compiles a tiny function (Inductor, Triton): serve._do
        self._spawned: Worker | None = None

    def spawn(self) -> None:
        """Start the worker's process without waiting for its answer (``start`` waits): it is the calling thread's
        child, and dies with that thread (``PR_SET_PDEATHSIG``), so spawn from a thread that lives as long as it."""
        if self.worker is None and self._spawned is None:
            self._spawned = Worker(self.device, self.modules)

    def _ready(self) -> Worker:
        if self.worker is None:
            w, self._spawned = self._spawned or Worker(self.device, self.modules), None
            self.started += 1
            try:
                self.info = w.call(("hello", self.warm_up and self.started == 1), self.start_timeout_s)[0]
            except (WorkerDied, WorkerTimeout) as e:
                w.close()
                raise RuntimeError(f"a measurement worker for {self.device} could not start: {e}") from None
            if isinstance(self.info, HarnessError):
                w.close()
                raise RuntimeError(f"a measurement worker for {self.device} could not start:\n{self.info}")
            self.worker = w
        return self.worker

    def start(self) -> float | None:
        """Start a worker where none runs: the seconds its start took (its imports, its CUDA context, the
        extension's load: ``info["start_parts"]`` has them part by part); None where one was running already."""
        if self.worker is not None:
            return None
        t0 = time.perf_counter()
        self._ready()
        took = time.perf_counter() - t0
        parts = self.info.get("start_parts") if isinstance(self.info, dict) else None
        if isinstance(parts, dict):  # what the worker did not time: the interpreter's start, the package's import
            self.info["start_parts"] = {"interpreter and package import": round(took - sum(parts.values()), 3),
                                        **parts}
        return took

    def hello(self) -> dict:
        self._ready()
        return self.info

    def run(self, task: tuple, what: str) -> tuple[Any, str | None]:
        w = self._ready()
        try:
            reply, sick = w.call(task, self.timeout_s)
        except (WorkerDied, WorkerTimeout) as e:
            self._drop()
            self.log(f"{what}: {e}; a new worker takes the next candidate")
            return None, str(e)
        if sick:
            self._drop()
            self.log(f"{what}: the worker's CUDA context is broken afterwards ({sick}); a new worker takes the next "
                     "candidate")
        if isinstance(reply, HarnessError):
            raise RuntimeError(f"{what}: the harness failed in the worker:\n{reply}")
        return reply, None

    def _drop(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            spawned.close()

    def close(self) -> None:
        self._drop()

    def kill(self) -> None:
        """Kill its worker now, answered or only spawned (a task in flight on another thread ends at once)."""
        for w in (self.worker, self._spawned):
            if w is not None:
                w.kill()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HarnessError(str):
    """The worker's traceback when the harness itself failed (not a candidate): the parent raises it."""
