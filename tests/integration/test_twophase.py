"""Two-phase source transactions in both modes, including crashes at every dangerous moment.

``events`` has no key on purpose: a transaction applied twice shows up as duplicate rows, so
"exactly once or not at all" is checked literally, not hidden by an upsert.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import forked
import psycopg
import pytest
from replication import (
    assert_same_rows,
    create_slot,
    kill_worker,
    prepare_on_source,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
)

pytestmark = pytest.mark.server

SCHEMA = """
CREATE TABLE events (n int NOT NULL, note text);
ALTER TABLE events REPLICA IDENTITY FULL;
CREATE TABLE t (id int PRIMARY KEY, v text);
CREATE TABLE unpublished (id int);
"""
MODES = ["prepare", "defer"]


def _setup(source_db, target_db) -> None:
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE events, t")
    create_slot(source_db, two_phase=True)


def _events(n: int, count: int = 1, note: str = "x") -> str:
    return f"INSERT INTO events SELECT {n}, '{note}' FROM generate_series(1, {count})"


def _big(n: int, rows: int = 2000) -> str:
    # ~200 kB: well over logical_decoding_work_mem (64kB), so the server streams it.
    return f"INSERT INTO events SELECT {n}, repeat(md5(g::text), 3) FROM generate_series(1, {rows}) g"


def _counts(db) -> dict[int, int]:
    return dict(db.query("SELECT n, count(*) FROM events GROUP BY n"))


def _held(target_db, mode: str) -> int:
    """How many source transactions the target holds prepared (mode prepare) or deferred."""
    if mode == "prepare":
        return target_db.query("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'applier%%' "
                               "AND database = current_database()")[0][0]
    if target_db.query("SELECT to_regclass('applier.prepared_transactions')") == [(None,)]:
        return 0  # the worker has not created its schema yet
    return target_db.query("SELECT count(*) FROM applier.prepared_transactions")[0][0]


def _nothing_left(target_db) -> None:
    assert target_db.query("SELECT count(*) FROM pg_prepared_xacts "
                           "WHERE database = current_database()") == [(0,)]
    assert target_db.query("SELECT count(*) FROM applier.prepared_transactions") == [(0,)]
    assert target_db.query("SELECT count(*) FROM applier.prepared_changes") == [(0,)]


def _mode(mode: str) -> tuple[str, ...]:
    return ("--two-phase-mode", mode)


@pytest.mark.parametrize("mode", MODES)
def test_prepare_then_commit_or_rollback(source_db, target_db, mode: str) -> None:
    _setup(source_db, target_db)
    prepare_on_source(source_db, "keep", _events(1, 2), "INSERT INTO t VALUES (1, 'one')")
    prepare_on_source(source_db, "drop", _events(2, 3))
    source_db.execute(_events(3))

    first = run_worker(source_db, target_db, *_mode(mode))
    assert f"mode {mode}" in first.stderr
    assert _counts(target_db) == {3: 1}, "nothing prepared may be visible yet"
    assert _held(target_db, mode) == 2
    if mode == "prepare":
        gids = [row[0] for row in target_db.query("SELECT gid FROM pg_prepared_xacts "
                                                  "WHERE database = current_database()")]
        assert all(gid.startswith("applier_") and gid.endswith("_s") for gid in gids), gids
        assert not {"keep", "drop"} & set(gids), "the source's GID must not be reused"
    else:
        assert target_db.query("SELECT count(*) FROM pg_prepared_xacts "
                               "WHERE database = current_database()") == [(0,)]

    source_db.execute("COMMIT PREPARED 'keep'")
    source_db.execute("ROLLBACK PREPARED 'drop'")
    source_db.execute(_events(4))
    run_worker(source_db, target_db, *_mode(mode))
    assert _counts(target_db) == {1: 2, 3: 1, 4: 1}
    assert target_db.query("SELECT id, v FROM t") == [(1, "one")]
    _nothing_left(target_db)
    assert_same_rows(source_db, target_db, "events", "t")


def test_a_deferred_transaction_is_stored_in_text_when_a_table_is_not_binary_safe(source_db,
                                                                                  target_db) -> None:
    """--binary auto and defer mode: a prepared transaction on a table whose column is int on
    the source and bigint on the target turns the session to text before it is stored, so its
    later COMMIT PREPARED (the source then sends the commit alone) replays text values."""
    _setup(source_db, target_db)
    source_db.execute("CREATE TABLE wide (id int PRIMARY KEY, v int)")
    target_db.execute("CREATE TABLE wide (id int PRIMARY KEY, v bigint)")
    source_db.execute("ALTER PUBLICATION pub ADD TABLE wide")
    prepare_on_source(source_db, "wide", "INSERT INTO wide SELECT g, g * 7 FROM generate_series(1, 50) g")

    first = run_worker(source_db, target_db, *_mode("defer"))
    assert 'the types of "public"."wide" differ between source and target' in first.stderr
    assert _held(target_db, "defer") == 1
    source_db.execute("COMMIT PREPARED 'wide'")
    run_worker(source_db, target_db, *_mode("defer"))
    assert_same_rows(source_db, target_db, "wide")
    _nothing_left(target_db)


@pytest.mark.parametrize("mode", MODES)
def test_commit_and_rollback_prepared_behind_a_batch(source_db, target_db, mode: str) -> None:
    """A backlog read in one burst: the fast path still holds a batch of committed transactions
    when COMMIT PREPARED or ROLLBACK PREPARED arrives, and both must run outside that block."""
    _setup(source_db, target_db)
    run_worker(source_db, target_db, *_mode(mode))
    prepare_on_source(source_db, "c", _events(1, 3))
    prepare_on_source(source_db, "r", _events(2, 3))
    for i in range(20):
        source_db.execute(_events(100 + i))
    source_db.execute("COMMIT PREPARED 'c'")
    for i in range(20):
        source_db.execute(_events(200 + i))
    source_db.execute("ROLLBACK PREPARED 'r'")
    source_db.execute(_events(300))
    run_worker(source_db, target_db, *_mode(mode))
    counts = _counts(target_db)
    assert counts.get(1) == 3 and 2 not in counts and counts.get(300) == 1
    assert_same_rows(source_db, target_db, "events")
    _nothing_left(target_db)


@pytest.mark.parametrize("mode", MODES)
def test_empty_prepared_transactions_and_savepoints(source_db, target_db, mode: str) -> None:
    _setup(source_db, target_db)
    prepare_on_source(source_db, "empty", "INSERT INTO unpublished VALUES (1)")
    prepare_on_source(source_db, "nothing", "SELECT 1")
    prepare_on_source(source_db, "savepoints", _events(10), "SAVEPOINT a", _events(11), "ROLLBACK TO a",
              _events(12), "SAVEPOINT b", _events(13), "RELEASE b", "SAVEPOINT c", _events(14),
              "SAVEPOINT d", _events(15), "ROLLBACK TO c", _events(16))
    prepare_on_source(source_db, "streamed", _big(20), "SAVEPOINT a", _big(21), "ROLLBACK TO a",
              "SAVEPOINT b", _big(22), "RELEASE b", "SAVEPOINT c", _big(23), "ROLLBACK TO c")
    run_worker(source_db, target_db, *_mode(mode))
    assert _counts(target_db) == {}
    for gid in ("empty", "nothing", "savepoints", "streamed"):
        source_db.execute(f"COMMIT PREPARED '{gid}'")
    run_worker(source_db, target_db, *_mode(mode))
    assert _counts(target_db) == {10: 1, 12: 1, 13: 1, 16: 1, 20: 2000, 22: 2000}
    assert_same_rows(source_db, target_db, "events")
    _nothing_left(target_db)


@pytest.mark.parametrize("mode", MODES)
def test_prepared_transaction_pending_while_later_ones_commit(source_db, target_db, mode: str,
                                                               tmp_path: Path) -> None:
    _setup(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 20) g")
    log = tmp_path / "worker.log"
    proc = start_worker(source_db, target_db, *_mode(mode), log_path=log)
    try:
        wait_for(lambda: target_db.query("SELECT count(*) FROM t") == [(20,)], what="initial rows")
        prepare_on_source(source_db, "pending", "UPDATE t SET v = 'prepared' WHERE id = 1", _events(1),
                  _big(2))
        wait_for(lambda: _held(target_db, mode) == 1, what="the prepare to be held")
        shown = forked.run([sys.executable, "-m", "applier", "status", "--source", source_db.dsn,
                            "--target", target_db.dsn, "--slot", "s", "--json"],
                           capture_output=True, text=True, timeout=60)
        pending = json.loads(shown.stdout)["prepared_transactions"]
        assert [p["mode"] for p in pending] == [mode], shown.stdout
        # defer mode shows the source's GID; prepare mode the target's own, derived one
        assert (pending[0]["gid"] == "pending") if mode == "defer" else pending[0]["gid"].startswith("applier_")
        for i in range(30):  # later transactions, on the same tables, commit past it
            source_db.execute(f"UPDATE t SET v = 'later {i}' WHERE id = {2 + i % 10}")
            source_db.execute(_events(100 + i))
        source_db.execute(_big(3))
        wait_for(lambda: _counts(target_db).get(3) == 2000, what="later transactions")
        assert target_db.query("SELECT v FROM t WHERE id = 1") == [("v",)]
        assert 1 not in _counts(target_db) and 2 not in _counts(target_db)
        assert proc.poll() is None, log.read_text()[-3000:]
        source_db.execute("COMMIT PREPARED 'pending'")
        wait_for(lambda: _held(target_db, mode) == 0 and _counts(target_db).get(2) == 2000,
                 what="commit prepared")
    finally:
        assert stop_worker(proc) == 0, log.read_text()[-3000:]
    assert target_db.query("SELECT v FROM t WHERE id = 1") == [("prepared",)]
    assert_same_rows(source_db, target_db, "events", "t")
    _nothing_left(target_db)


def test_default_mode_follows_max_prepared_transactions(source_db, target_db) -> None:
    _setup(source_db, target_db)
    prepare_on_source(source_db, "p", _events(1))
    done = run_worker(source_db, target_db)  # the rig's target has max_prepared_transactions = 20
    assert "mode prepare (target max_prepared_transactions = 20)" in done.stderr
    assert _held(target_db, "prepare") == 1
    source_db.execute("COMMIT PREPARED 'p'")
    run_worker(source_db, target_db)
    assert _counts(target_db) == {1: 1}


def test_without_two_phase_prepared_transactions_arrive_at_commit(source_db, target_db) -> None:
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE events")
    create_slot(source_db)  # no two_phase: the server decodes a prepared transaction at COMMIT PREPARED
    prepare_on_source(source_db, "p", _events(1))
    run_worker(source_db, target_db)
    assert _counts(target_db) == {}
    source_db.execute("COMMIT PREPARED 'p'")
    run_worker(source_db, target_db)
    assert _counts(target_db) == {1: 1}


# -- crashes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_killed_between_prepare_and_commitprepare_on_source(source_db, target_db, mode: str,
                                                     tmp_path: Path) -> None:
    _setup(source_db, target_db)
    log = tmp_path / "worker.log"
    proc = start_worker(source_db, target_db, *_mode(mode), log_path=log)
    try:
        prepare_on_source(source_db, "small", _events(1, 3))
        prepare_on_source(source_db, "big", _big(2))
        prepare_on_source(source_db, "doomed", _events(3, 2), _big(4))
        source_db.execute(_events(5))
        wait_for(lambda: _held(target_db, mode) == 3 and _counts(target_db) == {5: 1},
                 what="three prepares held and the plain transaction applied")
    finally:
        kill_worker(proc, source_db)
    source_db.execute("COMMIT PREPARED 'small'")
    source_db.execute("COMMIT PREPARED 'big'")
    source_db.execute("ROLLBACK PREPARED 'doomed'")
    source_db.execute(_events(6))
    run_worker(source_db, target_db, *_mode(mode))
    assert _counts(target_db) == {1: 3, 2: 2000, 5: 1, 6: 1}
    _nothing_left(target_db)


@pytest.mark.parametrize("mode", MODES)
def test_killed_right_after_the_target_prepare(source_db, target_db, mode: str) -> None:
    """Prepare mode: PREPARE TRANSACTION done, position not recorded; defer mode: the deferred
    content committed, the source not told. Either way the source resends the prepare."""
    _setup(source_db, target_db)
    prepare_on_source(source_db, "p", _events(1, 2), _big(2))
    fault = "after_prepare" if mode == "prepare" else "before_feedback"
    run_worker(source_db, target_db, *_mode(mode), fault=fault, expect_rc=-9)
    assert _held(target_db, mode) == 1
    run_worker(source_db, target_db, *_mode(mode))
    assert _held(target_db, mode) == 1
    source_db.execute("COMMIT PREPARED 'p'")
    run_worker(source_db, target_db, *_mode(mode))
    assert _counts(target_db) == {1: 2, 2: 2000}
    _nothing_left(target_db)


def test_a_streamed_prepare_sent_again_does_not_wait_for_its_own_prepared_locks(source_db,
                                                                              target_db) -> None:
    """Prepare mode, killed after the target's PREPARE: the source sends the streamed prepared
    transaction again, and applied as it streams it would insert keys its own prepared
    transaction on the target holds. The early session's lock timeout ends that wait; the
    transaction is then recognised at its Stream Prepare as prepared already."""
    _setup(source_db, target_db)
    prepare_on_source(source_db, "keyed", "INSERT INTO t SELECT g, repeat(md5(g::text), 3) "
                      "FROM generate_series(1, 3000) g")
    run_worker(source_db, target_db, *_mode("prepare"), fault="after_prepare", expect_rc=-9)
    assert _held(target_db, "prepare") == 1
    log = run_worker(source_db, target_db, *_mode("prepare")).stderr
    assert "lock timeout" in log, log[-3000:]
    assert _held(target_db, "prepare") == 1
    source_db.execute("COMMIT PREPARED 'keyed'")
    run_worker(source_db, target_db, *_mode("prepare"))
    assert_same_rows(source_db, target_db, "t")
    _nothing_left(target_db)


@pytest.mark.parametrize("mode, fault", [
    ("prepare", "after_commit_prepared"), ("prepare", "after_rollback_prepared"),
    ("prepare", "before_feedback:1"), ("prepare", "before_feedback:2"),
    ("defer", "before_feedback:1"), ("defer", "before_feedback:2"),
])
def test_killed_between_commit_prepared_and_its_feedback(source_db, target_db, mode: str,
                                                          fault: str) -> None:
    """after_commit/rollback_prepared: the target's COMMIT/ROLLBACK PREPARED is done but its
    position is not recorded (prepare mode: defer mode has no such step); before_feedback:N:
    the N-th finished transaction (1: the commit prepared, 2: the rollback prepared) is recorded
    but the source not told."""
    _setup(source_db, target_db)
    prepare_on_source(source_db, "c", _events(1, 2))
    prepare_on_source(source_db, "r", _events(2, 2))
    run_worker(source_db, target_db, *_mode(mode))
    source_db.execute("COMMIT PREPARED 'c'")
    source_db.execute("ROLLBACK PREPARED 'r'")
    run_worker(source_db, target_db, *_mode(mode), fault=fault, expect_rc=-9)
    run_worker(source_db, target_db, *_mode(mode))
    assert _counts(target_db) == {1: 2}
    _nothing_left(target_db)


@pytest.mark.parametrize("mode", MODES)
def test_killed_during_a_streamed_prepare(source_db, target_db, mode: str) -> None:
    _setup(source_db, target_db)
    source_db.execute(_events(0))
    prepare_on_source(source_db, "streamed", _big(1, 3000), "SAVEPOINT a", _big(2), "ROLLBACK TO a",
              _big(3))
    source_db.execute(_events(4))
    run_worker(source_db, target_db, *_mode(mode), "--memory-budget", "256kB",
               fault="two_phase_change:1500", expect_rc=-9)
    assert _held(target_db, mode) == 0, "a half-applied prepare must not survive"
    assert _counts(target_db) == {0: 1}
    run_worker(source_db, target_db, *_mode(mode), "--memory-budget", "256kB")
    assert _held(target_db, mode) == 1
    assert _counts(target_db) == {0: 1, 4: 1}
    source_db.execute("COMMIT PREPARED 'streamed'")
    run_worker(source_db, target_db, *_mode(mode))
    assert _counts(target_db) == {0: 1, 1: 3000, 3: 2000, 4: 1}
    _nothing_left(target_db)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_prepared_transactions_under_random_kills(source_db, target_db, mode: str,
                                                  tmp_path: Path) -> None:
    """A stream of prepared transactions, committed or rolled back at random later, while the
    worker is SIGKILLed at random moments: each one's rows appear exactly once or not at all.
    (One rolled back before the server decodes it may arrive with only part of its changes, or
    none: PostgreSQL stops decoding a transaction it finds aborted; its rollback follows.)"""
    import random

    _setup(source_db, target_db)
    chooser = random.Random(5)
    decided: dict[int, bool] = {}
    pending: list[int] = []
    rows: dict[int, int] = {}
    log = tmp_path / "worker.log"
    conn = psycopg.connect(source_db.dsn, autocommit=True)
    try:
        for round_ in range(6):
            proc = start_worker(source_db, target_db, *_mode(mode), "--memory-budget", "256kB",
                                log_path=log)
            deadline = time.monotonic() + chooser.uniform(1.0, 2.5)
            while time.monotonic() < deadline:
                n = len(decided) + len(pending) + 1
                rows[n] = 1000 if chooser.random() < 0.2 else 3
                body = _big(n, 1000) if rows[n] == 1000 else _events(n, 3)
                conn.execute("BEGIN")
                conn.execute(body)
                conn.execute(f"PREPARE TRANSACTION 'g{n}'")
                pending.append(n)
                if len(pending) > 3:
                    done = pending.pop(chooser.randrange(len(pending)))
                    commit = chooser.random() < 0.7
                    conn.execute(f"{'COMMIT' if commit else 'ROLLBACK'} PREPARED 'g{done}'")
                    decided[done] = commit
                time.sleep(0.02)
            assert proc.poll() is None, log.read_text()[-3000:]
            kill_worker(proc, source_db)
        for done in pending:
            conn.execute(f"COMMIT PREPARED 'g{done}'")
            decided[done] = True
    finally:
        conn.close()
    run_worker(source_db, target_db, *_mode(mode))
    counts = _counts(target_db)
    assert counts == {n: rows[n] for n, committed in decided.items() if committed}
    assert_same_rows(source_db, target_db, "events")
    _nothing_left(target_db)
