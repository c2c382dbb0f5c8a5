"""``applier drop`` on real servers (PostgreSQL 15 and 18): refused while a worker runs (naming
the WAL sender's PID), then everything of the slot removed (slot, origin, pending prepared
transactions the worker made, bookkeeping rows, spill files), and a second run finds nothing;
--keep-bookkeeping keeps the rows; a refused confirmation removes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import forked
import pytest
from replication import (
    REPO,
    create_slot,
    prepare_on_source,
    replicated_table,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
    wait_slot_inactive,
)

from applier.cli import parse_settings
from applier.exit_codes import ExitCode
from applier.lifecycle.drop import drop

pytestmark = pytest.mark.server


def run_drop(source_db, target_db, *extra: str) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "applier", "drop", "--source", source_db.dsn,
                       "--target", target_db.dsn, "--slot", "s", *extra],
                      capture_output=True, text=True, timeout=120, cwd=REPO,
                      stdin=subprocess.DEVNULL)


def slots(source_db) -> list[tuple]:
    return source_db.query("SELECT slot_name FROM pg_replication_slots WHERE database = "
                           "current_database()")


def origins(target_db) -> list[tuple]:
    return target_db.query("SELECT roname FROM pg_replication_origin WHERE roname = %s",
                           (f"applier_s_{target_db.name}",))


def prepared_on_target(target_db) -> list[tuple]:
    return target_db.query("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")


def test_refused_while_a_worker_runs_then_everything_goes_and_twice(source_db, target_db,
                                                                    tmp_path: Path) -> None:
    replicated_table(source_db, target_db, with_slot=False)
    create_slot(source_db, two_phase=True)
    prepare_on_source(source_db, "pending", "INSERT INTO t VALUES (1)")
    spill = tmp_path / "spill"
    spill.mkdir()
    options = ("--two-phase", "--two-phase-mode", "prepare", "--spill-dir", str(spill))
    run_worker(source_db, target_db, *options)
    assert len(prepared_on_target(target_db)) == 1 and origins(target_db)
    (spill / "applier-stream-123.changes").write_bytes(b"left by a crash")
    (spill / "notes.txt").write_text("the operator's")

    worker = start_worker(source_db, target_db, *options)
    try:
        wait_for(lambda: source_db.query("SELECT active_pid FROM pg_replication_slots "
                                         "WHERE slot_name = 's'") not in ([(None,)], []),
                 what="the worker to hold the slot")
        (pid,) = source_db.query("SELECT active_pid FROM pg_replication_slots WHERE slot_name = 's'")[0]
        refused = run_drop(source_db, target_db, "--yes", "--spill-dir", str(spill))
        assert refused.returncode == ExitCode.FAILED
        assert f"WAL sender PID {pid}" in refused.stderr and "Stop the worker" in refused.stderr
        assert slots(source_db) == [("s",)] and origins(target_db)
    finally:
        assert stop_worker(worker) == 0
    wait_slot_inactive(source_db)

    done = run_drop(source_db, target_db, "--spill-dir", str(spill))  # no terminal: no question
    assert done.returncode == 0, done.stderr
    assert "dropped replication slot 's' on the source" in done.stdout
    assert f"dropped replication origin 'applier_s_{target_db.name}'" in done.stdout
    assert "rolled back prepared transaction 'applier_" in done.stdout
    assert "row(s) of applier.progress" in done.stdout
    assert slots(source_db) == [] and origins(target_db) == [] and prepared_on_target(target_db) == []
    assert target_db.query("SELECT count(*) FROM applier.progress") == [(0,)]
    assert target_db.query("SELECT count(*) FROM applier.publication_tables") == [(0,)]
    assert sorted(p.name for p in spill.iterdir()) == ["notes.txt"]  # only our files go
    source_db.execute("ROLLBACK PREPARED 'pending'")

    again = run_drop(source_db, target_db, "--spill-dir", str(spill))
    assert again.returncode == 0, again.stderr
    assert "nothing left to remove for slot 's'" in again.stdout


def test_keep_bookkeeping_and_a_refused_confirmation(source_db, target_db) -> None:
    replicated_table(source_db, target_db)
    source_db.execute("INSERT INTO t VALUES (1)")
    run_worker(source_db, target_db)
    settings = parse_settings(["drop", "--source", source_db.dsn, "--target", target_db.dsn,
                               "--slot", "s", "--keep-bookkeeping"], {})
    questions: list[str] = []
    assert drop(settings, lambda question: questions.append(question) or "no") == ExitCode.FAILED
    assert questions and slots(source_db) == [("s",)]  # asked, and nothing removed
    assert drop(settings, lambda question: "yes") == ExitCode.OK
    assert slots(source_db) == [] and origins(target_db) == []
    assert target_db.query("SELECT slot_name FROM applier.progress") == [("s",)]


def _sync(source_db, target_db, *extra: str) -> subprocess.CompletedProcess:
    done = forked.run([sys.executable, "-m", "applier", "sync", "--source", source_db.dsn,
                       "--target", target_db.dsn, "--slot", "s", "--publication", "pub",
                       "--exit-when-caught-up", "--change-feed", "all", *extra],
                      capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _feed(target_db) -> dict[str, object]:
    return {
        "schema": target_db.query("SELECT count(*) FROM pg_namespace WHERE nspname = 'applier_changes'")[0][0],
        "tables": target_db.query("SELECT count(*) FROM applier.change_tables")[0][0],
        "partitions": target_db.query("SELECT count(*) FROM applier.change_partitions")[0][0],
        "commits": target_db.query("SELECT count(*) FROM applier.change_commits")[0][0],
    }


@pytest.mark.parametrize("keep", [False, True])
def test_the_change_feed_goes_with_the_replica_and_a_resync_works(source_db, target_db,
                                                                   keep: bool) -> None:
    """Drop removes the change feed (its tables, partitions and their registry rows, and the
    schema once empty) unless --keep-change-feed, which it then says; a sync of the same slot
    name afterwards, recording the feed again, works either way."""
    source_db.execute("CREATE TABLE counters (id int PRIMARY KEY, n int)")
    source_db.execute("INSERT INTO counters SELECT g, 0 FROM generate_series(1, 100) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE counters")
    _sync(source_db, target_db, "--create-tables")
    source_db.execute("UPDATE counters SET n = n + 1 WHERE id <= 10")
    run_worker(source_db, target_db, "--change-feed", "all")
    assert _feed(target_db) == {"schema": 1, "tables": 1, "partitions": 1, "commits": 1}

    done = run_drop(source_db, target_db, "--yes", *(["--keep-change-feed"] if keep else []))
    assert done.returncode == 0, done.stderr
    if keep:
        assert 'kept the change feed of slot \'s\' (--keep-change-feed): "applier_changes".' \
            '"public.counters"' in done.stdout, done.stdout
        assert _feed(target_db) == {"schema": 1, "tables": 1, "partitions": 1, "commits": 1}
    else:
        assert 'change table "applier_changes"."public.counters" of public.counters' in done.stdout
        assert 'dropped change table "applier_changes"."public.counters" (1 partition(s))' \
            in done.stdout, done.stdout
        assert "dropped schema applier_changes" in done.stdout, done.stdout
        assert _feed(target_db) == {"schema": 0, "tables": 0, "partitions": 0, "commits": 0}
    kept = "slot(s) 's' still have rows in it" if keep else "no slot has rows in it any more"
    assert f"kept the bookkeeping schema applier: {kept}" in done.stdout, done.stdout
    assert slots(source_db) == []

    source_db.execute("UPDATE counters SET n = n + 10 WHERE id > 90")
    _sync(source_db, target_db, "--truncate-target")
    source_db.execute("UPDATE counters SET n = -1 WHERE id = 1")
    run_worker(source_db, target_db, "--change-feed", "all")
    assert source_db.query("SELECT * FROM counters ORDER BY id") == \
        target_db.query("SELECT * FROM counters ORDER BY id")
    # The feed records from the new copy on: the one update after it, not the old history.
    assert target_db.query('SELECT id, n, change_op FROM applier_changes."public.counters"') == \
        [(1, -1, "U")]
