"""``applier cutover`` on real servers (PostgreSQL 15 and 18): safe with a worker caught up (and
its sequences set); not safe with the worker lagging (the timeout names how far behind), with a
prepared transaction pending on the source, with a table differing (by content, the default,
and by counts), with a schema differing, or with a skipped transaction or a conflict whose rows
differ; never SAFE with the rows only counted; JSON output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator

import forked
import pytest
from replication import (
    REPO,
    create_slot,
    prepare_on_source,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
)

from applier.exit_codes import ExitCode

pytestmark = pytest.mark.server


def run_cutover(source_db, target_db, *extra: str) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "applier", "cutover", "--source", source_db.dsn,
                       "--target", target_db.dsn, "--slot", "s", "--publication", "pub",
                       "--timeout", "60s", *extra],
                      capture_output=True, text=True, timeout=180, cwd=REPO)


def check_line(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if f"] {name}:" in line)


@pytest.fixture
def worker(source_db, target_db) -> Iterator[subprocess.Popen]:
    """Table ``t`` with a serial key replicated by a running worker, 100 rows applied."""
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id serial PRIMARY KEY, v text)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    source_db.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput', false, true)")
    proc = start_worker(source_db, target_db, "--status-interval", "1", "--two-phase")
    try:
        source_db.execute("INSERT INTO t (v) SELECT 'x' FROM generate_series(1, 100)")
        wait_for(lambda: target_db.query("SELECT to_regclass('public.t') IS NOT NULL "
                                         "AND (SELECT count(*) FROM t) = 100") == [(True,)],
                 what="the worker to apply the rows")
        yield proc
    finally:
        stop_worker(proc)


def test_safe_when_caught_up_and_the_sequences_are_set(source_db, target_db, worker) -> None:
    done = run_cutover(source_db, target_db)
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    assert "verdict: SAFE" in done.stdout
    for name in ("replica caught up", "no prepared transaction on the source",
                 "no prepared transaction held on the target", "no table copy unfinished",
                 "sequences set", "schemas equal", "tables equal", "no transaction skipped",
                 "no conflict left"):
        assert check_line(done.stdout, name).lstrip().startswith("[ok"), done.stdout
    assert target_db.query("SELECT last_value FROM t_id_seq") == [(100,)]
    as_json = run_cutover(source_db, target_db, "--json", "--verify", "full")
    assert as_json.returncode == ExitCode.OK, as_json.stdout + as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["safe"] is True and report["tables"]["equal"] is True
    assert report["sequences"][0]["target_after"] == {"last_value": 100, "is_called": True}


def test_a_lagging_worker_fails_after_the_timeout_naming_the_lag(source_db, target_db,
                                                                 worker) -> None:
    worker.send_signal(signal.SIGSTOP)  # still holds the slot, applies nothing
    try:
        source_db.execute("INSERT INTO t (v) SELECT repeat('y', 100) FROM generate_series(1, 1000)")
        lagging = run_cutover(source_db, target_db, "--timeout", "2s")
    finally:
        worker.send_signal(signal.SIGCONT)
    assert lagging.returncode == ExitCode.CHECK, lagging.stdout + lagging.stderr
    line = check_line(lagging.stdout, "replica caught up")
    assert "FAIL" in line and "after 2 s the replica is" in line and "behind" in line
    assert "a worker streams it (WAL sender PID" in line
    assert "wait longer (a larger --timeout)" in lagging.stdout
    assert "not compared: the replica has not caught up" in lagging.stdout
    assert "verdict: NOT SAFE" in lagging.stdout
    # Once it has applied everything, the same cutover passes.
    done = run_cutover(source_db, target_db)
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    assert target_db.query("SELECT count(*) FROM t") == [(1100,)]


def test_a_prepared_transaction_pending_on_the_source(source_db, target_db, worker) -> None:
    prepare_on_source(source_db, "pending", "INSERT INTO t (v) VALUES ('later')")
    try:
        done = run_cutover(source_db, target_db)
    finally:
        source_db.execute("ROLLBACK PREPARED 'pending'")
    assert done.returncode == ExitCode.CHECK, done.stdout + done.stderr
    line = check_line(done.stdout, "no prepared transaction on the source")
    assert "FAIL" in line and "1 pending: pending" in line
    assert "COMMIT PREPARED or ROLLBACK PREPARED each on the source" in done.stdout


def test_a_differing_table(source_db, target_db, worker) -> None:
    """The default compares rows: a changed row, whose count is the same, is found. Row counts
    alone never give SAFE."""
    target_db.execute("UPDATE t SET v = 'changed' WHERE id = 7")
    full = run_cutover(source_db, target_db)
    assert full.returncode == ExitCode.CHECK, full.stdout + full.stderr
    assert "FAIL" in check_line(full.stdout, "tables equal") and "rows differ in public.t" in full.stdout
    assert "public.t: changed: id=7" in full.stdout and "verdict: NOT SAFE" in full.stdout
    counted = run_cutover(source_db, target_db, "--verify", "counts")
    assert counted.returncode == ExitCode.CHECK, counted.stdout + counted.stderr
    assert "--verify counts cannot see a changed row" in check_line(counted.stdout, "tables equal")
    assert "verdict: NOT CONFIRMED" in counted.stdout and "--verify full" in counted.stdout
    target_db.execute("DELETE FROM t WHERE id = 8")
    counts = run_cutover(source_db, target_db, "--verify", "counts")
    assert counts.returncode == ExitCode.CHECK
    assert "row counts differ in public.t" in check_line(counts.stdout, "tables equal")
    assert "applier verify --table" in counts.stdout


def test_a_differing_schema_is_listed(source_db, target_db, worker) -> None:
    target_db.execute("ALTER TABLE t ALTER COLUMN v SET DEFAULT 'x'; CREATE INDEX t_v ON t (v)")
    done = run_cutover(source_db, target_db)
    assert done.returncode == ExitCode.CHECK, done.stdout + done.stderr
    assert "FAIL" in check_line(done.stdout, "schemas equal")
    assert '- "public"."t": column "v": default none on the source, \'x\'::text on the target' \
        in done.stdout, done.stdout
    assert '- "public"."t": index "t_v" is only on the target' in done.stdout, done.stdout


def test_skipped_transactions_and_conflicts_are_weighed(source_db, target_db) -> None:
    """A skipped transaction and a conflict are fine only where the rows they touched compare
    equal in full: first they do not (the skipped row is missing), then, repaired, they do."""
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    target_db.execute("ALTER TABLE t ADD CONSTRAINT no_poison CHECK (v <> 'poison')")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db)
    source_db.execute("INSERT INTO t VALUES (1, 'a')")
    source_db.execute("INSERT INTO t VALUES (2, 'poison')")
    failed = run_worker(source_db, target_db, expect_rc=1)
    lsn = failed.stderr.split("--skip-lsn ")[-1].split(")")[0]
    run_worker(source_db, target_db, "--skip-lsn", lsn)
    target_db.execute("INSERT INTO t VALUES (3, 'local')")
    source_db.execute("INSERT INTO t VALUES (3, 'from the source')")  # insert_exists, source wins
    proc = start_worker(source_db, target_db, "--status-interval", "1")
    try:
        wait_for(lambda: target_db.query("SELECT v FROM t WHERE id = 3") == [("from the source",)],
                 what="the conflicting insert")
        differs = run_cutover(source_db, target_db)
        assert differs.returncode == ExitCode.CHECK, differs.stdout + differs.stderr
        skipped = check_line(differs.stdout, "no transaction skipped")
        assert "FAIL" in skipped and "public.t" in skipped, differs.stdout
        assert f"- public.t: skipped at {lsn}" in differs.stdout
        conflicts = check_line(differs.stdout, "no conflict left")
        assert "FAIL" in conflicts and "public.t" in conflicts
        assert "- public.t: 1 insert_exists" in differs.stdout
        # Repaired as the source has it (and the target's extra CHECK gone): SAFE, the skip and
        # the conflict weighed against rows that compare equal.
        target_db.execute("ALTER TABLE t DROP CONSTRAINT no_poison; INSERT INTO t VALUES (2, 'poison')")
        done = run_cutover(source_db, target_db)
        assert done.returncode == ExitCode.OK, done.stdout + done.stderr
        assert "each compared equal in full" in check_line(done.stdout, "no transaction skipped")
        assert "each compared equal in full" in check_line(done.stdout, "no conflict left")
        counted = run_cutover(source_db, target_db, "--verify", "counts")
        assert counted.returncode == ExitCode.CHECK
        assert "not compared in full (--verify counts)" in check_line(counted.stdout,
                                                                       "no transaction skipped")
    finally:
        stop_worker(proc)
