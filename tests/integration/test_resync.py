"""``applier resync`` (issue 40): a running worker copies a table again beside its stream (the
other tables streaming on), one not running copies it first at its next start; a request that
cannot be met is refused before anything changes."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import forked
import psycopg
import pytest
from live import wait_streaming
from replication import (
    REPO,
    assert_same_rows,
    create_slot,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
)

pytestmark = pytest.mark.server


class Writer(threading.Thread):
    """Keeps inserting and updating rows of the given tables, one transaction per table."""

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
                        conn.execute(f"INSERT INTO {table} VALUES (%s, 'new')", (1_000_000 + n,))
                        conn.execute(f"UPDATE {table} SET v = v || '+' WHERE id = %s", (1 + n % 3000,))
                    self.writes += 1
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)
        assert self.error is None, self.error


def _setup(source_db, target_db, *tables: str) -> None:
    """``tables`` with 3,000 rows each, replicated by the worker (so the target's rows are its own)."""
    for db in (source_db, target_db):
        for table in tables:
            db.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    source_db.execute(f"CREATE PUBLICATION pub FOR TABLE {', '.join(tables)}")
    create_slot(source_db)
    for table in tables:
        source_db.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 3000) g")
    run_worker(source_db, target_db)


def resync(source_db, target_db, *extra: str) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "applier", "resync", "--source", source_db.dsn,
                       "--target", target_db.dsn, "--slot", "s", "--publication", "pub", *extra],
                      capture_output=True, text=True, timeout=120, cwd=REPO)


def _records(target_db, table: str) -> list[tuple]:
    return target_db.query("SELECT kind, state, source_lsn IS NOT NULL, inserted FROM applier.repairs "
                           "WHERE table_name = %s ORDER BY id", (table,))


def test_a_running_worker_copies_a_table_again_while_the_others_stream(
        source_db, target_db, tmp_path: Path) -> None:
    _setup(source_db, target_db, "t1", "t2")
    log = tmp_path / "worker.log"
    writer = Writer(source_db.dsn, ["t1", "t2"])
    writer.start()
    worker = start_worker(source_db, target_db, log_path=log)
    try:
        wait_streaming(source_db, target_db)
        wait_for(lambda: writer.writes > 50, what="writes")
        target_db.execute("DELETE FROM t2 WHERE id <= 100")  # damage: gone, changed, added
        target_db.execute("UPDATE t2 SET v = 'damaged' WHERE id BETWEEN 500 AND 520")
        target_db.execute("INSERT INTO t2 VALUES (-1, 'extra')")
        done = resync(source_db, target_db, "--table", "t2")
        assert done.returncode == 0, done.stderr
        assert "running worker copies it" in done.stdout
        wait_for(lambda: _records(target_db, "t2")[-1][1] == "done", timeout=120, what="the resync")
        seen = writer.writes
        wait_for(lambda: writer.writes > seen + 20, what="writes after the copy")
    finally:
        writer.stop()
        assert stop_worker(worker) == 0, log.read_text()[-4000:]
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t1", "t2")
    assert _records(target_db, "t2") == [("resync", "done", True, _records(target_db, "t2")[0][3])]
    # Copied beside the stream; or, when the request finds a session about to start again (a
    # streamed transaction open, a redo after the damage), by the next session before it streams.
    text = log.read_text()
    assert any(words in text for words in ("copying public.t2 again", 'copying "public"."t2" again',
                                           '"public"."t2" to be copied again',
                                           'copying "public"."t2" (added to the publication, or '
                                           "marked by applier resync) before streaming")), text[-4000:]


def test_with_no_worker_running_the_next_run_copies_first(source_db, target_db) -> None:
    _setup(source_db, target_db, "t1")
    target_db.execute("DELETE FROM t1 WHERE id % 7 = 0")
    done = resync(source_db, target_db, "--table", "public.t1")
    assert done.returncode == 0, done.stderr
    assert "No worker is running" in done.stdout
    source_db.execute("INSERT INTO t1 VALUES (0, 'after the request')")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t1")
    assert _records(target_db, "t1") == [("resync", "done", True, 3001)]


def test_refused_before_anything_changes(source_db, target_db) -> None:
    _setup(source_db, target_db, "t1")
    source_db.execute("CREATE TABLE other (id int PRIMARY KEY)")
    target_db.execute("ALTER TABLE t1 ADD COLUMN note text DEFAULT 'mine'")
    states = target_db.query("SELECT * FROM applier.publication_tables")
    refused = resync(source_db, target_db, "--table", "t1,other")
    assert refused.returncode == 1
    assert "other is not published" in refused.stderr
    assert "(note): the copy empties the table" in refused.stderr, refused.stderr
    assert target_db.query("SELECT * FROM applier.publication_tables") == states
    assert target_db.query("SELECT count(*) FROM applier.repairs") == [(0,)]
    done = resync(source_db, target_db, "--table", "t1", "--keep-target-columns")
    assert done.returncode == 0, done.stderr
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t1")


@pytest.mark.slow
def test_stopped_while_it_copies_first_the_worker_exits_cleanly(source_db, target_db, tmp_path) -> None:
    _setup(source_db, target_db, "t1")
    source_db.execute("INSERT INTO t1 SELECT g, repeat('w', 100) FROM generate_series(3001, 400000) g")
    run_worker(source_db, target_db)
    assert resync(source_db, target_db, "--table", "t1").returncode == 0
    log = tmp_path / "worker.log"
    worker = start_worker(source_db, target_db, log_path=log)
    wait_for(lambda: target_db.query("SELECT state FROM applier.publication_tables") == [("copying",)],
             what="the copy to start")
    assert stop_worker(worker) == 0, log.read_text()[-4000:]
    assert "stopped on signal" in log.read_text()
    run_worker(source_db, target_db)  # copies it again first
    assert_same_rows(source_db, target_db, "t1")
