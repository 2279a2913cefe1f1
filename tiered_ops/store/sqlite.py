"""The SQLite side of the store (the default): one file, WAL mode, what is done with a file at the path that is not a
usable store, and a valid store that cannot be written.

A path that cannot hold a store (a directory, a place that cannot be created) raises ``StoreError`` naming the path
and what is wrong. A file there that is not a usable store (not SQLite, damaged, another program's database) is moved
aside with a warning naming both paths, never overwritten. A valid store that cannot be written (read-only file,
directory or file system) is read into memory with a logged warning: decisions are served from it, new measurements
are kept in memory only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import tempfile
import time
import urllib.parse
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("tiered_ops.store")

SQLITE_MAGIC = b"SQLite format 3\x00"
_OPEN: weakref.WeakSet = weakref.WeakSet()  # the SQLite stores open in this process


class StoreWarning(UserWarning):
    """The file at the store path was not a usable tiered_ops store and was moved aside."""


class StoreError(OSError):
    """Nothing usable can be opened at the store path, or the store's server failed; the message names the path
    (a PostgreSQL URL without its password) and what is wrong."""


class SQLite:
    """How the store speaks SQLite: ``?`` parameters, its catalog, its busy errors."""

    name = "sqlite"
    id_column = "id INTEGER PRIMARY KEY"
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)

    @staticmethod
    def ddl(sql: str) -> str:
        return sql

    @staticmethod
    def execute(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> Any:
        return conn.execute(sql, params)

    @staticmethod
    def executemany(conn: sqlite3.Connection, sql: str, data: list[tuple]) -> None:
        conn.executemany(sql, data)

    @staticmethod
    @contextlib.contextmanager
    def transaction(conn: sqlite3.Connection) -> Iterator[None]:
        with conn:
            yield

    @staticmethod
    def lock_schema(conn: sqlite3.Connection) -> None:
        """Take the write lock now (``BEGIN IMMEDIATE``): a migration reads the schema version under it, and its
        statements (DDL included, which Python's sqlite3 would otherwise run outside a transaction) commit as one,
        so a second process opening the same old store waits, then finds it migrated."""
        conn.execute("BEGIN IMMEDIATE")

    @staticmethod
    def tables(conn: sqlite3.Connection) -> set[str]:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}

    @staticmethod
    def columns(conn: sqlite3.Connection, table: str) -> set[str]:
        return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}

    @staticmethod
    def busy(e: BaseException) -> bool:
        return isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e))


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection to ``path``; ``immutable`` where SQLite cannot create the WAL index beside it (a
    read-only directory), which reads the file as it is without locking."""
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=30.0)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError as e:
        conn.close()
        if "locked" in str(e) or "busy" in str(e):
            raise
    wal = Path(str(path) + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        return _read_with_wal(path, wal)  # ``immutable`` would not see the transactions in the WAL
    return sqlite3.connect(uri + "&immutable=1", uri=True)


def _read_with_wal(path: Path, wal: Path) -> sqlite3.Connection:
    """An in-memory copy of the store at ``path`` with the transactions of its write-ahead log ``wal``: both files
    copied into a private temporary directory, where SQLite can build the WAL index it cannot build beside them."""
    try:
        with tempfile.TemporaryDirectory(prefix="tiered_ops_store_") as tmp:
            copy = Path(tmp) / path.name
            shutil.copyfile(path, copy)
            shutil.copyfile(wal, str(copy) + "-wal")
            disk = sqlite3.connect(copy)
            try:
                mem = sqlite3.connect(":memory:")
                disk.backup(mem)
            finally:
                disk.close()
    except OSError as e:
        raise sqlite3.OperationalError(f"cannot read it with its write-ahead log {wal}: {e}") from e
    return mem


def unusable(path: Path, read_only: bool = False) -> str | None:
    """Why the existing file at ``path`` cannot be opened as a tiered_ops store, or None (absent/empty/ours).

    Damage is only believed when three checks a second apart all report it, and a store with a non-empty WAL
    (another process is writing it) is not judged at all: a store in use is never moved aside for what one look
    at a moving WAL showed (SQLite 3.40 readers saw "malformed" for a moment while two processes wrote).
    ``read_only``: look through a read-only connection (a store that cannot be written)."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    if any(s.path.resolve() == path.resolve() and s.conn is not None and s.kept_in_memory is None
           for s in list(_OPEN)):
        # Ours, open in this process. Reading it here with open() and closing that descriptor would drop every
        # POSIX lock this process holds on it (SQLite's own connections included): another process then takes
        # the WAL for unused, checkpoints and resets it under us, and this process reads "malformed".
        return None
    with open(path, "rb") as f:
        if f.read(16) != SQLITE_MAGIC:
            return "not an SQLite file"
    wal = Path(str(path) + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        return None  # in use by another process (or to be recovered by SQLite on open): not judged from outside
    why = None
    for attempt in range(3):
        try:
            conn = connect_read_only(path) if read_only else sqlite3.connect(path, timeout=30.0)
            try:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if tables and "measurements" not in tables:
                    return f"an SQLite database of something else (tables: {', '.join(sorted(tables))})"
                ok = conn.execute("PRAGMA quick_check").fetchone()[0]
                why = None if ok == "ok" else f"SQLite reports damage: {ok}"
            finally:
                conn.close()
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                return None  # another process holds it: a store in use, not a damaged one
            why = f"SQLite cannot read it: {e}"
        except sqlite3.DatabaseError as e:
            why = f"SQLite cannot read it: {e}"
        if why is None:
            return None
        time.sleep(1.0)
    return why


def move_aside(path: Path, why: str) -> Path:
    aside = path.with_name(f"{path.name}.unusable-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(path) + suffix)
        if src.exists():
            src.rename(Path(str(aside) + suffix))
    warnings.warn(f"tiered_ops store {path}: {why}; moved it to {aside} and started an empty store", StoreWarning,
                  stacklevel=5)
    return aside


def not_writable(path: Path) -> str | None:
    """Why a store at ``path`` cannot be written here (SQLite's WAL needs the file and files beside it), or None.
    Raises StoreError where no store can be at ``path`` at all (a directory, a file where a directory must be)."""
    if path.is_dir():
        raise StoreError(f"tiered_ops store {path}: is a directory, expected the path of a file (for example "
                         f"{path / 'results.sqlite'}): set TIERED_OPS_DB or --db to a file path")
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise StoreError(f"tiered_ops store {path}: {where} is a file, not a directory")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        if not os.access(path, os.R_OK):
            raise StoreError(f"tiered_ops store {path}: the file cannot be read (permissions)")
        return "the file is read-only"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"directory {where} is not writable"
    return None


def open_file(store: Any, why_ro: str | None) -> sqlite3.Connection:
    """A connection to ``store.path`` (``why_ro`` None), or to an in-memory copy of it when it cannot be written
    (``why_ro`` says why; sets ``store.kept_in_memory``). Sets ``store.moved_aside`` when an unusable file was moved
    aside."""
    path = store.path
    if why_ro is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            why = unusable(path)
            store.moved_aside = move_aside(path, why) if why else None
            return sqlite3.connect(path, timeout=30.0)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"tiered_ops store {path}: cannot be opened or created there: {e}") from e
    if not path.exists() or path.stat().st_size == 0:
        raise StoreError(f"tiered_ops store {path}: no store there and none can be created: {why_ro}")
    why = unusable(path, read_only=True)
    if why:
        raise StoreError(f"tiered_ops store {path}: {why}; it cannot be moved aside or replaced: {why_ro}")
    try:
        disk = connect_read_only(path)
        try:
            mem = sqlite3.connect(":memory:")
            disk.backup(mem)
        finally:
            disk.close()
    except sqlite3.Error as e:
        raise StoreError(f"tiered_ops store {path}: cannot be read ({why_ro}): {e}") from e
    store.kept_in_memory = f"{path} cannot be written: {why_ro}"
    log.warning("tiered_ops store %s cannot be written (%s): opened read-only; decisions are served from it and "
                "new measurements are kept in memory for this process only", path, why_ro)
    return mem


def connect(store: Any, path: str | Path, read_only: bool) -> sqlite3.Connection:
    """The connection of a new SQLite store at ``path`` (``":memory:"``: an empty store in memory); registers it."""
    if str(path) == ":memory:":
        store.kept_in_memory = "an in-memory store"
        conn = sqlite3.connect(":memory:")
    else:
        conn = open_file(store, "opened read-only on request" if read_only else not_writable(store.path))
    _OPEN.add(store)
    return conn


def setup(store: Any) -> None:
    """Row access by name, WAL mode for a file, then the schema (``store._init_schema``). A file system that refuses
    writes ``os.access`` did not see is read into memory instead."""
    try:
        _setup(store)
    except sqlite3.DatabaseError as e:
        hint = _wal_hint(store.path)  # before closing: SQLite may delete a WAL it cannot read on close
        store.conn.close()
        if not isinstance(e, sqlite3.OperationalError) or "readonly" not in str(e) or store.kept_in_memory is not None:
            raise StoreError(f"tiered_ops store {store.path}: SQLite cannot use it: {e}{hint}") from e
        store.conn = open_file(store, f"SQLite says: {e}")
        try:
            _setup(store)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"tiered_ops store {store.path}: SQLite cannot use it: {e}") from e


def _wal_hint(path: Any) -> str:
    """What to do with a store SQLite cannot use that was not judged (its WAL may belong to a running writer)."""
    if str(path) == ":memory:" or not Path(str(path) + "-wal").exists():
        return ""
    return (f" (a store with a write-ahead log is never moved aside while another process may be writing it: when "
            f"none is, move {path} and its -wal/-shm files aside, or set TIERED_OPS_DB or --db to another path)")


def _setup(store: Any) -> None:
    store.conn.row_factory = sqlite3.Row
    if store.kept_in_memory is None:
        store._retry(lambda: store.conn.execute("PRAGMA journal_mode=WAL"))
    store._retry(store._init_schema)
