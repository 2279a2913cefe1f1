"""The measurement store: one SQLite file (stdlib sqlite3) holding every measurement ever taken.

Path: ``$TIERED_OPS_DB`` if set, else ``$XDG_CACHE_HOME/tiered_ops/results.sqlite`` (``~/.cache`` when
unset); the CLI's ``--db`` overrides both. Every write is one transaction. Decisions are not stored
separately: they are derived from the freshest measurement of each implementation, so a decision can
never disagree with the data it came from. A row whose ``source_hash`` differs from the current source
of its implementation is stale and ignored, and so is a failed row whose recorded build environment (``env``,
``tiered_ops.environment``) is not this process's.

A path that cannot hold a store (a directory, a place that cannot be created) raises ``StoreError`` naming the
path and what is wrong. A valid store that cannot be written (read-only file, directory or file system) is read
into memory with a logged warning: decisions are served from it, new measurements are kept in memory only.
Sweeps sharing one store claim each candidate before measuring it (the ``claims`` table), so none is measured
twice; a claim expires at its deadline, or at once when its owner is a dead process of this host.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import time
import urllib.parse
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4

# Explicit migrations: MIGRATIONS[v] takes a store at version v to v + 1.
MIGRATIONS: dict[int, list[str]] = {
    1: ["CREATE TABLE IF NOT EXISTS impl_meta (op TEXT NOT NULL, impl TEXT NOT NULL, device_key TEXT NOT NULL, "
        "source_hash TEXT NOT NULL, meta TEXT NOT NULL, timestamp REAL NOT NULL, "
        "PRIMARY KEY (op, impl, device_key, source_hash))"],
    # 3: the host time's p20-p80 (a decision where the launch path sets the time needs the host's noise).
    2: ["ALTER TABLE measurements ADD COLUMN host_p20_us REAL", "ALTER TABLE measurements ADD COLUMN host_p80_us REAL"],
    # 4: the build environment of a failure that may be the environment's, and the claims of concurrent sweeps.
    3: ["ALTER TABLE measurements ADD COLUMN env TEXT",
        "CREATE TABLE IF NOT EXISTS claims (op TEXT NOT NULL, impl TEXT NOT NULL, problem TEXT NOT NULL, "
        "dtype TEXT NOT NULL, mode TEXT NOT NULL, device_key TEXT NOT NULL, source_hash TEXT NOT NULL, "
        "owner_host TEXT NOT NULL, owner_pid INTEGER NOT NULL, owner_token TEXT NOT NULL, timestamp REAL NOT NULL, "
        "expires REAL NOT NULL, PRIMARY KEY (op, impl, problem, dtype, mode, device_key, source_hash))"],
}
# What one claim is for: a candidate measurement (one row of ``measurements``).
CLAIM_KEY = ("op", "impl", "problem", "dtype", "mode", "device_key", "source_hash")

COLUMNS: list[tuple[str, str]] = [
    ("op", "TEXT NOT NULL"),
    ("impl", "TEXT NOT NULL"),
    ("tier", "TEXT NOT NULL"),
    ("mode", "TEXT NOT NULL"),
    ("problem", "TEXT NOT NULL"),
    ("bucket", "TEXT NOT NULL"),
    ("dtype", "TEXT NOT NULL"),
    ("device_key", "TEXT NOT NULL"),
    ("device_type", "TEXT"),
    ("gpu_name", "TEXT"),
    ("capability", "TEXT"),
    ("sm_count", "INTEGER"),
    ("torch_version", "TEXT"),
    ("triton_version", "TEXT"),
    ("cuda_version", "TEXT"),
    ("p20_us", "REAL"),
    ("p50_us", "REAL"),
    ("p80_us", "REAL"),
    ("host_us", "REAL"),
    ("host_p20_us", "REAL"),
    ("host_p80_us", "REAL"),
    ("caller_us", "REAL"),
    ("gbps", "REAL"),
    ("copy_gbps", "REAL"),
    ("frac_copy", "REAL"),
    ("rel_error", "REAL"),
    ("ok", "INTEGER NOT NULL"),
    ("reason", "TEXT"),
    ("first_call_s", "REAL"),
    ("source_hash", "TEXT NOT NULL"),
    ("timestamp", "REAL NOT NULL"),
    ("env", "TEXT"),
]
COLUMN_NAMES = [c for c, _ in COLUMNS]


def default_path() -> Path:
    env = os.environ.get("TIERED_OPS_DB")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tiered_ops" / "results.sqlite"


SQLITE_MAGIC = b"SQLite format 3\x00"


_OPEN: weakref.WeakSet = weakref.WeakSet()  # the stores open in this process


class StoreWarning(UserWarning):
    """The file at the store path was not a usable tiered_ops store and was moved aside."""


class StoreError(OSError):
    """Nothing usable can be opened at the store path; the message names the path and what is wrong."""


STORE_ERRORS = (StoreError, sqlite3.Error)  # what a failing store raises


def _connect_read_only(path: Path) -> sqlite3.Connection:
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
    return sqlite3.connect(uri + "&immutable=1", uri=True)


def _unusable(path: Path, read_only: bool = False) -> str | None:
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
            conn = _connect_read_only(path) if read_only else sqlite3.connect(path, timeout=30.0)
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


def _move_aside(path: Path, why: str) -> Path:
    aside = path.with_name(f"{path.name}.unusable-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(path) + suffix)
        if src.exists():
            src.rename(Path(str(aside) + suffix))
    import warnings

    warnings.warn(f"tiered_ops store {path}: {why}; moved it to {aside} and started an empty store", StoreWarning,
                  stacklevel=4)
    return aside


def _not_writable(path: Path) -> str | None:
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


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Store:
    """The store at ``path`` (``":memory:"``: an empty store in memory). A file there that is not a usable store
    (not SQLite, damaged, another program's database) is moved aside with a warning naming both paths, never
    overwritten and never crashed on. Writes retry while another process holds the lock (WAL mode, so readers
    never block). A valid store that cannot be written (or ``read_only``) is read into memory, with a logged
    warning: ``kept_in_memory`` says why new measurements are not saved to ``path``. A path where no store can be
    opened raises StoreError."""

    RETRIES = 5

    def __init__(self, path: str | Path | None = None, read_only: bool = False) -> None:
        self.path = Path(path).expanduser() if path else default_path()
        self.moved_aside: Path | None = None
        self.kept_in_memory: str | None = None  # why measurements added now are not saved to ``path``
        self.unusable: str | None = None  # set by ``open_store``: why ``path`` could not be opened at all
        self.owner = (socket.gethostname(), os.getpid(), uuid.uuid4().hex[:16])  # of this store's claims
        self._unsaved, self._claimed = 0, False
        self.conn: sqlite3.Connection | None = None
        if str(path) == ":memory:":
            self.kept_in_memory = "an in-memory store"
            self.conn = sqlite3.connect(":memory:")
        else:
            self.conn = self._open("opened read-only on request" if read_only else _not_writable(self.path))
        _OPEN.add(self)
        try:
            self._setup()
        except sqlite3.OperationalError as e:
            self.conn.close()
            if "readonly" not in str(e) or self.kept_in_memory is not None:
                raise StoreError(f"tiered_ops store {self.path}: SQLite cannot use it: {e}") from e
            self.conn = self._open(f"SQLite says: {e}")  # a file system that refuses writes os.access did not see
            self._setup()

    def _setup(self) -> None:
        self.conn.row_factory = sqlite3.Row
        if self.kept_in_memory is None:
            self._retry(lambda: self.conn.execute("PRAGMA journal_mode=WAL"))
        self._retry(self._init_schema)

    def _open(self, why_ro: str | None) -> sqlite3.Connection:
        """A connection to the file (``why_ro`` None), or to an in-memory copy of it when it cannot be written."""
        path = self.path
        if why_ro is None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                why = _unusable(path)
                self.moved_aside = _move_aside(path, why) if why else None
                return sqlite3.connect(path, timeout=30.0)
            except (OSError, sqlite3.Error) as e:
                raise StoreError(f"tiered_ops store {path}: cannot be opened or created there: {e}") from e
        if not path.exists() or path.stat().st_size == 0:
            raise StoreError(f"tiered_ops store {path}: no store there and none can be created: {why_ro}")
        why = _unusable(path, read_only=True)
        if why:
            raise StoreError(f"tiered_ops store {path}: {why}; it cannot be moved aside or replaced: {why_ro}")
        try:
            disk = _connect_read_only(path)
            try:
                mem = sqlite3.connect(":memory:")
                disk.backup(mem)
            finally:
                disk.close()
        except sqlite3.Error as e:
            raise StoreError(f"tiered_ops store {path}: cannot be read ({why_ro}): {e}") from e
        self.kept_in_memory = f"{path} cannot be written: {why_ro}"
        log.warning("tiered_ops store %s cannot be written (%s): opened read-only; decisions are served from it and "
                    "new measurements are kept in memory for this process only", path, why_ro)
        return mem

    def _retry(self, fn: Any) -> Any:
        """Run ``fn`` again while SQLite says another writer holds the database (beyond the 30 s busy timeout)."""
        for attempt in range(self.RETRIES):
            try:
                return fn()
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e):
                    raise
                if attempt == self.RETRIES - 1:
                    raise sqlite3.OperationalError(
                        f"tiered_ops store {self.path}: {e} for {self.RETRIES} x 30 s; another process holds "
                        "it (a stuck sweep?), or the file system does not support SQLite's locks"
                    ) from e
                time.sleep(min(0.05 * 2**attempt, 2.0))

    def _init_schema(self) -> None:
        """Create or migrate the schema; a store that is already current is only read (no write on open)."""
        tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "meta" in tables:
            row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is not None and int(row[0]) == SCHEMA_VERSION and "measurements" in tables:
                return
        with self.conn:
            self.conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            cols = ", ".join(f"{n} {t}" for n, t in COLUMNS)
            self.conn.execute(f"CREATE TABLE IF NOT EXISTS measurements (id INTEGER PRIMARY KEY, {cols})")
            self.conn.execute(
                "CREATE INDEX IF NOT EXISTS m_lookup ON measurements (op, bucket, dtype, device_key, mode)"
            )
            row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            version = 1 if row is None else int(row[0])
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"store {self.path} has schema version {version}, newer than this tiered_ops "
                    f"({SCHEMA_VERSION}): upgrade tiered_ops or point TIERED_OPS_DB elsewhere"
                )
            have = {r[1] for r in self.conn.execute("PRAGMA table_info(measurements)")}
            for v in range(version, SCHEMA_VERSION):
                for stmt in MIGRATIONS[v]:
                    added = stmt.split("ADD COLUMN ")[1].split()[0] if "ADD COLUMN " in stmt else None
                    if added not in have:  # a new store's table was created with every column already
                        self.conn.execute(stmt)
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Insert measurements in one transaction (all or none)."""
        ph = ", ".join("?" for _ in COLUMN_NAMES)
        data = [tuple(r.get(c) if c != "timestamp" else r.get(c, time.time()) for c in COLUMN_NAMES) for r in rows]

        def write() -> None:
            with self.conn:
                self.conn.executemany(f"INSERT INTO measurements ({', '.join(COLUMN_NAMES)}) VALUES ({ph})", data)

        self._retry(write)
        if self.kept_in_memory is not None and data and self.unusable is None:
            self._unsaved += len(data)
            (log.warning if self._unsaved == len(data) else log.info)(
                "tiered_ops store %s: %d new measurement(s) kept in memory only, not saved (%s)", self.path,
                self._unsaved, self.kept_in_memory)

    def latest(self, op: str, bucket: str, dtype: str, device_key: str, mode: str) -> list[dict]:
        """Newest row per implementation for one decision key (fresh or stale: the caller filters)."""
        cur = self.conn.execute(
            "SELECT * FROM measurements WHERE id IN (SELECT MAX(id) FROM measurements "
            "WHERE op=? AND bucket=? AND dtype=? AND device_key=? AND mode=? GROUP BY impl)",
            (op, bucket, dtype, device_key, mode),
        )
        return [dict(r) for r in cur.fetchall()]

    def buckets(self, op: str, dtype: str, device_key: str, mode: str) -> list[str]:
        """Every bucket with a stored measurement for (op, dtype, device, mode)."""
        cur = self.conn.execute("SELECT DISTINCT bucket FROM measurements WHERE op=? AND dtype=? AND device_key=? "
                                "AND mode=? ORDER BY bucket", (op, dtype, device_key, mode))
        return [r[0] for r in cur.fetchall()]

    def rows(self, **where: Any) -> list[dict]:
        """Rows with their columns in ``COLUMN_NAMES`` order (a migrated store has added columns last)."""
        cond = " AND ".join(f"{k}=?" for k in where) or "1=1"
        cur = self.conn.execute(f"SELECT id, {', '.join(COLUMN_NAMES)} FROM measurements WHERE {cond} ORDER BY id",
                                tuple(where.values()))
        return [dict(r) for r in cur.fetchall()]

    def put_meta(self, op: str, impl: str, device_key: str, source_hash: str, meta: dict[str, Any]) -> None:
        """Store an implementation's cost metadata (graph breaks, LOC, build, registers), replacing older."""
        def write() -> None:
            with self.conn:
                self.conn.execute("INSERT OR REPLACE INTO impl_meta VALUES (?, ?, ?, ?, ?, ?)",
                                  (op, impl, device_key, source_hash, json.dumps(meta, default=str), time.time()))

        self._retry(write)

    def get_meta(self, op: str, impl: str, device_key: str, source_hash: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT meta FROM impl_meta WHERE op=? AND impl=? AND device_key=? AND source_hash=?",
                                (op, impl, device_key, source_hash)).fetchone()
        return json.loads(row[0]) if row else None

    def claim(self, key: tuple[str, ...], ttl_s: float) -> bool:
        """Take the claim on one candidate (``CLAIM_KEY`` values) for ``ttl_s`` seconds before measuring it; False
        while another owner holds a live claim on it. A claim is live until its deadline, or until its owner is
        found to be a process of this host that no longer exists. Claiming again renews one's own claim."""
        host, pid, token = self.owner
        where = " AND ".join(f"{k}=?" for k in CLAIM_KEY)
        self._claimed = True

        def take() -> bool:
            with self.conn:
                held = self.conn.execute(f"SELECT owner_host, owner_pid, owner_token FROM claims WHERE {where}",
                                         key).fetchone()
                if held is not None and held[2] != token and held[0] == host and not _alive(held[1]):
                    self.conn.execute(f"DELETE FROM claims WHERE {where} AND owner_token=?", (*key, held[2]))
                now = time.time()
                cur = self.conn.execute(
                    f"INSERT INTO claims VALUES ({', '.join('?' * (len(CLAIM_KEY) + 5))}) "
                    f"ON CONFLICT ({', '.join(CLAIM_KEY)}) DO UPDATE SET owner_host=excluded.owner_host, "
                    "owner_pid=excluded.owner_pid, owner_token=excluded.owner_token, timestamp=excluded.timestamp, "
                    "expires=excluded.expires WHERE claims.expires < excluded.timestamp "
                    "OR claims.owner_token = excluded.owner_token", (*key, host, pid, token, now, now + ttl_s))
                return cur.rowcount == 1

        return self._retry(take)

    def release(self, key: tuple[str, ...] | None = None) -> None:
        """Drop this store's claim on ``key`` (None: every claim it holds)."""
        cond = " AND ".join(f"{k}=?" for k in CLAIM_KEY) + " AND " if key is not None else ""

        def write() -> None:
            with self.conn:
                self.conn.execute(f"DELETE FROM claims WHERE {cond}owner_token=?", (*(key or ()), self.owner[2]))

        self._retry(write)

    def close(self) -> None:
        if self.conn is not None:
            try:
                if self._claimed:
                    self.release()
            except sqlite3.Error as e:  # its claims expire on their own
                log.info("tiered_ops store %s: claims not released on close: %s", self.path, e)
            self.conn.close()
            self.conn = None


def open_store(path: str | Path | None = None) -> Store:
    """The store at ``path`` (None: ``default_path()``), or where none can be opened there, an empty in-memory store
    whose ``unusable`` says why, with a warning in the log: for code that must keep running (model code)."""
    try:
        return Store(path)
    except StoreError as e:
        log.warning("%s; using an empty in-memory store instead (nothing is saved): tiered_ops.<op> runs eager", e)
        store = Store(":memory:")
        store.unusable = store.kept_in_memory = str(e)
        return store
