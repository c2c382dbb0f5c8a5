"""Skipping a poison transaction: the failure names its LSN and the command; the skip is exact,
crash-safe and recorded; prepared, deferred and streamed transactions; stale requests."""

from __future__ import annotations

import re
import subprocess
import sys

import forked
import pytest
from replication import REPO, create_slot, prepare_on_source, run_worker

pytestmark = pytest.mark.server

TABLE = "CREATE TABLE t (id int PRIMARY KEY, v text)"
POISON = "ALTER TABLE t ADD CONSTRAINT no_poison CHECK (v <> 'poison')"  # the target only


def _setup(source_db, target_db, two_phase: bool = False) -> None:
    source_db.execute(TABLE)
    target_db.execute(TABLE)
    target_db.execute(POISON)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db, two_phase=two_phase)


def _ids(db) -> list[int]:
    return [row[0] for row in db.query("SELECT id FROM t ORDER BY id")]


def _failure_lsn(stderr: str) -> str:
    match = re.search(r"applier skip --target <target DSN> --slot s --lsn ([0-9A-F]+/[0-9A-F]+)"
                      r" \(or start the worker with --skip-lsn \1\)", stderr)
    assert match, stderr[-3000:]
    return match.group(1)


def _skip(target_db, lsn: str, expect_rc: int = 0) -> subprocess.CompletedProcess:
    done = forked.run([sys.executable, "-m", "applier", "skip", "--target", target_db.dsn,
                       "--slot", "s", "--lsn", lsn], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == expect_rc, done.stdout + done.stderr
    return done


def _skipped(target_db) -> list[tuple]:
    return target_db.query("SELECT finish_lsn::text, kind, changes, tables FROM "
                           "applier.skipped_transactions ORDER BY id")


def _poison_transaction(source_db) -> None:
    source_db.execute("INSERT INTO t VALUES (1, 'before')")
    with source_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO t VALUES (2, 'same transaction')")
        conn.execute("INSERT INTO t VALUES (3, 'poison')")
    source_db.execute("INSERT INTO t VALUES (4, 'after')")


@pytest.mark.parametrize("how", ["skip-command", "run-option"])
def test_poison_transaction_is_named_then_skipped_exactly(source_db, target_db, how: str) -> None:
    _setup(source_db, target_db)
    _poison_transaction(source_db)
    failed = run_worker(source_db, target_db, expect_rc=1)
    assert "violates check constraint" in failed.stderr
    lsn = _failure_lsn(failed.stderr)
    # The error names the transaction's LSN first; the last received LSN, which is not the one
    # to skip, comes last and says what it is.
    error = failed.stderr[failed.stderr.index(" ERROR "):]
    assert re.findall(r"[0-9A-F]+/[0-9A-F]+", error)[0] == lsn, error
    assert re.search(r"--skip-lsn [0-9A-F/]+\) \[slot=s received_lsn=[0-9A-F/]+ xid=\d+\]\n?$",
                     error), error
    assert _ids(target_db) == [1]
    if how == "skip-command":
        said = _skip(target_db, lsn)
        assert f"finishing at {lsn} will be skipped" in said.stdout
        done = run_worker(source_db, target_db)
    else:
        done = run_worker(source_db, target_db, "--skip-lsn", lsn)
    assert "skipped source transaction" in done.stderr
    assert _ids(target_db) == [1, 4]
    assert [(kind, changes, tables) for _, kind, changes, tables in _skipped(target_db)] == [
        ("commit", 2, ["public.t"])]
    assert target_db.query("SELECT finish_lsn = %s::pg_lsn FROM applier.skipped_transactions",
                           (lsn,)) == [(True,)]
    assert target_db.query("SELECT count(*) FROM applier.skip_requests") == [(0,)]
    # The request is spent: restarting with the same --skip-lsn changes nothing.
    again = run_worker(source_db, target_db, "--skip-lsn", lsn)
    assert "--skip-lsn ignored" in again.stderr
    source_db.execute("INSERT INTO t VALUES (5, 'later')")
    run_worker(source_db, target_db)
    assert _ids(target_db) == [1, 4, 5] and len(_skipped(target_db)) == 1


def test_skip_survives_a_crash_before_the_source_is_told(source_db, target_db) -> None:
    _setup(source_db, target_db)
    _poison_transaction(source_db)
    lsn = _failure_lsn(run_worker(source_db, target_db, expect_rc=1).stderr)
    _skip(target_db, lsn)
    run_worker(source_db, target_db, fault="after_skip", expect_rc=-9)
    assert len(_skipped(target_db)) == 1
    run_worker(source_db, target_db)  # the source resends it: already past, skipped whole
    assert _ids(target_db) == [1, 4] and len(_skipped(target_db)) == 1


def test_skip_a_streamed_transaction(source_db, target_db) -> None:
    _setup(source_db, target_db)
    with source_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO t SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, 2000) g")
        conn.execute("INSERT INTO t VALUES (5000, 'poison')")
    source_db.execute("INSERT INTO t VALUES (6000, 'after')")
    lsn = _failure_lsn(run_worker(source_db, target_db, expect_rc=1).stderr)
    run_worker(source_db, target_db, "--skip-lsn", lsn)
    assert _ids(target_db) == [6000]
    assert [(kind, changes) for _, kind, changes, _ in _skipped(target_db)] == [("stream_commit", 2001)]


def test_skip_a_prepared_transaction_in_prepare_mode(source_db, target_db) -> None:
    _setup(source_db, target_db, two_phase=True)
    prepare_on_source(source_db, "bad", "INSERT INTO t VALUES (1, 'poison')")
    source_db.execute("INSERT INTO t VALUES (2, 'after')")
    failed = run_worker(source_db, target_db, "--two-phase-mode", "prepare", expect_rc=1)
    assert "GID 'bad', finish LSN" in failed.stderr
    lsn = _failure_lsn(failed.stderr)  # the prepare LSN
    run_worker(source_db, target_db, "--two-phase-mode", "prepare", "--skip-lsn", lsn)
    assert _ids(target_db) == [2]
    source_db.execute("COMMIT PREPARED 'bad'")  # the source commits it: nothing to commit here
    run_worker(source_db, target_db, "--two-phase-mode", "prepare")
    assert _ids(target_db) == [2]
    assert [kind for _, kind, _, _ in _skipped(target_db)] == ["prepare"]
    assert target_db.query("SELECT count(*) FROM pg_prepared_xacts "
                           "WHERE database = current_database()") == [(0,)]


def test_skip_a_deferred_transaction_at_commit_prepared(source_db, target_db) -> None:
    _setup(source_db, target_db, two_phase=True)
    prepare_on_source(source_db, "bad", "INSERT INTO t VALUES (1, 'poison')",
                      "INSERT INTO t VALUES (2, 'same transaction')")
    run_worker(source_db, target_db, "--two-phase-mode", "defer")  # deferred: nothing fails yet
    source_db.execute("COMMIT PREPARED 'bad'")
    source_db.execute("INSERT INTO t VALUES (3, 'after')")
    failed = run_worker(source_db, target_db, "--two-phase-mode", "defer", expect_rc=1)
    lsn = _failure_lsn(failed.stderr)  # the COMMIT PREPARED LSN
    _skip(target_db, lsn)
    run_worker(source_db, target_db, "--two-phase-mode", "defer")
    assert _ids(target_db) == [3]
    assert [(kind, changes) for _, kind, changes, _ in _skipped(target_db)] == [("commit_prepared", 2)]
    assert target_db.query("SELECT count(*) FROM applier.prepared_changes") == [(0,)]


def test_requests_that_cannot_match(source_db, target_db) -> None:
    _setup(source_db, target_db)
    source_db.execute("INSERT INTO t VALUES (1, 'a')")
    run_worker(source_db, target_db)
    applied = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0][0]
    behind = _skip(target_db, applied, expect_rc=1)
    assert "already applied everything up to" in behind.stderr
    # An LSN no transaction finishes at: dropped with a warning once the stream passes it.
    position = source_db.query("SELECT pg_current_wal_lsn()::text")[0][0]
    _skip(target_db, position)
    source_db.execute("INSERT INTO t VALUES (2, 'b')")
    done = run_worker(source_db, target_db)
    assert "skip request for slot 's' at LSN" in done.stderr and "dropped" in done.stderr
    assert _ids(target_db) == [1, 2]
    assert target_db.query("SELECT count(*) FROM applier.skip_requests") == [(0,)]


def _skip_slot(target_db, slot: str, *extra: str) -> subprocess.CompletedProcess:
    """``applier skip`` of LSN FF/1234, ahead of anything the tests apply."""
    return forked.run([sys.executable, "-m", "applier", "skip", "--target", target_db.dsn,
                       "--slot", slot, "--lsn", "FF/1234", *extra], capture_output=True,
                      text=True, cwd=REPO)


def _requests(target_db) -> list[tuple]:
    return target_db.query("SELECT slot_name, lsn::text FROM applier.skip_requests")


def test_a_slot_nothing_knows_is_refused(source_db, target_db) -> None:
    """A request for a slot with no progress row on the target and no such slot on the source
    could never be met (a typo in --slot): refused, and nothing is written."""
    unknown = _skip_slot(target_db, "no_such_slot")
    assert unknown.returncode == 1, unknown.stdout + unknown.stderr
    assert "'no_such_slot' is unknown to the target" in unknown.stderr and "--source" in unknown.stderr
    assert target_db.query("SELECT count(*) FROM pg_namespace WHERE nspname = 'applier'") == [(0,)]
    on_source = _skip_slot(target_db, "no_such_slot", "--source", source_db.dsn)
    assert on_source.returncode == 1, on_source.stdout + on_source.stderr
    assert "the source has no replication slot of that name" in on_source.stderr
    # A slot that exists on the source may be given a skip before its first run.
    create_slot(source_db, "fresh")
    assert _skip_slot(target_db, "fresh").returncode == 1  # the target alone cannot tell
    stored = _skip_slot(target_db, "fresh", "--source", source_db.dsn)
    assert stored.returncode == 0, stored.stdout + stored.stderr
    assert _requests(target_db) == [("fresh", "FF/1234")]


def test_a_slot_the_target_knows_needs_no_source(source_db, target_db) -> None:
    """Once a worker has run for a slot, its progress row is enough, even with the source slot
    gone (dropped and about to be recreated, say)."""
    _setup(source_db, target_db)
    source_db.execute("INSERT INTO t VALUES (1, 'a')")
    run_worker(source_db, target_db)
    source_db.execute("SELECT pg_drop_replication_slot('s')")
    for extra in ((), ("--source", source_db.dsn)):
        done = _skip_slot(target_db, "s", *extra)
        assert done.returncode == 0, done.stdout + done.stderr
    assert _requests(target_db) == [("s", "FF/1234")]
