"""The measurement store's schema: its tables' columns, the version it is at, and the explicit migrations that
take an older store to that version (``tiered_ops.store.store`` runs them when it opens a store)."""

from __future__ import annotations

from typing import Any, Callable

from ..buckets import decode, encode, from_legacy
from ..registry import Context

# A migration function's argument: the open ``tiered_ops.store.store.Store`` being migrated (not imported here,
# as the store imports this module).
OpenStore = Any

SCHEMA_VERSION = 8


def _buckets_as_json(store: OpenStore) -> None:
    """Schema 5: buckets stored as ``"a|b|c"`` become their typed JSON encoding (``tiered_ops.buckets``)."""
    for r in store._exec("SELECT DISTINCT bucket FROM measurements").fetchall():
        old = r["bucket"]
        try:
            decode(old)
            continue  # already encoded
        except ValueError:
            pass
        store._exec("UPDATE measurements SET bucket=? WHERE bucket=?", (encode(from_legacy(old)), old))


def _context_not_null(store: OpenStore) -> None:
    """Schema 7: every row names its context (older rows without one were an eager caller's), and none can lack one.
    PostgreSQL sets the constraint on the column; SQLite cannot, so its table is rebuilt with the declared columns
    (ids kept, the lookup index made again). A table made with the constraint already is left alone."""
    store._exec("UPDATE measurements SET context=? WHERE context IS NULL", (Context.EAGER.value,))
    if store.backend == "postgresql":
        store._exec("ALTER TABLE measurements ALTER COLUMN context SET NOT NULL")
        return
    info = {r["name"]: r["notnull"] for r in store._exec("PRAGMA table_info(measurements)").fetchall()}
    if info.get("context"):
        return
    names = [n for n, _ in COLUMNS if n in info]
    cols = ", ".join(names)
    store._exec(f"CREATE TABLE measurements_new ({store.dialect.id_column}, "
                f"{', '.join(f'{n} {t}' for n, t in COLUMNS if n in info)})")
    store._exec(f"INSERT INTO measurements_new (id, {cols}) SELECT id, {cols} FROM measurements")
    store._exec("DROP TABLE measurements")
    store._exec("ALTER TABLE measurements_new RENAME TO measurements")
    store._exec(LOOKUP_INDEX)


# Explicit migrations: MIGRATIONS[v] takes a store at version v to v + 1 (SQL, or a function of the store).
MIGRATIONS: dict[int, list[str | Callable[[OpenStore], None]]] = {
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
    # 5: the measurement method of each row (older rows: NULL, stale), where a row came from, typed JSON buckets.
    4: ["ALTER TABLE measurements ADD COLUMN method INTEGER", "ALTER TABLE measurements ADD COLUMN origin TEXT",
        _buckets_as_json],
    # 6: who launched the measured call (NULL: an eager caller, as every older row) and its peak memory.
    5: ["ALTER TABLE measurements ADD COLUMN context TEXT", "ALTER TABLE measurements ADD COLUMN peak_bytes REAL"],
    # 7: the context NOT NULL, older rows' 'eager'.
    6: [_context_not_null],
    # 8: an implementation's edge problems passed at a dtype on a device (with these torch and Triton), so a later
    # process (a resumed sweep, a restarted server) does not compile and check them again.
    7: ["CREATE TABLE IF NOT EXISTS edge_gates (op TEXT NOT NULL, impl TEXT NOT NULL, source_hash TEXT NOT NULL, "
        "dtype TEXT NOT NULL, device_key TEXT NOT NULL, grad INTEGER NOT NULL, torch_version TEXT NOT NULL, "
        "triton_version TEXT NOT NULL, rel_error REAL NOT NULL, timestamp REAL NOT NULL, "
        "PRIMARY KEY (op, impl, source_hash, dtype, device_key, grad, torch_version, triton_version))"],
}
# What one passed edge gate is for: an implementation's source at a dtype on a device, with or without gradients.
EDGE_KEY = ("op", "impl", "source_hash", "dtype", "device_key", "grad", "torch_version", "triton_version")
# What one claim is for: a candidate measurement (one row of ``measurements``).
CLAIM_KEY = ("op", "impl", "problem", "dtype", "mode", "device_key", "source_hash")
# Two rows with these equal are one measurement (merging rows from elsewhere adds each once).
ROW_KEY = ("op", "impl", "problem", "bucket", "dtype", "mode", "device_key", "source_hash", "timestamp")

COLUMNS: list[tuple[str, str]] = [
    ("op", "TEXT NOT NULL"), ("impl", "TEXT NOT NULL"), ("tier", "TEXT NOT NULL"), ("mode", "TEXT NOT NULL"),
    ("problem", "TEXT NOT NULL"), ("bucket", "TEXT NOT NULL"), ("dtype", "TEXT NOT NULL"),
    ("device_key", "TEXT NOT NULL"), ("device_type", "TEXT"), ("gpu_name", "TEXT"), ("capability", "TEXT"),
    ("sm_count", "INTEGER"), ("torch_version", "TEXT"), ("triton_version", "TEXT"), ("cuda_version", "TEXT"),
    ("p20_us", "REAL"), ("p50_us", "REAL"), ("p80_us", "REAL"), ("host_us", "REAL"), ("host_p20_us", "REAL"),
    ("host_p80_us", "REAL"), ("caller_us", "REAL"), ("gbps", "REAL"), ("copy_gbps", "REAL"), ("frac_copy", "REAL"),
    ("rel_error", "REAL"), ("ok", "INTEGER NOT NULL"), ("reason", "TEXT"), ("first_call_s", "REAL"),
    ("source_hash", "TEXT NOT NULL"), ("timestamp", "REAL NOT NULL"), ("env", "TEXT"), ("method", "INTEGER"),
    ("origin", "TEXT"), ("context", "TEXT NOT NULL"), ("peak_bytes", "REAL"),
]
LOOKUP_INDEX = "CREATE INDEX IF NOT EXISTS m_lookup ON measurements (op, bucket, dtype, device_key, mode)"
COLUMN_NAMES = [c for c, _ in COLUMNS]
TABLES = ("measurements", "impl_meta", "claims", "meta", "edge_gates")
