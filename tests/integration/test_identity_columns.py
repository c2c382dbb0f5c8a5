"""GENERATED ALWAYS AS IDENTITY columns take the source's values on every route, as PostgreSQL's
subscriber writes them: inserts (COPY and INSERT), updates (the identity value kept, or changed
with SET ... = DEFAULT on the source), the upsert of an existing key and the change feed."""

from __future__ import annotations

import pytest
from replication import assert_same_rows, create_slot, run_worker

pytestmark = pytest.mark.server

SCHEMA = [
    "CREATE TABLE ident_t (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text)",
    # the identity column beside the key, and a FULL identity table with one
    "CREATE TABLE ident_u (k uuid PRIMARY KEY, n bigint GENERATED ALWAYS AS IDENTITY, v text)",
    "CREATE TABLE ident_f (n int GENERATED ALWAYS AS IDENTITY, v text)",
    "ALTER TABLE ident_f REPLICA IDENTITY FULL",
]
TABLES = ("ident_t", "ident_u", "ident_f")


def _workload(source_db) -> None:
    source_db.execute("INSERT INTO ident_t (v) SELECT 'x' || g FROM generate_series(1, 5) g")
    source_db.execute("INSERT INTO ident_t (v) SELECT 'y' || g FROM generate_series(1, 500) g")
    source_db.execute("INSERT INTO ident_u (k, v) SELECT ('00000000-0000-0000-0000-' || "
                      "lpad(g::text, 12, '0'))::uuid, 'x' || g FROM generate_series(1, 5) g")
    source_db.execute("INSERT INTO ident_f (v) SELECT 'x' || g FROM generate_series(1, 5) g")
    source_db.execute("UPDATE ident_t SET v = 'changed' WHERE id = 2")
    source_db.execute("UPDATE ident_u SET v = 'changed' WHERE n = 2")
    source_db.execute("UPDATE ident_f SET v = 'changed' WHERE n = 2")
    # The identity value itself changes: no UPDATE may write it on the target.
    source_db.execute("UPDATE ident_t SET id = DEFAULT WHERE id = 3")
    source_db.execute("UPDATE ident_u SET n = DEFAULT WHERE n = 3")
    source_db.execute("UPDATE ident_f SET n = DEFAULT WHERE n = 3")
    source_db.execute("DELETE FROM ident_t WHERE id = 4")
    source_db.execute("DELETE FROM ident_f WHERE n = 4")
    # One transaction large enough to be streamed (applied as it streams, by default).
    with source_db.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO ident_t (v) SELECT repeat('s', 100) FROM generate_series(1, 3000)")
        conn.execute("UPDATE ident_t SET v = 'streamed' WHERE id = 5")
        conn.execute("UPDATE ident_t SET id = DEFAULT WHERE id = 6")
        conn.execute("UPDATE ident_u SET n = DEFAULT WHERE n = 5")
        conn.execute("INSERT INTO ident_f (v) VALUES ('streamed')")
        conn.execute("COMMIT")


def _setup(source_db, target_db) -> None:
    for db in (source_db, target_db):
        for statement in SCHEMA:
            db.execute(statement)
    source_db.execute(f"CREATE PUBLICATION pub FOR TABLE {', '.join(TABLES)}")
    create_slot(source_db)


@pytest.mark.parametrize("extra", [(), ("--change-feed", "all"), ("--streaming", "off")],
                         ids=["fast", "feed", "unstreamed"])
def test_identity_always_columns_take_the_sources_values(source_db, target_db, extra) -> None:
    _setup(source_db, target_db)
    _workload(source_db)
    run_worker(source_db, target_db, *extra)
    assert_same_rows(source_db, target_db, *TABLES)


@pytest.mark.parametrize("extra", [(), ("--change-feed", "all")], ids=["plain", "feed"])
def test_identity_always_columns_on_the_careful_path(source_db, target_db, extra) -> None:
    """A key that exists on the target makes the batch go row by row, with its conflict
    resolved by an upsert whose identity value differs from the target row's."""
    _setup(source_db, target_db)
    _workload(source_db)
    target_db.execute("INSERT INTO ident_u (k, n, v) OVERRIDING SYSTEM VALUE "
                      "VALUES ('00000000-0000-0000-0000-000000000099', 1000, 'local')")
    source_db.execute("INSERT INTO ident_u (k, v) VALUES ('00000000-0000-0000-0000-000000000099', 'source')")
    run_worker(source_db, target_db, *extra)
    assert_same_rows(source_db, target_db, *TABLES)
    assert target_db.query("SELECT conflict_type, table_name FROM applier.conflicts") == [
        ("insert_exists", "ident_u")]
    # The identity stays GENERATED ALWAYS on the target.
    assert target_db.query("SELECT attrelid::regclass::text, attidentity FROM pg_attribute WHERE "
                           "attidentity <> '' AND attrelid::regclass::text LIKE 'ident%' ORDER BY 1") == [
        ("ident_f", "a"), ("ident_t", "a"), ("ident_u", "a")]
