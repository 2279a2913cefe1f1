"""The stored context on both backends: a store of schema 6, whose rows may have no context, is migrated when it is
opened (its rows an eager caller's, the column NOT NULL from then on), once even when several processes open it at
the same time; the store's queries take a ``Context`` or its text and refuse anything else."""

import subprocess
import sys
import textwrap

import pytest

from tiered_ops.registry import Context
from tiered_ops.store.store import COLUMNS, SCHEMA_VERSION, STORE_ERRORS, Store

ROW = dict(op="x", impl="a", tier="eager", mode="fwd", problem="1", bucket="[1]", dtype="fp32", device_key="d", ok=1,
           source_hash="h")


def schema_6(target: str, contexts: list[str | None], version: int = 6) -> None:
    """A store at ``target`` as schema 6 made it (its context column nullable), with one row per entry of
    ``contexts`` (None: a row written before contexts were recorded), row i measured at timestamp i. ``version=5``:
    as schema 5 made it, without the columns context and peak_bytes (``contexts`` all None)."""
    store = Store(target)
    d = store.dialect
    dropped = ("context", "peak_bytes") if version == 5 else ()
    cols = ", ".join(f"{n} {'TEXT' if n == 'context' else t}" for n, t in COLUMNS if n not in dropped)
    named, mark = (", context", ", ?") if version == 6 else ("", "")

    def make() -> None:
        store._exec("DROP TABLE measurements")
        store._exec(d.ddl(f"CREATE TABLE measurements ({d.id_column}, {cols})"))
        store._exec("CREATE INDEX m_lookup ON measurements (op, bucket, dtype, device_key, mode)")
        store._exec(f"UPDATE meta SET value='{version}' WHERE key='schema_version'")
        for i, ctx in enumerate(contexts):
            store._exec("INSERT INTO measurements (op, impl, tier, mode, problem, bucket, dtype, device_key, ok, "
                        f"source_hash, timestamp{named}) VALUES ('x', ?, 'eager', 'fwd', '1', '[1]', 'fp32', 'd', "
                        f"1, 'h', ?{mark})", (f"i{i}", float(i), *([ctx] if mark else [])))

    store._write(make)
    store.close()


def test_a_schema_6_store_is_migrated_its_rows_without_context_eager(store_target):
    schema_6(store_target, [None, "compiled", None, "graphed"])
    store = Store(store_target)
    assert store._version() == SCHEMA_VERSION == 8
    assert store.count("edge_gates") == 0  # schema 8's table, made by the migration
    everything = store.rows(context="*")
    assert [(r["id"], r["impl"], r["context"]) for r in everything] == [
        (1, "i0", "eager"), (2, "i1", "compiled"), (3, "i2", "eager"), (4, "i3", "graphed")]  # ids kept
    assert [r["impl"] for r in store.rows()] == ["i0", "i2"]  # the eager caller's rows, as every query reads them
    assert [r["impl"] for r in store.latest("x", "[1]", "fp32", "d", "fwd")] == ["i0", "i2"]
    assert [r["impl"] for r in store.latest("x", "[1]", "fp32", "d", "fwd", Context.COMPILED)] == ["i1"]
    assert store.buckets("x", "fp32", "d", "fwd", "graphed") == ["[1]"]
    with pytest.raises(STORE_ERRORS, match="context"):
        store._write(lambda: store._exec(
            "INSERT INTO measurements (op, impl, tier, mode, problem, bucket, dtype, device_key, ok, source_hash, "
            "timestamp, context) VALUES ('x', 'n', 'eager', 'fwd', '1', '[1]', 'fp32', 'd', 1, 'h', 9.0, NULL)"))
    store.add([dict(ROW, impl="new")])  # a row given without a context is an eager caller's
    assert store.rows(impl="new")[0]["context"] == "eager" and store.count() == 5
    store.close()
    assert Store(store_target)._version() == SCHEMA_VERSION  # opened again: nothing left to do


def test_the_lookup_index_survives_the_migration(tmp_path):
    path = str(tmp_path / "old.sqlite")
    schema_6(path, [None])
    store = Store(path)
    assert store._exec("SELECT name FROM sqlite_master WHERE type='index' AND name='m_lookup'").fetchone()
    assert not store._exec("SELECT name FROM sqlite_master WHERE name='measurements_new'").fetchone()


def test_processes_opening_one_old_store_at_once_migrate_it_once(store_target):
    """Each process opens the old store (of schema 5: its migration adds columns, then makes the context NOT NULL;
    many rows, so it takes a while) and adds its rows; none fails (a process that read the old version and added a
    column another had added already would fail with "duplicate column name"), none of the old or new rows is lost
    or doubled."""
    schema_6(store_target, [None] * 3000, version=5)
    code = textwrap.dedent(f"""
        import sys
        from tiered_ops.store.store import Store
        store = Store(sys.argv[2])
        store.add([dict({ROW!r}, problem=sys.argv[1] + str(i), timestamp=100.0 + i) for i in range(20)])
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, tag, store_target], stderr=subprocess.PIPE, text=True)
             for tag in "abcd"]
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert [rc for rc, _ in outcomes] == [0] * 4, [err for _, err in outcomes]
    store = Store(store_target)
    rows = store.rows()
    assert len(rows) == 3000 + 4 * 20 and len({r["id"] for r in rows}) == len(rows)
    assert {r["context"] for r in store.rows(context="*")} == {"eager"}
    assert store._version() == SCHEMA_VERSION


@pytest.mark.parametrize("bad", ["EAGER", "Eager", "replayed", None, 1])
def test_the_queries_and_add_refuse_an_unknown_context(bad, tmp_path):
    store = Store(str(tmp_path / "s.sqlite"))
    for query in (lambda: store.rows(context=bad), lambda: store.latest("x", "[1]", "fp32", "d", "fwd", bad),
                  lambda: store.buckets("x", "fp32", "d", "fwd", bad)):
        with pytest.raises(ValueError, match=r"context: expected one of eager, compiled, graphed, got"):
            query()
    if bad is not None:  # None: a row without a context, an eager caller's
        with pytest.raises(ValueError, match=r"a row's context: expected one of eager, compiled, graphed"):
            store.add([dict(ROW, context=bad)])
    assert store.count() == 0


def test_a_context_member_and_its_text_are_stored_and_read_alike(store_target):
    store = Store(store_target)
    store.add([dict(ROW, impl="m", context=Context.GRAPHED), dict(ROW, impl="t", context="graphed")])
    assert store.merge([dict(ROW, impl="p", timestamp=2.0, context=float("nan"))]) == 1  # a results file's empty cell
    assert [(r["impl"], type(r["context"])) for r in store.rows(context=Context.GRAPHED)] == [("m", str), ("t", str)]
    assert [r["impl"] for r in store.rows(context="graphed")] == ["m", "t"]
    assert [r["impl"] for r in store.rows()] == ["p"]
