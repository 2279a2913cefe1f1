"""Test setup: Triton on the interpreter when there is no GPU, a private store per test, a `gpu` marker."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device: run scripts/gpu.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
    unknown = sorted({f"{item.module.__name__}: {op} has no implementation {impl!r}" for item, op, impl in
                      _op_impl_params(items) if impl not in _impls_of(op)})
    if unknown:  # a GPU-marked case of a tier the op lacks is skipped on the CPU and fails only on a GPU
        raise pytest.UsageError("test cases of implementations their op does not have:\n" + "\n".join(unknown))


def _op_impl_params(items):
    """(item, op, impl) for each test of a module that names its op (``OP``) parametrized by an ``impl`` name."""
    for item in items:
        op, params = getattr(item.module, "OP", None), getattr(getattr(item, "callspec", None), "params", {})
        if isinstance(op, str) and isinstance(params.get("impl"), str):
            yield item, op, params["impl"]


def _impls_of(op: str) -> dict:
    from tiered_ops.tiers.catalog import get_op

    return get_op(op).impls


@pytest.fixture(autouse=True)
def no_contention_check(monkeypatch):
    """Sweeps in tests store CPU timings as taken: a 2-core CI machine running compile threads beside a test would
    otherwise flag rows whose figures the test reads (tests/test_timing.py switches the check on to test it)."""
    monkeypatch.setenv("TIERED_OPS_CONTENTION_CHECK", "0")


@pytest.fixture(autouse=True)
def blocking_in_process(monkeypatch):
    """Blocking tuning measures in the test's own process on a GPU too (on the CPU it does anyway): tests that time or
    patch the caller's measuring keep doing so, and a parallel GPU run does not start a measuring worker and its gate
    helpers per test process. tests/test_blocking_aside.py turns the hand-over to the worker on."""
    monkeypatch.setenv("TIERED_OPS_BLOCKING_ASIDE", "0")


@pytest.fixture(autouse=True)
def private_report(tmp_path, monkeypatch):
    """A bench in a test writes its report folder under the test's own directory, not into the checkout."""
    monkeypatch.setenv("TIERED_OPS_REPORT", str(tmp_path / "tiered_ops_report"))


@pytest.fixture(autouse=True)
def private_store(tmp_path, monkeypatch):
    """Every test gets its own SQLite store and a clean decision cache."""
    import tiered_ops.decide.decide as sel

    monkeypatch.setenv("TIERED_OPS_DB", str(tmp_path / "results.sqlite"))
    sel.use_store(None)
    yield tmp_path / "results.sqlite"
    sel.clear_cache()


from pgserver import pg_server, pg_url, store_target  # noqa: E402,F401  (PostgreSQL fixtures, tests/pgserver.py)


@pytest.fixture()
def private_decisions(tmp_path, monkeypatch):
    """A store of the test's own, tuning off: decisions read from it alone (eager where it holds nothing)."""
    from tiered_ops.decide import decide

    monkeypatch.setenv("TIERED_OPS_DB", str(tmp_path / "ctx.sqlite"))
    decide.use_store(None)
    decide.set_tuning(False)
    yield
    decide.set_tuning(None)
    decide.use_store(None)


@pytest.fixture
def two_softmaxes(monkeypatch):
    """softmax with eager and one more correct implementation (``again``, fast to measure on the CPU), so that
    decisions need no compiler."""
    from tiered_ops.registry import Impl, Tier
    from tiered_ops.tiers.catalog import get_op

    softmax = get_op("softmax")
    impls = {"eager": softmax.impls["eager"],
             "again": Impl("again", Tier.COMPILE, lambda x, dim=-1: torch.softmax(x, dim), (softmax.source,))}
    monkeypatch.setattr(softmax, "impls", impls)
    return impls
