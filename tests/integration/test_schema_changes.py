"""``--schema-changes follow`` (the default): a source table's changed columns change the target
table, in the target transaction of the first row change that needs it (issue 25). Each case
ends with a row-by-row comparison."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import forked
import pytest
from replication import (
    REPO,
    assert_same_rows,
    create_slot,
    prepare_on_source,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
)

pytestmark = pytest.mark.server


def _table(source_db, target_db, definition: str = "id int PRIMARY KEY, v text") -> None:
    for db in (source_db, target_db):
        db.execute(f"CREATE TABLE t ({definition})")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db)


def _columns(db, table: str = "t") -> dict[str, str]:
    return dict(db.query("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                         "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped", (table,)))


def _changes(target_db) -> list[tuple[str, str]]:
    return target_db.query("SELECT kind, statement FROM applier.schema_changes ORDER BY id")


def test_a_column_added_and_written_in_the_same_transaction(source_db, target_db) -> None:
    _table(source_db, target_db)
    source_db.execute("INSERT INTO t VALUES (1, 'before')")
    with source_db.connect() as conn, conn.transaction():
        conn.execute("ALTER TABLE t ADD COLUMN n numeric(10,2), ADD COLUMN tags text[]")
        conn.execute("INSERT INTO t VALUES (2, 'with', 12.5, '{a,b}')")
        conn.execute("UPDATE t SET n = 1 WHERE id = 1")
    run_worker(source_db, target_db)
    assert _columns(target_db) == {"id": "integer", "v": "text", "n": "numeric(10,2)", "tags": "text[]"}
    assert_same_rows(source_db, target_db, "t")
    kinds = [kind for kind, _ in _changes(target_db)]
    assert kinds == ["add_column", "add_column"]
    status = forked.run([sys.executable, "-m", "applier", "status", "--source", source_db.dsn,
                         "--target", target_db.dsn, "--slot", "s", "--json"],
                        capture_output=True, text=True, timeout=60, cwd=REPO)
    shown = json.loads(status.stdout)["schema_changes"]
    assert [c["kind"] for c in shown] == ["add_column", "add_column"]


def test_a_column_added_inside_a_streamed_transaction_with_a_rolled_back_savepoint(
        source_db, target_db, tmp_path: Path) -> None:
    """The source streams the transaction while it runs (64kB of decoding memory); the column
    added in the rolled-back subtransaction never reaches the target, the other one does."""
    _table(source_db, target_db)
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log)
    try:
        source_db.execute("INSERT INTO t VALUES (0, 'warm')")
        wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(1,)], what="the first row")
        with source_db.connect() as conn, conn.transaction():
            conn.execute("INSERT INTO t SELECT g, repeat('a', 50) FROM generate_series(1, 3000) g")
            conn.execute("SAVEPOINT a")
            conn.execute("ALTER TABLE t ADD COLUMN x int")
            conn.execute("INSERT INTO t SELECT g, 'x', g FROM generate_series(3001, 6000) g")
            conn.execute("ROLLBACK TO SAVEPOINT a")
            conn.execute("ALTER TABLE t ADD COLUMN y text")
            conn.execute("INSERT INTO t SELECT g, 'y', 'y' || g FROM generate_series(6001, 9000) g")
        wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(6001,)], timeout=120,
                 what="the streamed transaction")
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-3000:]
    assert set(_columns(target_db)) == {"id", "v", "y"}
    assert_same_rows(source_db, target_db, "t")


def test_integer_widened_to_bigint_then_values_past_2_31(source_db, target_db) -> None:
    _table(source_db, target_db, "id int PRIMARY KEY, n int, s varchar(5)")
    source_db.execute("INSERT INTO t VALUES (1, 7, 'abc')")
    run_worker(source_db, target_db)
    source_db.execute("ALTER TABLE t ALTER COLUMN n TYPE bigint, ALTER COLUMN s TYPE varchar(40)")
    source_db.execute("INSERT INTO t VALUES (2, 3000000000, repeat('s', 40))")
    source_db.execute("UPDATE t SET n = -3000000000 WHERE id = 1")
    run_worker(source_db, target_db)
    assert _columns(target_db) == {"id": "integer", "n": "bigint", "s": "character varying(40)"}
    assert_same_rows(source_db, target_db, "t")
    assert [kind for kind, _ in _changes(target_db)] == ["widen", "widen"]


def test_a_type_change_off_the_safe_list_stops_the_worker(source_db, target_db, tmp_path: Path) -> None:
    _table(source_db, target_db, "id int PRIMARY KEY, n int")
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log)
    try:
        source_db.execute("INSERT INTO t VALUES (1, 7)")
        wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(1,)], what="the first row")
        source_db.execute("ALTER TABLE t ALTER COLUMN n TYPE text")
        source_db.execute("INSERT INTO t VALUES (2, 'not a number')")
        assert worker.wait(timeout=120) == 1
    finally:
        stop_worker(worker)
    text = log.read_text()
    assert "column 'n'" in text and "changed on the source to text" in text and "integer" in text
    assert target_db.query("SELECT id FROM t") == [(1,)]
    assert _changes(target_db) == []


def test_a_dropped_not_null_column_loses_its_not_null(source_db, target_db) -> None:
    _table(source_db, target_db, "id int PRIMARY KEY, v text NOT NULL, w text")
    source_db.execute("INSERT INTO t VALUES (1, 'v', 'w')")
    run_worker(source_db, target_db)
    source_db.execute("ALTER TABLE t DROP COLUMN v")
    source_db.execute("INSERT INTO t VALUES (2, 'w2')")
    run_worker(source_db, target_db)
    assert target_db.query("SELECT id, v, w FROM t ORDER BY id") == [(1, "v", "w"), (2, None, "w2")]
    assert target_db.query("SELECT attnotnull FROM pg_attribute WHERE attrelid = 't'::regclass "
                           "AND attname = 'v'") == [(False,)]
    assert_same_rows(source_db, target_db, "t")
    assert [kind for kind, _ in _changes(target_db)] == ["drop_not_null"]


def test_a_renamed_column_is_added_and_the_old_one_kept(source_db, target_db) -> None:
    _table(source_db, target_db)
    source_db.execute("INSERT INTO t VALUES (1, 'old')")
    run_worker(source_db, target_db)
    source_db.execute("ALTER TABLE t RENAME COLUMN v TO label")
    source_db.execute("INSERT INTO t VALUES (2, 'new')")
    run_worker(source_db, target_db)
    # Rows written before the rename keep their value in the old column; the source's rename
    # is not seen as one (pgoutput sends the new column list only).
    assert target_db.query("SELECT id, v, label FROM t ORDER BY id") == [(1, "old", None), (2, None, "new")]
    assert source_db.query("SELECT id, label FROM t WHERE id >= 2") == \
        target_db.query("SELECT id, label FROM t WHERE id >= 2")


def test_error_mode_stops_at_a_new_column(source_db, target_db) -> None:
    _table(source_db, target_db)
    source_db.execute("ALTER TABLE t ADD COLUMN n int")
    source_db.execute("INSERT INTO t VALUES (1, 'a', 1)")
    failed = run_worker(source_db, target_db, "--schema-changes", "error", expect_rc=1)
    assert 'has no column "n"' in failed.stderr
    assert set(_columns(target_db)) == {"id", "v"}


@pytest.mark.parametrize("mode", ["prepare", "defer"])
def test_a_column_added_inside_a_prepared_transaction(source_db, target_db, mode: str) -> None:
    """Prepare mode: the change is made on its own first (inside the target's prepared
    transaction it would hold the table's lock until COMMIT PREPARED), then the transaction is
    prepared. Defer mode: made when the transaction is applied, at COMMIT PREPARED."""
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db, two_phase=True)
    prepare_on_source(source_db, "g1", "ALTER TABLE t ADD COLUMN n int",
                      "INSERT INTO t VALUES (1, 'a', 5)")
    run_worker(source_db, target_db, "--two-phase-mode", mode)
    assert target_db.query("SELECT count(*) FROM t") == [(0,)]
    source_db.execute("COMMIT PREPARED 'g1'")
    source_db.execute("INSERT INTO t VALUES (2, 'b', 6)")
    run_worker(source_db, target_db, "--two-phase-mode", mode)
    assert_same_rows(source_db, target_db, "t")
    assert [kind for kind, _ in _changes(target_db)] == ["add_column"]


@pytest.mark.parametrize("while_running", [True, False])
def test_a_type_change_that_is_no_widening_stops_at_its_relation(source_db, target_db, tmp_path: Path,
                                                                 while_running: bool) -> None:
    """integer -> text on the source: '7' would fit the target's integer column, but the next
    'abc' would not; the worker stops at the first row of the new type, naming the column and
    both types, whether the change comes while it runs or while it is stopped."""
    _table(source_db, target_db, "id int PRIMARY KEY, v int")
    source_db.execute("INSERT INTO t VALUES (1, 1)")
    run_worker(source_db, target_db)
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log) if while_running else None
    try:
        if worker is not None:
            source_db.execute("INSERT INTO t VALUES (2, 2)")
            wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(2,)], what="row 2")
        source_db.execute("ALTER TABLE t ALTER COLUMN v TYPE text")
        source_db.execute("INSERT INTO t VALUES (3, '7')")
        if worker is None:
            failed = run_worker(source_db, target_db, expect_rc=1)
            text = failed.stderr
        else:
            assert worker.wait(timeout=120) == 1
            text = log.read_text()
    finally:
        if worker is not None:
            stop_worker(worker)
    assert "the type of column 'v' of public.t changed on the source to text" in text, text
    assert "target's integer" in text, text
    assert target_db.query("SELECT max(id) FROM t") == [(2 if while_running else 1,)]
    assert _changes(target_db) == []


def _missing(db, column: str) -> list[tuple]:
    return db.query("SELECT atthasmissing, pg_get_expr(d.adbin, d.adrelid), attnotnull "
                    "FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid "
                    "AND d.adnum = a.attnum WHERE a.attrelid = 't'::regclass AND attname = %s",
                    (column,))


@pytest.mark.parametrize("while_running", [True, False])
def test_a_column_added_with_a_constant_default_keeps_it_for_existing_rows(
        source_db, target_db, tmp_path: Path, while_running: bool) -> None:
    """ADD COLUMN ... DEFAULT <constant> on the source is metadata only: existing rows read the
    default (attmissingval). The target column gets the same, so every existing row reads the
    default there too, and so do rows inserted on the target after a cutover; NOT NULL with it."""
    _table(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 500) g")
    run_worker(source_db, target_db)
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log) if while_running else None
    try:
        source_db.execute("ALTER TABLE t ADD COLUMN vip boolean DEFAULT false")
        source_db.execute("ALTER TABLE t ADD COLUMN since timestamptz NOT NULL DEFAULT now()")
        source_db.execute("ALTER TABLE t ADD COLUMN label text DEFAULT 'it''s'")
        source_db.execute("ALTER TABLE t ALTER COLUMN label SET DEFAULT 'later'")  # for new rows
        source_db.execute("INSERT INTO t (id, v, vip) VALUES (501, 'new', true)")
        source_db.execute("UPDATE t SET v = 'changed' WHERE id = 7")
        if worker is None:
            run_worker(source_db, target_db)
        else:
            wait_for(lambda: target_db.query("SELECT v FROM t WHERE id = 7") == [("changed",)],
                     what="the last change (row 7 updated)")
    finally:
        if worker is not None:
            assert stop_worker(worker) == 0, log.read_text()[-3000:]
    assert_same_rows(source_db, target_db, "t")
    assert target_db.query("SELECT count(*) FROM t WHERE vip IS NULL OR since IS NULL "
                           "OR label IS NULL") == [(0,)]
    assert _missing(target_db, "vip") == [(True, "false", False)]
    assert _missing(target_db, "since") == [(True, "now()", True)]
    assert _missing(target_db, "label") == [(True, "'later'::text", False)]
    # Rows written on the target (after a cutover) get the source's defaults.
    target_db.execute("INSERT INTO t (id, v) VALUES (1000, 'local')")
    assert target_db.query("SELECT vip, label FROM t WHERE id = 1000") == [(False, "later")]
    assert [kind for kind, _ in _changes(target_db)] == ["add_column"] * 3


def test_a_column_added_with_a_volatile_default_stops_the_worker(source_db, target_db) -> None:
    """A volatile default makes the source rewrite the table, giving each existing row its own
    value; the rewrite is not in the stream. The worker stops, saying so and what to do, rather
    than add the column empty; done as it says, the worker goes on."""
    _table(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 20) g")
    run_worker(source_db, target_db)
    source_db.execute("ALTER TABLE t ADD COLUMN added timestamptz DEFAULT clock_timestamp()")
    source_db.execute("INSERT INTO t (id, v) VALUES (21, 'new')")
    failed = run_worker(source_db, target_db, expect_rc=1)
    assert "column 'added' of public.t" in failed.stderr, failed.stderr
    assert "clock_timestamp()" in failed.stderr and "rewr" in failed.stderr, failed.stderr
    assert "ALTER TABLE" in failed.stderr and "then start the worker again" in failed.stderr
    assert target_db.query("SELECT count(*) FROM t") == [(20,)]
    assert "added" not in _columns(target_db)
    # As the error says: the column on the target with the source's values, then a restart.
    values = source_db.query("SELECT id, added::text FROM t WHERE id <= 20")
    target_db.execute("ALTER TABLE t ADD COLUMN added timestamptz DEFAULT clock_timestamp()")
    for key, value in values:
        target_db.execute("UPDATE t SET added = %s WHERE id = %s", (value, key))
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t")


_CHANGES = {
    # No default: the rows there before read NULL; a type widened (the source rewrote the table).
    "added and widened": ("ADD COLUMN n numeric(10,2), ALTER COLUMN w TYPE bigint",
                          "INSERT INTO t SELECT g, 'after', g * 100000, g / 4.0 "
                          "FROM generate_series(1, 300, 2) g", {"n": "numeric(10,2)", "w": "bigint"}),
    # A constant default: the rows there before read it (the source's missing value).
    "added with a default": ("ADD COLUMN flag boolean NOT NULL DEFAULT true",
                             "INSERT INTO t SELECT g, 'after', 1, g % 2 = 0 "
                             "FROM generate_series(1, 300, 2) g", {"flag": "boolean"}),
}


@pytest.mark.parametrize("change", list(_CHANGES))
@pytest.mark.parametrize("via_root", [False, True], ids=["through its leaves", "through its root"])
def test_a_column_added_to_a_partitioned_table(source_db, target_db, via_root: bool,
                                               change: str) -> None:
    """Found by the oracle test (issue 42): published through its leaves, a partitioned table
    that gains a column on the source is described by each leaf's Relation message, and a
    column cannot be added to a partition: it is added to the target's partitioned table (once:
    the other leaves then have it), as on the source; so is a column widened. A leaf of a
    nested level and a leaf whose column order differs from its root's are among them."""
    alter, insert, types = _CHANGES[change]
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text, w smallint) PARTITION BY RANGE (id)")
        db.execute("CREATE TABLE t_low PARTITION OF t FOR VALUES FROM (MINVALUE) TO (100)")
        db.execute("CREATE TABLE t_mid PARTITION OF t FOR VALUES FROM (100) TO (200) "
                   "PARTITION BY HASH (id)")
        db.execute("CREATE TABLE t_mid_0 PARTITION OF t_mid FOR VALUES WITH (MODULUS 2, REMAINDER 0)")
        db.execute("CREATE TABLE t_mid_1 PARTITION OF t_mid FOR VALUES WITH (MODULUS 2, REMAINDER 1)")
        db.execute("CREATE TABLE t_high (w smallint, v text, id int NOT NULL)")
        db.execute("ALTER TABLE t ATTACH PARTITION t_high FOR VALUES FROM (200) TO (MAXVALUE)")
    source_db.execute(f"CREATE PUBLICATION pub FOR TABLE t WITH (publish_via_partition_root = {via_root})")
    create_slot(source_db)
    source_db.execute("INSERT INTO t SELECT g, 'before' FROM generate_series(0, 300, 2) g")
    with source_db.connect() as conn, conn.transaction():
        conn.execute(f"ALTER TABLE t {alter}")
        conn.execute(insert)
        conn.execute("UPDATE t SET v = 'updated' WHERE id % 3 = 0")
    run_worker(source_db, target_db)
    for table in ("t", "t_low", "t_mid_0", "t_mid_1", "t_high"):
        columns = _columns(target_db, table)
        assert {name: columns[name] for name in types} == types
    assert_same_rows(source_db, target_db, "t_low", "t_mid_0", "t_mid_1", "t_high")
    # Made on the partitioned table, and recorded for each leaf that needed it.
    table = "public.t" if not via_root else '"public"."t"'
    changes = _changes(target_db)
    assert changes and all(statement.startswith(f"ALTER TABLE {table} ") for _, statement in changes)
