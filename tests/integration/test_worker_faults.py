"""Exactly once under failure: SIGKILL loops, killed connections, a restarted source server,
a missing target column, a second worker, bad slots and publications."""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest
from replication import (
    assert_same_rows,
    create_slot,
    replicated_table,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
)

pytestmark = pytest.mark.server

BANK = """
CREATE TABLE branches (bid int PRIMARY KEY, bbalance int NOT NULL);
CREATE TABLE tellers (tid int PRIMARY KEY, bid int NOT NULL, tbalance int NOT NULL);
CREATE TABLE accounts (aid int PRIMARY KEY, bid int NOT NULL, abalance int NOT NULL, filler text);
CREATE TABLE history (hid bigint PRIMARY KEY, tid int, bid int, aid int, delta int, note text);
"""
TABLES = ("branches", "tellers", "accounts", "history")


def _bank(source_db, target_db) -> None:
    source_db.execute(BANK)
    target_db.execute(BANK)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE branches, tellers, accounts, history")
    create_slot(source_db)
    source_db.execute("INSERT INTO branches SELECT g, 0 FROM generate_series(1, 3) g")
    source_db.execute("INSERT INTO tellers SELECT g, 1 + g % 3, 0 FROM generate_series(1, 30) g")
    source_db.execute("INSERT INTO accounts SELECT g, 1 + g % 3, 0, repeat('x', 80) "
                      "FROM generate_series(1, 3000) g")


class Workload(threading.Thread):
    """A pgbench-like TPC-B mix plus occasional large (streamed) and aborted transactions."""

    OUTAGE_LIMIT_S = 120.0

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.random = random.Random(seed)
        self.stop_event = threading.Event()
        self.committed = 0
        self.hid = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        down_since: float | None = None
        while not self.stop_event.is_set():
            try:
                with psycopg.connect(self.dsn) as conn:
                    down_since = None
                    while not self.stop_event.is_set():
                        self._one(conn)
            except psycopg.OperationalError as exc:
                # The source restarts in one test: reconnect and go on (the interrupted transaction
                # rolled back on the source). A fast shutdown waits for walsenders to finish, which
                # on a loaded machine takes many seconds, so the bound is time, not attempts.
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > self.OUTAGE_LIMIT_S:
                    self.error = exc
                    return
                time.sleep(0.5)
            except BaseException as exc:  # surfaced by the test
                self.error = exc
                return

    def _one(self, conn: psycopg.Connection) -> None:
        r = self.random
        roll = r.random()
        with conn.transaction():
            if roll < 0.03:  # large, streamed
                start = self.hid + 1
                self.hid += 1200
                conn.execute("INSERT INTO history SELECT g, 0, 0, 0, 0, repeat(md5(g::text), 2) "
                             "FROM generate_series(%s::int, %s::int) g", (start, self.hid))
                conn.execute("UPDATE accounts SET abalance = abalance + 1 WHERE aid %% 7 = %s",
                             (r.randrange(7),))
            else:
                aid, tid, bid, delta = r.randint(1, 3000), r.randint(1, 30), r.randint(1, 3), r.randint(-5000, 5000)
                conn.execute("UPDATE accounts SET abalance = abalance + %s WHERE aid = %s", (delta, aid))
                conn.execute("UPDATE tellers SET tbalance = tbalance + %s WHERE tid = %s", (delta, tid))
                conn.execute("UPDATE branches SET bbalance = bbalance + %s WHERE bid = %s", (delta, bid))
                self.hid += 1
                conn.execute("INSERT INTO history VALUES (%s, %s, %s, %s, %s, 'tx')",
                             (self.hid, tid, bid, aid, delta))
                if roll > 0.97:
                    conn.execute("DELETE FROM history WHERE hid = %s", (r.randint(1, self.hid),))
        self.committed += 1

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)
        assert self.error is None, self.error


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_and_duplicates_nothing(source_db, target_db, tmp_path: Path) -> None:
    _bank(source_db, target_db)
    workload = Workload(source_db.dsn, seed=7)
    workload.start()
    chooser = random.Random(11)
    log = tmp_path / "worker.log"
    try:
        for _ in range(12):
            proc = start_worker(source_db, target_db, "--memory-budget", "256kB",
                                "--spill-dir", str(tmp_path / "spill"), log_path=log)
            time.sleep(chooser.uniform(0.6, 2.5))
            assert proc.poll() is None, log.read_text()[-3000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        workload.stop()
    assert workload.committed > 50
    run_worker(source_db, target_db, "--spill-dir", str(tmp_path / "spill"))
    assert_same_rows(source_db, target_db, *TABLES)


def _terminate(db, condition: str) -> int:
    return len(db.query(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {condition}"))


@pytest.mark.slow
def test_killed_connections_and_restarted_source_are_survived(source_db, target_db, tmp_path: Path) -> None:
    _bank(source_db, target_db)
    workload = Workload(source_db.dsn, seed=3)
    workload.start()
    log = tmp_path / "worker.log"
    proc = start_worker(source_db, target_db, log_path=log)
    try:
        applied = lambda: target_db.query("SELECT count(*) FROM history")[0][0]  # noqa: E731
        for round_ in range(3):
            seen = applied()
            wait_for(lambda: applied() > seen, timeout=60, what="progress before a kill")
            # Mid-stream: the walsender on the source and the apply session on the target.
            _terminate(source_db, "backend_type = 'walsender'")
            _terminate(target_db, "datname = current_database() AND application_name = 'applier s'")
            time.sleep(0.5)
            assert proc.poll() is None, log.read_text()[-3000:]
        seen = applied()
        source_db.cluster.restart()
        wait_for(lambda: applied() > seen, timeout=90, what="progress after the source restart")
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        workload.stop()
        assert stop_worker(proc) == 0, log.read_text()[-3000:]
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, *TABLES)
    assert "reconnecting" in log.read_text()


def test_missing_target_column_stops_then_resumes_after_it_is_added(source_db, target_db) -> None:
    """``--schema-changes error``: PostgreSQL's subscriber's behaviour (follow adds the column)."""
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY, a text, b text)")
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY, a text)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db)
    source_db.execute("INSERT INTO t VALUES (1, 'x', 'y')")
    source_db.execute("INSERT INTO t VALUES (2, 'z', 'w')")
    failed = run_worker(source_db, target_db, "--schema-changes", "error", expect_rc=1)
    assert 'has no column "b"' in failed.stderr
    assert '"public"."t"' in failed.stderr
    assert "commit LSN" in failed.stderr
    assert target_db.query("SELECT count(*) FROM t") == [(0,)]
    target_db.execute("ALTER TABLE t ADD COLUMN b text")
    run_worker(source_db, target_db, "--schema-changes", "error")
    assert_same_rows(source_db, target_db, "t")


def test_missing_target_table_is_named(source_db, target_db) -> None:
    source_db.execute("CREATE TABLE lost (id int PRIMARY KEY)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE lost")
    create_slot(source_db)
    source_db.execute("INSERT INTO lost VALUES (1)")
    failed = run_worker(source_db, target_db, expect_rc=1)
    assert 'target table "public"."lost" does not exist' in failed.stderr


def test_second_worker_on_the_same_slot_is_refused(source_db, target_db, tmp_path: Path) -> None:
    replicated_table(source_db, target_db)
    first = start_worker(source_db, target_db, log_path=tmp_path / "first.log")
    try:
        wait_for(lambda: source_db.query("SELECT active FROM pg_replication_slots WHERE slot_name = 's'")
                 == [(True,)], what="the first worker to stream")
        second = run_worker(source_db, target_db, expect_rc=1, timeout=60)
        assert "already running for slot 's'" in second.stderr
        source_db.execute("INSERT INTO t VALUES (1)")
        wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(1,)], what="first worker applying")
    finally:
        assert stop_worker(first) == 0


def test_sigterm_stops_cleanly_and_confirms(source_db, target_db, tmp_path: Path) -> None:
    replicated_table(source_db, target_db)
    proc = start_worker(source_db, target_db, log_path=tmp_path / "w.log")
    source_db.execute("INSERT INTO t SELECT generate_series(1, 10)")
    wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(10,)], what="apply")
    assert stop_worker(proc, signal.SIGTERM) == 0
    recorded = target_db.query("SELECT end_lsn::text FROM applier.progress WHERE slot_name = 's'")[0][0]
    slot = source_db.query("SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots "
                           "WHERE slot_name = 's'", (recorded,))
    assert slot == [(True,)]


@pytest.mark.parametrize("problem", ["slot", "publication"])
def test_missing_slot_or_publication_is_a_clear_permanent_error(source_db, target_db, problem: str) -> None:
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    if problem == "slot":
        source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    else:
        create_slot(source_db)
    failed = run_worker(source_db, target_db, expect_rc=1, timeout=60)
    expected = "replication slot 's' does not exist" if problem == "slot" else "publication(s) 'pub' do not exist"
    assert expected in failed.stderr


def test_create_slot_option_creates_it(source_db, target_db) -> None:
    replicated_table(source_db, target_db, with_slot=False)
    run_worker(source_db, target_db, "--create-slot")
    assert source_db.query("SELECT plugin FROM pg_replication_slots WHERE slot_name = 's'") == [("pgoutput",)]
