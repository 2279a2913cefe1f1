"""The store under abuse: foreign and damaged files at its path, two processes writing at once."""

import sqlite3
import subprocess
import sys
import textwrap

import pytest

from tiered_ops.store import Store, StoreWarning

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


def test_two_processes_writing_at_once_lose_nothing(path):
    code = textwrap.dedent(f"""
        import sys
        from tiered_ops.store import Store
        store = Store({str(path)!r})
        row = {ROW!r}
        for i in range(150):
            store.add([dict(row, problem=sys.argv[1] + str(i))])
    """)
    Store(path).close()
    procs = [subprocess.Popen([sys.executable, "-c", code, tag]) for tag in ("a", "b")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    problems = {r["problem"] for r in Store(path).rows()}
    assert len(problems) == 300


def test_a_schema_2_store_is_migrated_in_place_and_keeps_its_rows(path):
    """A store written before the host spread existed (schema 2) opens with the new columns (empty in old rows),
    its rows intact, and rows come back in the declared column order whatever order the table has."""
    from tiered_ops.store import COLUMN_NAMES, COLUMNS

    old = [(n, t) for n, t in COLUMNS if n not in ("host_p20_us", "host_p80_us")]
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
    assert store.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "3"
