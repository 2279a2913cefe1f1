"""The measurement store: every measurement ever taken, in SQLite (the default: one file, stdlib sqlite3) or in
PostgreSQL (``TIERED_OPS_DB=postgresql://...``: one store for many machines), behind this one interface. This module,
its schema and migrations (``schema``) and its two backends (``store_sqlite``, ``store_pg``) are the only code of
the package that speaks SQL.

Path: ``$TIERED_OPS_DB`` if set, else ``$XDG_CACHE_HOME/tiered_ops/results.sqlite`` (``~/.cache`` when
unset); the CLI's ``--db`` overrides both. Every write is one transaction. Decisions are not stored
separately: they are derived from the freshest measurement of each implementation, so a decision can
never disagree with the data it came from. A row whose ``source_hash`` differs from the current source
of its implementation is stale and ignored, and so is a row measured with another measurement method (``method``,
``tiered_ops.method``) and a failed row whose recorded build environment (``env``, ``tiered_ops.environment``) is
not this process's. ``origin`` says where a row came from when it was not measured into this store (``pack:<file>``:
imported from a decision pack, ``tiered_ops.packs``).

Sweeps sharing one store claim each candidate before measuring it (the ``claims`` table), so none is measured
twice; a claim expires at its deadline, or at once when its owner is a dead process of this host. What happens with
paths where no store can be, foreign or damaged files and stores that cannot be written: ``store_sqlite``.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import sqlite3
import time
import uuid
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from .. import envs
from ..method import CONTEXT_METHODS, METHOD_VERSION
from ..registry import CONTEXTS, Context, check_context
from . import pg as store_pg
from . import sqlite as store_sqlite
from .schema import (  # noqa: F401  (the schema, imported from here)
    CLAIM_KEY,
    COLUMN_NAMES,
    COLUMNS,
    EDGE_KEY,
    LOOKUP_INDEX,
    MIGRATIONS,
    ROW_KEY,
    SCHEMA_VERSION,
    TABLES,
)
from .sqlite import StoreError, StoreWarning  # noqa: F401  (the store's errors, imported from here)

log = logging.getLogger(__name__)


STORE_ERRORS = (StoreError, sqlite3.Error)  # what a failing store raises (PostgreSQL's errors become StoreErrors)


def default_path() -> Path | str:
    """``$TIERED_OPS_DB`` (a path, or a ``postgresql://`` URL kept as text), else the per-user SQLite file."""
    env = envs.db()
    if env:
        return env if store_pg.is_url(env) else Path(env).expanduser()
    return envs.cache_dir() / "results.sqlite"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _value(v: Any) -> Any:
    """A value both backends take: bools as 0/1, numpy scalars as Python numbers, NaN as NULL, an enum member (a
    ``Context``) as its value."""
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, bool):
        return int(v)
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    return None if isinstance(v, float) and v != v else v


# A context's text -> its ``Context`` (a member hashes and compares as its text, so it finds itself): a known context is
# read here, where every query and row names one; ``check_context`` answers for anything else (its error).
_KNOWN: Mapping[str, Context] = MappingProxyType({c.value: c for c in CONTEXTS})


def _context(context: Any, what: str = "context") -> Context:
    """``registry.check_context(context, what)``, a known context looked up rather than asked for."""
    try:
        known = _KNOWN.get(context)
    except TypeError:  # unhashable: not a context
        known = None
    return known if known is not None else check_context(context, what)


def _with_context(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its context checked and as text: a row without one (or None, NaN: from a results file or pack
    of a store before contexts) is an eager caller's."""
    ctx = _value(row.get("context"))
    return {**row, "context": _context(Context.EAGER if ctx is None else ctx, "a row's context").value}


class Store:
    """The store at ``path``: a file path (SQLite; ``":memory:"``: an empty store in memory) or a ``postgresql://``
    URL. A SQLite file there that is not a usable store is moved aside with a warning naming both paths, never
    overwritten and never crashed on. Writes retry while another writer holds the lock (SQLite's WAL mode, so
    readers never block) or the server asks for a retry (PostgreSQL). A valid SQLite store that cannot be written
    (or ``read_only``) is read into memory, with a logged warning: ``kept_in_memory`` says why new measurements are
    not saved to ``path``. A path where no store can be opened raises StoreError."""

    RETRIES = 5

    def __init__(self, path: str | Path | None = None, read_only: bool = False) -> None:
        target = path if path else default_path()
        self.moved_aside: Path | None = None
        self.kept_in_memory: str | None = None  # why measurements added now are not saved to ``path``
        self.unusable: str | None = None  # set by ``open_store``: why ``path`` could not be opened at all
        self.owner = (socket.gethostname(), os.getpid(), uuid.uuid4().hex[:16])  # of this store's claims
        self._unsaved, self._claimed = 0, False
        self.conn: Any = None
        if store_pg.is_url(str(target)):
            if read_only:
                raise ValueError("read_only: a PostgreSQL store is opened read-write (give its role read-only "
                                 "rights instead)")
            self.url, self.path = str(target), store_pg.shown(str(target))
            self.dialect: Any = store_pg.PostgreSQL(self.url)
            self.conn = store_pg.connect(self.url)
            self._retry(self._init_schema)
            return
        self.url, self.dialect = None, store_sqlite.SQLite
        self.path = Path(target).expanduser() if str(target) != ":memory:" else Path(":memory:")
        self.conn = store_sqlite.connect(self, target, read_only)
        store_sqlite.setup(self)

    @property
    def backend(self) -> str:
        return self.dialect.name

    @property
    def writable(self) -> bool:
        """Whether measurements added now are saved at ``path``; False for a store read into memory (a read-only file
        or directory, ``read_only``, ``":memory:"``, or an unusable path): ``kept_in_memory`` says why."""
        return self.kept_in_memory is None

    @property
    def unsaved(self) -> int:
        """How many measurements were added to this store and not saved at ``path`` (see ``writable``)."""
        return self._unsaved

    def _exec(self, sql: str, params: tuple = ()) -> Any:
        return self.dialect.execute(self.conn, sql, params)

    def _retry(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` again while another writer holds the database (SQLite, beyond its 30 s busy timeout) or the
        server reports a serialization failure or deadlock (PostgreSQL)."""
        for attempt in range(self.RETRIES):
            try:
                return fn()
            except self.dialect.errors as e:
                if not self.dialect.busy(e):
                    raise
                if attempt == self.RETRIES - 1:
                    raise StoreError(
                        f"tiered_ops store {self.path}: {e} for {self.RETRIES} tries; another process holds "
                        "it (a stuck sweep?), or the file system does not support SQLite's locks"
                    ) from e
                time.sleep(min(0.05 * 2**attempt, 2.0))

    def _write(self, fn: Callable[[], Any]) -> Any:
        """``fn`` in one transaction (all or none), retried while the database is busy."""
        def tx() -> Any:
            with self.dialect.transaction(self.conn):
                return fn()

        return self._retry(tx)

    def _init_schema(self) -> None:
        """Create or migrate the schema; a store that is already current is only read (no write on open)."""
        d = self.dialect
        tables = d.tables(self.conn)
        if "meta" in tables and "measurements" in tables and self._version() == SCHEMA_VERSION:
            return
        with d.transaction(self.conn):
            d.lock_schema(self.conn)
            self._exec("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            cols = ", ".join(f"{n} {t}" for n, t in COLUMNS)
            self._exec(d.ddl(f"CREATE TABLE IF NOT EXISTS measurements ({d.id_column}, {cols})"))
            self._exec(LOOKUP_INDEX)
            version = self._version() or 1
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"tiered_ops store {self.path}: schema version {version}, newer than this tiered_ops "
                    f"({SCHEMA_VERSION}): upgrade tiered_ops or point TIERED_OPS_DB (or --db) elsewhere"
                )
            have = d.columns(self.conn, "measurements")
            for v in range(version, SCHEMA_VERSION):
                for step in MIGRATIONS[v]:
                    if callable(step):
                        step(self)
                        continue
                    added = step.split("ADD COLUMN ")[1].split()[0] if "ADD COLUMN " in step else None
                    if added not in have:  # a new store's table was created with every column already
                        self._exec(d.ddl(step))
            self._exec("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (key) DO UPDATE SET "
                       "value = excluded.value", (str(SCHEMA_VERSION),))

    def _version(self) -> int | None:
        row = self._exec("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return None if row is None else int(row["value"])

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Insert measurements in one transaction (all or none). A row without ``method`` was measured by this
        process: it gets the current method of its context (``CONTEXT_METHODS``); one without ``context`` (or None)
        is an eager caller's."""
        ph = ", ".join("?" for _ in COLUMN_NAMES)
        now = time.time()

        def values(r: dict[str, Any]) -> tuple:
            defaults = {"timestamp": now, "method": CONTEXT_METHODS.get(r["context"], METHOD_VERSION)}
            return tuple(_value(r.get(c, defaults.get(c))) for c in COLUMN_NAMES)

        data = [values(r) for r in map(_with_context, rows)]
        sql = f"INSERT INTO measurements ({', '.join(COLUMN_NAMES)}) VALUES ({ph})"
        self._write(lambda: self.dialect.executemany(self.conn, sql, data))
        if self.kept_in_memory is not None and data:
            self._unsaved += len(data)
        if self.kept_in_memory is not None and data and self.unusable is None:
            (log.warning if self._unsaved == len(data) else log.info)(
                "tiered_ops store %s: %d new measurement(s) kept in memory only, not saved (%s)", self.path,
                self._unsaved, self.kept_in_memory)

    def merge(self, rows: Iterable[dict[str, Any]]) -> int:
        """Add the rows not already stored (equal ``ROW_KEY`` columns: measured once, wherever it was stored), in one
        transaction; returns how many were added. Rows keep their own ``method`` and ``origin``."""
        rows = [{**_with_context(r), "method": r.get("method"), "origin": r.get("origin")} for r in rows]
        where = " AND ".join(f"{k}=?" for k in ROW_KEY)
        ph = ", ".join("?" for _ in COLUMN_NAMES)
        sql = f"INSERT INTO measurements ({', '.join(COLUMN_NAMES)}) VALUES ({ph})"

        def write() -> int:
            added = 0
            for r in rows:
                if self._exec(f"SELECT id FROM measurements WHERE {where}",
                              tuple(_value(r.get(k)) for k in ROW_KEY)).fetchone() is None:
                    self._exec(sql, tuple(_value(r.get(c)) for c in COLUMN_NAMES))
                    added += 1
            return added

        return self._write(write)

    def latest(self, op: str, bucket: str, dtype: str, device_key: str, mode: str,
               context: Context | str = Context.EAGER) -> list[dict]:
        """Newest row per implementation for one decision key (fresh or stale: the caller filters); ``context``: rows
        measured as that caller runs the op."""
        cur = self._exec(
            "SELECT * FROM measurements WHERE id IN (SELECT MAX(id) FROM measurements "
            "WHERE op=? AND bucket=? AND dtype=? AND device_key=? AND mode=? AND context=? GROUP BY impl)",
            (op, bucket, dtype, device_key, mode, _context(context).value),
        )
        return [dict(r) for r in cur.fetchall()]

    def buckets(self, op: str, dtype: str, device_key: str, mode: str, context: Context | str = Context.EAGER
                ) -> list[str]:
        """Every bucket with a stored measurement for (op, dtype, device, mode, context)."""
        cur = self._exec("SELECT DISTINCT bucket FROM measurements WHERE op=? AND dtype=? AND device_key=? "
                         "AND mode=? AND context=? ORDER BY bucket",
                         (op, dtype, device_key, mode, _context(context).value))
        return [r["bucket"] for r in cur.fetchall()]

    def rows(self, **where: Any) -> list[dict]:
        """Rows with their columns in ``COLUMN_NAMES`` order (a migrated store has added columns last). Only an
        eager caller's rows unless ``context`` names another (``context="*"``: every row)."""
        bad = [k for k in where if k not in COLUMN_NAMES and k != "id"]
        if bad:
            raise ValueError(f"rows: no column named {', '.join(bad)}; columns: {', '.join(COLUMN_NAMES)}")
        context = where.pop("context", Context.EAGER)
        conds = [f"{k}=?" for k in where] + ([] if context == "*" else ["context=?"])
        params = tuple(_value(v) for v in where.values()) + (() if context == "*" else (_context(context).value,))
        cur = self._exec(f"SELECT id, {', '.join(COLUMN_NAMES)} FROM measurements WHERE {' AND '.join(conds) or '1=1'} "
                         "ORDER BY id", params)
        return [dict(r) for r in cur.fetchall()]

    def shortest_kernel(self, device_key: str) -> float | None:
        """The shortest median kernel time of a correct measurement on this device, any op (a launch's latency there),
        or None where it has none."""
        row = self._exec("SELECT MIN(p50_us) AS us FROM measurements WHERE device_key=? AND ok=1 AND p50_us > 0",
                         (device_key,)).fetchone()
        return None if row is None or row["us"] is None else float(row["us"])

    def count(self, table: str = "measurements") -> int:
        """How many rows ``table`` holds (one of ``TABLES``)."""
        if table not in TABLES:
            raise ValueError(f"table: expected one of {', '.join(TABLES)}, got {table!r}")
        return int(self._exec(f"SELECT count(*) AS n FROM {table}").fetchone()["n"])

    def put_meta(self, op: str, impl: str, device_key: str, source_hash: str, meta: dict[str, Any],
                 timestamp: float | None = None) -> None:
        """Store an implementation's cost metadata (graph breaks, LOC, build, registers), replacing older."""
        self._write(lambda: self._exec(
            "INSERT INTO impl_meta VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (op, impl, device_key, source_hash) DO "
            "UPDATE SET meta = excluded.meta, timestamp = excluded.timestamp",
            (op, impl, device_key, source_hash, json.dumps(meta, default=str), timestamp or time.time())))

    def get_meta(self, op: str, impl: str, device_key: str, source_hash: str) -> dict[str, Any] | None:
        row = self._exec("SELECT meta FROM impl_meta WHERE op=? AND impl=? AND device_key=? AND source_hash=?",
                         (op, impl, device_key, source_hash)).fetchone()
        return json.loads(row["meta"]) if row else None

    def put_edge_gate(self, key: tuple, rel_error: float, timestamp: float | None = None) -> None:
        """Record that an implementation passed its edge problems (``key``: ``EDGE_KEY``'s values; ``rel_error``: the
        worst relative error among them). Only passes are kept: a failure is checked again by the next process."""
        if len(key) != len(EDGE_KEY):
            raise ValueError(f"put_edge_gate: key has {len(key)} values, expected {len(EDGE_KEY)}: "
                             f"{', '.join(EDGE_KEY)}")
        self._write(lambda: self._exec(
            f"INSERT INTO edge_gates VALUES ({', '.join('?' * (len(EDGE_KEY) + 2))}) ON CONFLICT "
            f"({', '.join(EDGE_KEY)}) DO UPDATE SET rel_error = excluded.rel_error, timestamp = excluded.timestamp",
            (*key, float(rel_error), timestamp or time.time())))

    def edge_gate(self, key: tuple) -> float | None:
        """The worst relative error of a passed edge gate stored under ``key`` (``EDGE_KEY``'s values), else None."""
        row = self._exec(f"SELECT rel_error FROM edge_gates WHERE {' AND '.join(f'{k}=?' for k in EDGE_KEY)}",
                         tuple(key)).fetchone()
        return None if row is None else float(row["rel_error"])

    def edge_gates(self, key: tuple) -> dict[tuple[str, str], float]:
        """``edge_gate`` for every implementation at once: ``key`` is ``EDGE_KEY``'s values with None for the impl and
        its source_hash; {(impl, source_hash): worst relative error} of the passes stored under the rest."""
        cols = [(k, v) for k, v in zip(EDGE_KEY, key) if k not in ("impl", "source_hash")]
        cur = self._exec(f"SELECT impl, source_hash, rel_error FROM edge_gates WHERE "
                         f"{' AND '.join(f'{k}=?' for k, _ in cols)}", tuple(v for _, v in cols))
        return {(r["impl"], r["source_hash"]): float(r["rel_error"]) for r in cur.fetchall()}

    def meta_rows(self) -> list[dict[str, Any]]:
        """Every implementation's stored cost metadata: op, impl, device_key, source_hash, timestamp, meta (a dict),
        ordered by op and implementation."""
        cur = self._exec("SELECT op, impl, device_key, source_hash, meta, timestamp FROM impl_meta "
                         "ORDER BY op, impl, device_key, source_hash")
        return [dict(r, meta=json.loads(r["meta"])) for r in cur.fetchall()]

    def claim(self, key: tuple[str, ...], ttl_s: float) -> bool:
        """Take the claim on one candidate (``CLAIM_KEY`` values) for ``ttl_s`` seconds before measuring it; False
        while another owner holds a live claim on it. A claim is live until its deadline, or until its owner is
        found to be a process of this host that no longer exists. Claiming again renews one's own claim."""
        host, pid, token = self.owner
        where = " AND ".join(f"{k}=?" for k in CLAIM_KEY)
        self._claimed = True

        def take() -> bool:
            held = self._exec(f"SELECT owner_host, owner_pid, owner_token FROM claims WHERE {where}", key).fetchone()
            if held is not None and held["owner_token"] != token and held["owner_host"] == host \
                    and not _alive(held["owner_pid"]):
                self._exec(f"DELETE FROM claims WHERE {where} AND owner_token=?", (*key, held["owner_token"]))
            now = time.time()
            cur = self._exec(
                f"INSERT INTO claims VALUES ({', '.join('?' * (len(CLAIM_KEY) + 5))}) "
                f"ON CONFLICT ({', '.join(CLAIM_KEY)}) DO UPDATE SET owner_host=excluded.owner_host, "
                "owner_pid=excluded.owner_pid, owner_token=excluded.owner_token, timestamp=excluded.timestamp, "
                "expires=excluded.expires WHERE claims.expires < excluded.timestamp "
                "OR claims.owner_token = excluded.owner_token", (*key, host, pid, token, now, now + ttl_s))
            return cur.rowcount == 1

        return self._write(take)

    def release(self, key: tuple[str, ...] | None = None) -> None:
        """Drop this store's claim on ``key`` (None: every claim it holds)."""
        cond = " AND ".join(f"{k}=?" for k in CLAIM_KEY) + " AND " if key is not None else ""
        self._write(lambda: self._exec(f"DELETE FROM claims WHERE {cond}owner_token=?",
                                       (*(key or ()), self.owner[2])))

    def close(self) -> None:
        if self.conn is not None:
            try:
                if self._claimed:
                    self.release()
            except (*STORE_ERRORS, *self.dialect.errors) as e:  # its claims expire on their own
                log.info("tiered_ops store %s: claims not released on close: %s", self.path, e)
            self.conn.close()
            self.conn = None


def open_store(path: str | Path | None = None) -> Store:
    """The store at ``path`` (None: ``default_path()``), or where none can be opened there, an empty in-memory store
    whose ``unusable`` says why, with a warning in the log: for code that must keep running (model code)."""
    try:
        return Store(path)
    except STORE_ERRORS as e:
        log.warning("%s; using an empty in-memory store instead (nothing is saved): tiered_ops.<op> runs eager", e)
        store = Store(":memory:")
        store.unusable = store.kept_in_memory = str(e)
        return store
