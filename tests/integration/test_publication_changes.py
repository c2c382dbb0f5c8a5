"""The publication followed while the worker runs (issue 25): a table added is copied from a
snapshot with its own sync LSN (no gap, no overlap with the stream), also when the worker is
killed in the middle of that copy; a table removed is no longer applied and keeps its rows."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import forked
import psycopg
import pytest
from replication import (
    REPO,
    assert_same_rows,
    create_slot,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
    wait_slot_inactive,
)

pytestmark = pytest.mark.server


class Writer(threading.Thread):
    """Keeps updating and inserting rows of the given tables until stopped."""

    def __init__(self, dsn: str, tables: list[str]) -> None:
        super().__init__(daemon=True)
        self.dsn, self.tables = dsn, tables
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.writes = 0

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                n = 0
                while not self.stop_event.is_set():
                    n += 1
                    for table in self.tables:
                        conn.execute(f"INSERT INTO {table} VALUES (%s, 'new') ON CONFLICT DO NOTHING",
                                     (10_000_000 + n,))
                        conn.execute(f"UPDATE {table} SET v = v || '+' WHERE id = %s", (1 + n % 5000,))
                    self.writes += 1
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)
        assert self.error is None, self.error


def _setup(source_db, target_db) -> None:
    source_db.execute("CREATE TABLE t1 (id int PRIMARY KEY, v text)")
    target_db.execute("CREATE TABLE t1 (id int PRIMARY KEY, v text)")
    source_db.execute("INSERT INTO t1 SELECT g, 'v' FROM generate_series(1, 5000) g")
    target_db.execute("INSERT INTO t1 SELECT g, 'v' FROM generate_series(1, 5000) g")
    source_db.execute("CREATE TABLE t2 (id int PRIMARY KEY, v text)")  # not on the target yet
    source_db.execute("INSERT INTO t2 SELECT g, repeat('w', 40) FROM generate_series(1, 200000) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t1")
    create_slot(source_db)


def _state(target_db, table: str) -> str | None:
    try:
        found = target_db.query("SELECT state FROM applier.publication_tables WHERE table_name = %s",
                                (table,))
    except Exception:
        return None
    return found[0][0] if found else None


@pytest.mark.slow
def test_a_table_added_under_writes_is_copied_even_when_the_worker_dies_mid_copy(
        source_db, target_db, tmp_path: Path) -> None:
    _setup(source_db, target_db)
    log = tmp_path / "worker.log"
    writer = Writer(source_db.dsn, ["t1", "t2"])
    writer.start()
    worker = start_worker(source_db, target_db, "--create-tables", log_path=log)
    try:
        wait_for(lambda: _state(target_db, "t1") == "published", what="the first session")
        source_db.execute("ALTER PUBLICATION pub ADD TABLE t2")
        wait_for(lambda: _state(target_db, "t2") == "copying", timeout=90, what="t2's copy to start")
        worker.send_signal(signal.SIGKILL)  # in the middle of that table's copy
        worker.wait(timeout=30)
        wait_slot_inactive(source_db)
        worker = start_worker(source_db, target_db, "--create-tables", log_path=log)
        wait_for(lambda: _state(target_db, "t2") == "published", timeout=120, what="t2's copy")
        seen = writer.writes
        wait_for(lambda: writer.writes > seen + 20, what="writes after the copy")
    finally:
        writer.stop()
        assert stop_worker(worker) == 0, log.read_text()[-4000:]
    run_worker(source_db, target_db, "--create-tables")
    assert_same_rows(source_db, target_db, "t1", "t2")
    assert "copying public.t2" in log.read_text() or '"public"."t2"' in log.read_text()


def test_a_table_added_while_stopped_is_copied_at_start(source_db, target_db) -> None:
    _setup(source_db, target_db)
    run_worker(source_db, target_db)  # follows t1 from here on
    source_db.execute("ALTER PUBLICATION pub ADD TABLE t2")
    source_db.execute("INSERT INTO t2 VALUES (0, 'after the add')")
    target_db.execute("CREATE TABLE t2 (id int PRIMARY KEY, v text)")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t1", "t2")


def test_a_table_added_without_its_target_table_stops_with_todays_error(source_db, target_db) -> None:
    _setup(source_db, target_db)
    run_worker(source_db, target_db)
    source_db.execute("ALTER PUBLICATION pub ADD TABLE t2")
    failed = run_worker(source_db, target_db, expect_rc=1)
    assert 'target table "public"."t2" does not exist' in failed.stderr
    target_db.execute("CREATE TABLE t2 (id int PRIMARY KEY, v text)")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t1", "t2")


def test_a_removed_table_is_no_longer_applied_and_keeps_its_rows(source_db, target_db) -> None:
    _setup(source_db, target_db)
    run_worker(source_db, target_db)  # the first run follows what is published: t1
    source_db.execute("ALTER PUBLICATION pub ADD TABLE t2")
    run_worker(source_db, target_db, "--create-tables")
    assert_same_rows(source_db, target_db, "t2")
    source_db.execute("ALTER PUBLICATION pub DROP TABLE t2")
    source_db.execute("INSERT INTO t2 VALUES (0, 'not published')")
    source_db.execute("INSERT INTO t1 VALUES (0, 'published')")
    run_worker(source_db, target_db)
    assert target_db.query("SELECT count(*) FROM t2") == [(200000,)]
    assert_same_rows(source_db, target_db, "t1")
    assert _state(target_db, "t2") == "removed"
    status = forked.run([sys.executable, "-m", "applier", "status", "--source", source_db.dsn,
                         "--target", target_db.dsn, "--slot", "s", "--json"],
                        capture_output=True, text=True, timeout=60, cwd=REPO)
    tables = json.loads(status.stdout)["publication_tables"]
    assert {(t["schema_name"], t["table_name"], t["state"]) for t in tables} == {
        ("public", "t1", "published"), ("public", "t2", "removed")}


def _followed(target_db) -> set[tuple[str, str, str]]:
    return set(target_db.query("SELECT schema_name, table_name, state FROM applier.publication_tables"))


@pytest.mark.parametrize("rename", [
    ("ALTER TABLE rc_t RENAME TO rc_new", "public.rc_new"),
    ("ALTER TABLE rc_t SET SCHEMA other", "other.rc_t"),
], ids=["rename", "set-schema"])
def test_a_renamed_table_is_followed_under_its_new_name_not_copied(
        source_db, target_db, tmp_path: Path, rename: tuple[str, str]) -> None:
    """Renamed on the target, then on the source, while the worker streams (issue 42): the
    source relation keeps its OID, so nothing is copied and no row is lost or doubled; the
    change feed follows the rename too."""
    statement, new_name = rename
    for db in (source_db, target_db):
        db.execute("CREATE SCHEMA other")
        db.execute("CREATE TABLE rc_t (id int PRIMARY KEY, v text)")
    source_db.execute("INSERT INTO rc_t SELECT g, 'v' FROM generate_series(1, 100) g")
    target_db.execute("INSERT INTO rc_t SELECT g, 'v' FROM generate_series(1, 100) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE rc_t")
    create_slot(source_db)
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, "--change-feed", "all", log_path=log)
    try:
        wait_for(lambda: _state(target_db, "rc_t") == "published", what="the first session")
        source_db.execute("INSERT INTO rc_t VALUES (101, 'before')")
        wait_for(lambda: target_db.query("SELECT count(*) FROM rc_t") == [(101,)], what="101")
        target_db.execute(statement)
        source_db.execute(statement)
        source_db.execute(f"INSERT INTO {new_name} VALUES (102, 'after')")
        source_db.execute(f"UPDATE {new_name} SET v = 'changed' WHERE id = 1")
        wait_for(lambda: target_db.query(f"SELECT v FROM {new_name} WHERE id IN (1, 102) ORDER BY id")
                 == [("changed",), ("after",)], timeout=60, what="the changes after the rename")
        assert worker.poll() is None, log.read_text()[-4000:]
    finally:
        assert stop_worker(worker) == 0, log.read_text()[-4000:]
    assert_same_rows(source_db, target_db, new_name)
    schema, name = new_name.split(".")
    assert _followed(target_db) == {(schema, name, "published")}
    text = log.read_text()
    assert "copying" not in text and "added to the publication" not in text, text[-4000:]
    # The change feed records the table's changes before and after the rename in one table.
    recorded = target_db.query("SELECT table_schema, table_name FROM applier.change_tables")
    assert recorded == [(schema, name)]
    change_table = target_db.query("SELECT change_table FROM applier.change_tables")[0][0]
    assert target_db.query(f'SELECT change_op::text, id FROM applier_changes."{change_table}" '
                           "ORDER BY change_commit_lsn, change_seq") == [("I", 101), ("I", 102), ("U", 1)]
    # A later run, the worker stopped, starts under the new name and copies nothing.
    source_db.execute(f"INSERT INTO {new_name} VALUES (103, 'later')")
    later = run_worker(source_db, target_db, "--change-feed", "all")
    assert "copying" not in later.stderr
    assert_same_rows(source_db, target_db, new_name)
