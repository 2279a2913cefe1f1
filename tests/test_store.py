"""The SQLite store under abuse: foreign and damaged files at its path, paths where no store
can be, stores that cannot be written, failures that were the environment's."""

import logging
import os
import pwd
import select
import shutil
import signal
import sqlite3
import stat
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch

import tiered_ops
from tiered_ops.decide import decide as sel_mod
from tiered_ops.measure.fingerprint import fingerprint
from tiered_ops.measure.measure import base_row
from tiered_ops.registry import Impl, Tier
from tiered_ops.runtime import memo
from tiered_ops.store.store import Store, StoreError, StoreWarning
from tiered_ops.sweep.bench import sweep
from tiered_ops.tiers.catalog import get_op

ROW = dict(op="x", impl="a", tier="eager", mode="fwd", problem="1", bucket="1", dtype="fp32", device_key="d", ok=1,
           source_hash="h", timestamp=1.0)


@pytest.fixture
def path(tmp_path):
    """A store path of the test's own: the autouse private store is already open at the default one."""
    return tmp_path / "abused.sqlite"


def _aside(path):
    """The moved-aside store files (their -wal/-shm companions, when there were any, moved with them)."""
    return [p for p in path.parent.iterdir() if p.name.startswith(path.name + ".unusable-")
            and not p.name.endswith(("-wal", "-shm"))]


def test_a_file_that_is_not_sqlite_is_moved_aside_not_overwritten(path):
    path.write_bytes(b"my notes, not a database\n" * 100)
    with pytest.warns(StoreWarning, match="not an SQLite file.*moved it to"):
        store = Store(path)
    store.add([ROW])
    assert len(store.rows()) == 1
    (aside,) = _aside(path)
    assert aside.read_bytes() == b"my notes, not a database\n" * 100
    assert store.moved_aside == aside


def test_another_programs_database_is_moved_aside_intact(path):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (name TEXT)")
    con.execute("INSERT INTO users VALUES ('ada')")
    con.commit()
    con.close()
    with pytest.warns(StoreWarning, match="something else.*users"):
        Store(path).close()
    (aside,) = _aside(path)
    assert sqlite3.connect(aside).execute("SELECT name FROM users").fetchall() == [("ada",)]


def test_a_damaged_store_is_moved_aside(path):
    store = Store(path)
    store.add([{**ROW, "problem": str(i), "reason": "r" * 500} for i in range(200)])  # several pages
    store.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 3 * 4096
    data[4096:3 * 4096] = b"\xff" * (2 * 4096)  # pages 2 and 3: b-tree pages of the tables
    path.write_bytes(bytes(data))
    with pytest.warns(StoreWarning, match="damage|cannot read"):
        fresh = Store(path)
    assert fresh.rows() == []
    assert len(_aside(path)) == 1


def test_an_empty_file_is_used_as_a_new_store_without_warning(path, recwarn):
    path.write_bytes(b"")
    Store(path).add([ROW])
    assert not [w for w in recwarn if issubclass(w.category, StoreWarning)]


def test_a_schema_2_store_is_migrated_in_place_and_keeps_its_rows(path):
    """A store written before the host spread existed (schema 2) opens with the new columns (empty in old rows),
    its rows intact, and rows come back in the declared column order whatever order the table has."""
    from tiered_ops.store.store import COLUMN_NAMES, COLUMNS, SCHEMA_VERSION

    later = ("host_p20_us", "host_p80_us", "env", "method", "origin", "context", "peak_bytes")  # schemas 3 to 6
    old = [(n, t) for n, t in COLUMNS if n not in later]
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    con.execute(f"CREATE TABLE measurements (id INTEGER PRIMARY KEY, {', '.join(f'{n} {t}' for n, t in old)})")
    con.execute("CREATE TABLE impl_meta (op TEXT NOT NULL, impl TEXT NOT NULL, device_key TEXT NOT NULL, "
                "source_hash TEXT NOT NULL, meta TEXT NOT NULL, timestamp REAL NOT NULL, "
                "PRIMARY KEY (op, impl, device_key, source_hash))")
    con.execute("INSERT INTO meta VALUES ('schema_version', '2')")
    con.execute("INSERT INTO measurements (op, impl, tier, mode, problem, bucket, dtype, device_key, ok, host_us, "
                "source_hash, timestamp) VALUES ('x', 'a', 'eager', 'fwd', '1', '1', 'fp32', 'd', 1, 7.0, 'h', 1.0)")
    con.commit()
    con.close()
    store = Store(path)
    (row,) = store.rows()
    assert row["host_us"] == 7.0 and row["host_p80_us"] is None
    assert list(row) == ["id", *COLUMN_NAMES]
    store.add([dict(row, id=None, host_p20_us=7.5, host_p80_us=9.0)])
    assert store.rows()[-1]["host_p80_us"] == 9.0
    assert store.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert row["env"] is None  # schema 4: a failure's build environment, and the claims of concurrent sweeps
    assert row["context"] == "eager"  # schema 7: a row from before contexts is an eager caller's
    assert store.count("claims") == 0


# ------------------------------------------------------------------------------------ paths where no store can be
def _writes_blocked(directory: Path) -> bool:
    """Whether the permissions of ``directory`` stop this process writing in it (they do not for root)."""
    probe = directory / ".probe"
    try:
        probe.write_bytes(b"")
    except OSError:
        return True
    probe.unlink()
    return False


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


class Unprivileged:
    """A directory ``dir`` and ``run(body)``, which calls ``body()`` where file permissions bind: in this process
    for a user other than root, else in a forked child that drops to ``nobody`` (tiered_ops already imported: the
    child needs no access to root's home, where the interpreter may live). The child's assertion errors, skips and
    log records (``caplog`` lives on in it) come back as this test's."""

    def __init__(self, directory: Path, ids: tuple[int, int] | None) -> None:
        self.dir, self.ids = directory, ids

    def run(self, body: Callable[[], None], timeout: float = 300.0) -> None:
        if self.ids is None:
            body()
            return
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            os.close(read_end)
            status, text = "ok", ""
            try:
                os.setgroups([])
                os.setgid(self.ids[1])
                os.setuid(self.ids[0])
            except OSError as e:
                status, text = "skip", f"cannot drop root's privileges to uid {self.ids[0]}: {e}"
            else:
                try:
                    torch.set_num_threads(1)  # OpenMP's pool does not survive fork
                    body()
                except pytest.skip.Exception as e:
                    status, text = "skip", str(e)
                except BaseException:
                    status, text = "fail", traceback.format_exc()
            with os.fdopen(write_end, "w") as f:
                f.write(f"{status}\n{text}")
            os._exit(0)
        os.close(write_end)
        chunks, deadline = [], time.monotonic() + timeout
        with os.fdopen(read_end, "rb") as f:
            while select.select([f], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            else:
                os.kill(pid, signal.SIGKILL)
        _, wait_status = os.waitpid(pid, 0)
        status, _, text = b"".join(chunks).decode(errors="replace").partition("\n")
        if status == "skip":
            pytest.skip(text)
        if status != "ok":
            pytest.fail(f"the child running as uid {self.ids[0]} (wait status {wait_status}, "
                        f"{'timed out' if time.monotonic() >= deadline else 'ended'}): {status} {text}", pytrace=False)


@pytest.fixture
def unprivileged(tmp_path):
    """An ``Unprivileged`` with a directory its user owns; skips only where permissions cannot bind (a user other
    than root whom chmod does not stop)."""
    if os.geteuid() != 0:
        d = tmp_path / "unprivileged"
        d.mkdir()
        d.chmod(0o555)
        blocked = _writes_blocked(d)
        d.chmod(0o755)
        if not blocked:
            pytest.skip("chmod 0o555 does not stop this user writing, and it is not root, who could drop privileges")
        yield Unprivileged(d, None)
        return
    ids = _nobody()
    d = Path(tempfile.mkdtemp(prefix="tiered_ops_unprivileged_"))  # pytest's tmp_path is root's, mode 0700
    try:
        os.chown(d, *ids)
        yield Unprivileged(d, ids)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _lock(directory: Path) -> Path:
    """``directory`` chmod 0o555 (its user can read, not write, in it)."""
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    assert _writes_blocked(directory)
    return directory


def test_a_directory_is_a_store_error_naming_it(tmp_path):
    with pytest.raises(StoreError, match=f"{tmp_path}: is a directory") as e:
        Store(tmp_path)
    assert isinstance(e.value, OSError)


def test_a_file_where_a_directory_must_be_is_a_store_error(tmp_path):
    (tmp_path / "notes").write_text("a file")
    with pytest.raises(StoreError, match="notes is a file, not a directory"):
        Store(tmp_path / "notes" / "results.sqlite")


def test_a_path_under_a_missing_parent_that_cannot_be_created_is_a_store_error(unprivileged):
    def body():
        d = _lock(unprivileged.dir)
        path = d / "missing" / "results.sqlite"
        with pytest.raises(StoreError, match=f"{path}: no store there and none can be created: directory {d} is not"):
            Store(path)
        assert not (d / "missing").exists()

    unprivileged.run(body)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc (nothing can be created in it)")
def test_a_path_where_the_directory_cannot_be_made_is_a_store_error_even_for_root():
    path = Path("/proc/tiered-ops-missing/results.sqlite")
    with pytest.raises(StoreError, match=str(path)):
        Store(path)


def _valid_store(path: Path) -> None:
    store = Store(path)
    store.add([ROW])
    store.close()


def test_a_valid_store_in_a_read_only_directory_is_read_not_moved_aside(unprivileged, caplog):
    def body():
        d = unprivileged.dir
        path = d / "results.sqlite"
        _valid_store(path)
        before = sorted(p.name for p in d.iterdir())
        _lock(d)
        with caplog.at_level(logging.WARNING, logger="tiered_ops.store.store"):
            store = Store(path)
            store.add([dict(ROW, problem="2")])
        assert [r["problem"] for r in store.rows()] == ["1", "2"]  # served from it, the new one kept in memory
        assert store.moved_aside is None
        assert store.kept_in_memory == f"{path} cannot be written: directory {d} is not writable"
        assert sorted(p.name for p in d.iterdir()) == before
        assert f"{path} cannot be written" in caplog.text and "kept in memory" in caplog.text
        d.chmod(0o755)
        assert [r["problem"] for r in Store(path).rows()] == ["1"]

    unprivileged.run(body)


def test_a_read_only_store_file_is_read_not_moved_aside(unprivileged, caplog):
    def body():
        path = unprivileged.dir / "results.sqlite"
        _valid_store(path)
        path.chmod(0o444)
        data = path.read_bytes()
        with caplog.at_level(logging.WARNING, logger="tiered_ops.store.store"):
            store = Store(path)
            store.add([dict(ROW, problem="2")])
        assert [r["problem"] for r in store.rows()] == ["1", "2"]
        assert store.moved_aside is None and store.kept_in_memory == f"{path} cannot be written: the file is read-only"
        assert "kept in memory" in caplog.text and path.read_bytes() == data and not _aside(path)

    unprivileged.run(body)


def _store_with_a_wal(path: Path, with_shm: bool) -> None:
    """A store at ``path`` whose rows are all in its write-ahead log (copied while its writer had it open)."""
    writer = Store(path.with_name("writer.sqlite"))
    writer.add([ROW])
    writer.add([dict(ROW, problem="2")])
    for suffix in ("", "-wal") + (("-shm",) if with_shm else ()):
        shutil.copyfile(str(writer.path) + suffix, str(path) + suffix)
    writer.close()
    assert Path(str(path) + "-wal").stat().st_size > 0


@pytest.mark.parametrize("with_shm", [True, False], ids=["with-shm", "no-shm"])
@pytest.mark.parametrize("locked", [True, False], ids=["read-only-dir", "writable-dir"])
def test_a_read_only_store_with_its_wal_serves_the_rows_in_the_wal(locked, with_shm, unprivileged):
    def body():
        d = unprivileged.dir
        path = d / "results.sqlite"
        _store_with_a_wal(path, with_shm)
        files = {p.name: p.read_bytes() for p in d.iterdir() if p.name.startswith(path.name)}
        for name in files:
            (d / name).chmod(0o444)
        kept = {name: files[name] for name in (path.name, path.name + "-wal")}
        if locked:
            _lock(d)
        store = Store(path)
        assert [r["problem"] for r in store.rows()] == ["1", "2"]  # not an empty store: SQLite's immutable reads miss
        assert store.kept_in_memory == f"{path} cannot be written: the file is read-only"
        store.add([dict(ROW, problem="3")])
        store.close()
        assert {name: (d / name).read_bytes() for name in kept} == kept  # SQLite may add a -shm beside them

    unprivileged.run(body)


def test_a_store_opened_read_only_serves_its_rows_and_keeps_new_ones_in_memory(path, caplog):
    _valid_store(path)
    data = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="tiered_ops.store.store"):
        store = Store(path, read_only=True)
        store.add([dict(ROW, problem="2")])
    assert [r["problem"] for r in store.rows()] == ["1", "2"]
    assert store.kept_in_memory == f"{path} cannot be written: opened read-only on request"
    assert "opened read-only" in caplog.text and "1 new measurement(s) kept in memory only" in caplog.text
    assert path.read_bytes() == data and [r["problem"] for r in Store(path).rows()] == ["1"]


def test_a_damaged_store_that_cannot_be_written_is_a_store_error_not_moved(path):
    path.write_bytes(b"my notes, not a database\n" * 100)
    with pytest.raises(StoreError, match=f"{path}: not an SQLite file; it cannot be moved aside"):
        Store(path, read_only=True)
    assert path.read_bytes() == b"my notes, not a database\n" * 100 and not _aside(path)


SOFTMAX = get_op("softmax")


@pytest.mark.parametrize("how", ["read_only", "chmod"])
def test_a_read_only_store_and_a_new_shape_through_the_op(how, two_softmaxes, tmp_path, request, caplog):
    place = request.getfixturevalue("unprivileged") if how == "chmod" else Unprivileged(tmp_path, None)

    def body():
        path = place.dir / "results.sqlite"
        tiered_ops.use_store(str(path))
        tiered_ops.softmax(torch.randn(4, 8))  # a valid store with a decision for another shape
        tiered_ops.use_store(Store(path, read_only=True) if how == "read_only" else str(_lock(place.dir) / path.name))
        n = len(Store(path, read_only=True).rows())
        x = torch.randn(64, 300)
        with caplog.at_level(logging.WARNING, logger="tiered_ops.store.store"):
            y = tiered_ops.softmax(x)
        torch.testing.assert_close(y, torch.softmax(x, -1))
        assert "kept in memory only" in caplog.text
        kept = sel_mod.get_store().rows()  # measured here (2 implementations; one gated after its timing), in memory
        assert len({r["impl"] for r in kept[n:]}) == 2 and len(kept) > n
        assert len(Store(path, read_only=True).rows()) == n  # the file is as it was

    place.run(body)


def test_model_code_runs_eager_when_no_store_can_be_opened(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERED_OPS_DB", str(tmp_path))  # a directory
    monkeypatch.setattr(sel_mod, "_store", None)  # first use in a new process
    monkeypatch.setattr(sel_mod, "measure_kept", lambda *a, **k: pytest.fail("measured with nowhere to keep it"))
    x = torch.randn(64, 300)
    with caplog.at_level(logging.WARNING, logger="tiered_ops"):
        y = tiered_ops.softmax(x)
    torch.testing.assert_close(y, torch.softmax(x, -1))
    assert f"{tmp_path}: is a directory" in caplog.text and "runs eager" in caplog.text
    assert memo._calls[("softmax", x.shape, x.dtype, -1, -1, False, 0)].name == "eager"
    assert "is a directory" in sel_mod.get_store().unusable


def _newer_schema(path: Path) -> None:
    _valid_store(path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    conn.close()


def _damaged_with_a_wal(path: Path) -> None:
    store = Store(path)
    store.add([dict(ROW, problem=str(i)) for i in range(300)])
    store.close()
    data = bytearray(path.read_bytes())
    data[1024:4096] = bytes(range(256)) * 12  # its schema page and more overwritten
    path.write_bytes(bytes(data))
    Path(str(path) + "-wal").write_bytes(b"junk, not a write-ahead log\n" * 200)


@pytest.mark.parametrize("abuse, why", [(_newer_schema, "schema version 99, newer than this tiered_ops"),
                                        (_damaged_with_a_wal, "SQLite cannot use it")])
def test_model_code_runs_eager_on_a_store_it_cannot_use_and_warns_once(abuse, why, path, monkeypatch, caplog):
    abuse(path)
    monkeypatch.setenv("TIERED_OPS_DB", str(path))
    monkeypatch.setattr(sel_mod, "_store", None)  # first use in a new process
    monkeypatch.setattr(sel_mod, "measure_kept", lambda *a, **k: pytest.fail("measured with nowhere to keep it"))
    with caplog.at_level(logging.WARNING, logger="tiered_ops"):
        for shape in ((64, 300), (8, 16)):
            x = torch.randn(*shape)
            torch.testing.assert_close(tiered_ops.softmax(x, -1), torch.softmax(x, -1))
            assert memo._calls[("softmax", x.shape, x.dtype, -1, -1, False, 0)].name == "eager"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and str(path) in warned[0] and why in warned[0] and "runs eager" in warned[0]
    assert why in sel_mod.get_store().unusable


def test_model_code_runs_eager_when_the_store_fails_while_deciding(two_softmaxes, monkeypatch, caplog):
    def full(rows):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(sel_mod.get_store(), "add", full)
    x = torch.randn(64, 300)
    with caplog.at_level(logging.WARNING, logger="tiered_ops"):
        y = tiered_ops.softmax(x)
    torch.testing.assert_close(y, torch.softmax(x, -1))
    assert "disk is full" in caplog.text
    assert memo._calls[("softmax", x.shape, x.dtype, -1, -1, False, 0)].name == "eager"


# ----------------------------------------------------------------------- failures that were the environment's
@pytest.fixture
def needs_cxx(monkeypatch, tmp_path):
    """softmax with eager, an implementation that raises while no ``c++`` is on PATH (a compile tier without its
    compiler) and one that is wrong (its failure is its own); PATH starts without any compiler."""
    def compiled(x, dim=-1):
        if shutil.which("c++") is None:
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
        return torch.softmax(x, dim)

    impls = {"eager": SOFTMAX.impls["eager"],
             "needs_cxx": Impl("needs_cxx", Tier.COMPILE, compiled, (SOFTMAX.source,)),
             "wrong": Impl("wrong", Tier.TRITON, lambda x, dim=-1: x.clone(), (SOFTMAX.source,))}
    monkeypatch.setattr(SOFTMAX, "impls", impls)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def _install_cxx(bin_dir: Path) -> None:
    cxx = bin_dir / "c++"
    cxx.write_text("#!/bin/sh\n")
    cxx.chmod(0o755)


def test_an_environment_failure_is_measured_again_after_the_environment_changes(needs_cxx, private_store):
    first = tiered_ops.select_backend("softmax", (64, 300), "fp32", "cpu")
    cands = {c["impl"]: c for c in first.record["candidates"]}
    assert cands["needs_cxx"]["ok"] == 0 and "InvalidCxxCompiler" in cands["needs_cxx"]["reason"]
    (failed,) = Store(private_store).rows(impl="needs_cxx")
    assert '"c++":null' in failed["env"]
    assert Store(private_store).rows(impl="wrong")[0]["env"] is None  # a wrong answer is the kernel's own
    n = len(Store(private_store).rows())
    sel_mod.clear_cache()
    tiered_ops.select_backend("softmax", (64, 300), "fp32", "cpu")  # same environment: the failure stands
    assert len(Store(private_store).rows()) == n
    _install_cxx(needs_cxx)
    sel_mod.clear_cache()
    again = tiered_ops.select_backend("softmax", (64, 300), "fp32", "cpu")
    rows = Store(private_store).rows()
    assert {r["impl"] for r in rows[n:]} == {"needs_cxx"}  # measured again, alone
    # it runs now: timed (and gated where the choice would take it over eager, else stored as never chosen)
    assert rows[-1]["env"] is None and rows[-1]["p50_us"] is not None and "raised" not in (rows[-1]["reason"] or "")
    now = {c["impl"]: c for c in again.record["candidates"]}["needs_cxx"]
    assert now["ok"] == 1 or "(never chosen)" in now["reason"], now


def test_a_sweep_measures_again_a_failure_recorded_in_another_environment(needs_cxx, private_store):
    _install_cxx(needs_cxx)
    store, problem, cpu = Store(private_store), SOFTMAX.problem((64, 300)), torch.device("cpu")
    rows = {name: base_row(SOFTMAX, SOFTMAX.impls[name], problem, torch.float32, "fwd_nograd", fingerprint(cpu))
            for name in ("needs_cxx", "wrong")}
    store.add([dict(rows["needs_cxx"], reason="first call raised: InvalidCxxCompiler", env='{"tools":{"c++":null}}'),
               dict(rows["wrong"], reason="wrong output at 64x300")])  # recorded where no compiler was; a wrong one
    sweep([SOFTMAX], {"softmax": [problem]}, [torch.float32], cpu, store, progress=False, log=lambda s: None,
          modes=["fwd_nograd"], cost_metadata=False, impls=["needs_cxx", "wrong"])
    # measured again (timed, then gated: a compile tier's gate runs where a choice would take it) and now correct;
    # the wrong one is not measured again
    new = [(r["impl"], r["ok"]) for r in store.rows()[2:]]
    assert {impl for impl, _ in new} == {"needs_cxx"} and new[-1] == ("needs_cxx", 1), new


@pytest.mark.parametrize("how", ["read_only", "chmod"])
def test_an_old_store_that_cannot_be_written_is_read_migrated_in_memory(how, tmp_path, request):
    """A schema-6 store whose rows have no context, opened read-only (on request, or a read-only file): its copy in
    memory is migrated, its rows read as the eager caller's, the file stays as it was (still schema 6)."""
    from test_store_context import schema_6

    place = request.getfixturevalue("unprivileged") if how == "chmod" else Unprivileged(tmp_path, None)

    def body():
        path = place.dir / "old.sqlite"
        schema_6(str(path), [None, "compiled"])
        data = path.read_bytes()
        if how == "chmod":
            path.chmod(0o444)
        store = Store(path, read_only=how == "read_only")
        assert store.kept_in_memory is not None and store.kept_in_memory.startswith(f"{path} cannot be written")
        assert [(r["impl"], r["context"]) for r in store.rows(context="*")] == [("i0", "eager"), ("i1", "compiled")]
        assert [r["impl"] for r in store.latest("x", "[1]", "fp32", "d", "fwd")] == ["i0"]
        store.add([dict(ROW, problem="2")])  # kept in memory, its context the eager caller's
        assert store.rows(problem="2")[0]["context"] == "eager"
        store.close()
        assert path.read_bytes() == data
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "6"
        con.close()

    place.run(body)
