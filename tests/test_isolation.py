"""Process isolation: a crashing, hanging or uncompilable candidate costs itself only; an interrupted sweep keeps
what it finished and resumes. The plants are in tests/plants (Python and Triton-interpreter plants run here; the
CUDA plants in test_isolation_gpu via scripts/gpu.sh)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import plants
import pytest
import torch
from helpers import default_sigint

from tiered_ops.decide.decide import select_backend, use_store
from tiered_ops.measure.worker import Pool
from tiered_ops.registry import make_problem
from tiered_ops.store.store import Store
from tiered_ops.sweep.bench import sweep

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


def test_pool_names_the_signal_the_exit_code_and_the_timeout():
    with Pool(CPU, [], timeout_s=3, log=lambda s: None) as pool:
        assert pool.run(("run", "math", "sqrt", 16.0), "sqrt") == (4.0, None)
        first = pool.info["pid"]
        reply, why = pool.run(("run", "os", "abort"), "abort")
        assert reply is None and "killed by signal SIGABRT" in why
        reply, why = pool.run(("run", "os", "_exit", 3), "exit")
        assert reply is None and why.startswith("worker exited with code 3")
        t0 = time.monotonic()
        reply, why = pool.run(("run", "time", "sleep", 60), "sleep")
        assert reply is None and why == "timed out after 3 s" and time.monotonic() - t0 < 20
        assert pool.run(("run", "math", "sqrt", 9.0), "sqrt") == (3.0, None)  # a fresh worker took over
        assert pool.info["pid"] != first and pool.started == 4


def test_a_harness_error_in_the_worker_is_raised_not_recorded_as_a_candidate_failure():
    with Pool(CPU, [], timeout_s=30, log=lambda s: None) as pool:
        with pytest.raises(RuntimeError, match="(?s)harness failed in the worker.*ZeroDivisionError"):
            pool.run(("run", "operator", "truediv", 1, 0), "div")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plants on the Triton interpreter (CI); the GPU runs "
                    "test_planted_cuda_kernels_cost_one_candidate_each")
def test_sweep_survives_planted_crash_hang_and_compile_error(private_store):
    store = Store(private_store)
    said: list[str] = []
    problem = make_problem((4096,))
    df = sweep([plants.SPEC], {"plant_double": [problem]}, [torch.float32], CPU, store, progress=False,
               log=said.append, modes=["fwd_nograd"], isolate=True, timeout_s=15)
    by = {r.impl: r for r in df.itertuples()}
    assert by["eager"].ok == 1 and by["eager"].p50_us > 0
    assert by["triton_good"].ok == 1 and by["triton_good"].rel_error < 1e-6  # checked on the interpreter
    assert by["py_segv"].ok == 0 and "killed by signal SIGSEGV" in by["py_segv"].reason
    assert by["py_hang"].ok == 0 and "timed out after 15 s" in by["py_hang"].reason
    assert by["triton_bad"].ok == 0 and "planted: this kernel does not compile" in by["triton_bad"].reason
    assert by["cuda_oob"].reason.startswith("unavailable") and by["cuda_spin"].reason.startswith("unavailable")
    stored = {r["impl"]: r for r in store.rows(op="plant_double")}
    assert set(stored) == set(by) and all(stored[k]["ok"] == by[k].ok for k in by)
    assert any(re.search(r"7 measured now, 0 taken from the store .*; 3 worker", s) for s in said), said
    use_store(store)
    for policy in ("fastest", "cost-aware", "cold-start"):
        sel = select_backend("plant_double", (4096,), "fp32", CPU, tune=False, policy=policy)
        assert sel.name == "eager", sel.record


def _workers(tag: str) -> set[int]:
    """Live worker processes that inherited TIERED_OPS_TEST_TAG=tag (other tests' workers may run beside them)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"tiered_ops.measure.serve" in (d / "cmdline").read_bytes() and \
                        f"TIERED_OPS_TEST_TAG={tag}".encode() in (d / "environ").read_bytes():
                    out.add(int(d.name))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_sweep_keeps_its_measurements_and_resumes(private_store, sig):
    shapes = ["64x64", "128x128", "256x256", "512x512", "32x32", "16x16"]
    cmd = [sys.executable, "-m", "tiered_ops.cli.cli", "--db", str(private_store), "bench", "--ops", "muladd",
           "--impls", "eager,eager_addcmul", "--modes", "fwd_nograd,fwd+bwd", "--dtypes", "fp32", "--no-progress",
           "--shapes", *shapes]
    tag = f"{os.getpid()}-{sig.name}"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TIERED_OPS_TEST_TAG=tag), preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if private_store.exists() and len(Store(private_store).rows()) >= 3:
            break
        time.sleep(0.05)
    assert _workers(tag), "no measuring worker seen while the sweep ran: the orphan check below would prove nothing"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    kept = len(Store(private_store).rows())
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: every finished measurement is in" in err
    assert 3 <= kept < 24, "the sweep finished before the signal: make it longer"
    time.sleep(1)
    assert not _workers(tag), "the worker outlived the interrupted sweep"
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{24 - kept} measured now, {kept} taken from the store" in rerun.stdout
    assert len(Store(private_store).rows()) == 24


def test_the_cli_imports_plant_modules_and_isolates_by_default(private_store):
    r = subprocess.run([sys.executable, "-m", "tiered_ops.cli.cli", "--db", str(private_store), "bench", "--import",
                        "tests.plants", "--ops", "plant_double", "--impls", "eager,py_segv", "--shapes", "1000",
                        "--modes", "fwd_nograd", "--no-progress", "--timeout", "60"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "each candidate in a worker process, 60 s at most" in r.stdout
    assert re.search(r"rows failed \(never chosen\): py_segv \(crashed or hung: worker killed by signal SIGSEGV",
                     r.stdout), r.stdout
    assert re.search(r"^plant_double +1000 +fp32 +eager$", r.stdout, re.M), r.stdout  # the summary's winner
    assert os.path.exists(private_store)


@pytest.mark.gpu
@pytest.mark.timeout(400)  # the spinning plant alone costs its 60 s timeout; the plant extension's build comes first
def test_planted_cuda_kernels_cost_one_candidate_each(private_store):
    """An out-of-bounds write (illegal address: the worker's CUDA context is lost) and a kernel that never ends, among
    good candidates on the GPU: each plant is recorded with its reason, and the candidates after them still run.

    The planted extension is built here first, outside any candidate's timeout: built inside the worker, its
    compilation counted against the out-of-bounds plant's 60 s, and with 12 test workers sharing the host it took
    longer, so the plant was recorded as timed out instead of as an illegal address. The worker then loads the
    build (the same build directory) in a moment."""
    dev = torch.device("cuda")
    assert plants._cuda_available(dev) is None
    store = Store(private_store)
    said: list[str] = []
    df = sweep([plants.SPEC], {"plant_double": [make_problem((1 << 20,))]}, [torch.float32], dev, store,
               progress=False, log=said.append, modes=["fwd_nograd"], isolate=True, timeout_s=60,
               gate_all=True)  # the good Triton candidate gated too, whether or not a choice would take it
    by = {r.impl: r for r in df.itertuples()}
    print("\n".join(said))
    print(df[["impl", "ok", "p50_us", "reason"]].to_string())
    assert "illegal memory access" in by["cuda_oob"].reason and by["cuda_oob"].ok == 0
    assert "timed out after 60 s" in by["cuda_spin"].reason and by["cuda_spin"].ok == 0
    assert "killed by signal SIGSEGV" in by["py_segv"].reason
    assert "planted: this kernel does not compile" in by["triton_bad"].reason
    assert by["eager"].ok == 1 and by["triton_good"].ok == 1 and by["triton_good"].p50_us > 0  # after the plants
    assert any("CUDA context is broken afterwards" in s for s in said), said
    use_store(store)
    sel = select_backend("plant_double", (1 << 20,), "fp32", dev, tune=False)
    assert sel.name in ("eager", "triton_good"), sel.record
