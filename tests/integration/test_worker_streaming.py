"""Streamed (in-progress) transactions: savepoints, interleaving, aborts, memory budget and spill."""

from __future__ import annotations

import re
import resource
import time
from pathlib import Path

import forked
import psycopg
import pytest
from replication import (
    REPO,
    assert_same_rows,
    create_slot,
    replicated_table,
    run_worker,
    start_worker,
    stop_worker,
    wait_for,
    worker_command,
    worker_env,
)

pytestmark = pytest.mark.server

TABLE = "CREATE TABLE t (id int PRIMARY KEY, batch text, pad text)"


def _batch(name: str, start: int, rows: int = 1500) -> str:
    # ~150 kB per batch: well over logical_decoding_work_mem (64kB), so the server streams.
    return (f"INSERT INTO t SELECT g, '{name}', repeat(md5(g::text), 3) "
            f"FROM generate_series({start}, {start + rows - 1}) g")


def _prepare(source_db, target_db) -> None:
    source_db.execute(TABLE)
    target_db.execute(TABLE)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db)


@pytest.mark.parametrize("streamed_apply", ["early", "commit"])
def test_nested_savepoints_rolled_back_at_several_levels(source_db, target_db,
                                                         streamed_apply: str) -> None:
    """Applied as it streams (savepoints on the target) or buffered and replayed at its commit
    (the buffer cut back): the same rows."""
    _prepare(source_db, target_db)
    with source_db.connect() as conn, conn.transaction():
        conn.execute(_batch("A", 0))
        conn.execute("SAVEPOINT s1")
        conn.execute(_batch("B", 10_000))
        conn.execute("SAVEPOINT s2")
        conn.execute(_batch("C", 20_000))
        conn.execute("RELEASE SAVEPOINT s2")          # C now belongs to s1
        conn.execute("SAVEPOINT s3")
        conn.execute(_batch("D", 30_000))
        conn.execute("ROLLBACK TO SAVEPOINT s1")      # out of order: drops B, C and D
        conn.execute(_batch("E", 40_000))
        conn.execute("SAVEPOINT s4")
        conn.execute(_batch("F", 50_000))
        conn.execute("SAVEPOINT s5")
        conn.execute(_batch("G", 60_000))
        conn.execute("ROLLBACK TO SAVEPOINT s5")      # drops G only
        conn.execute(_batch("H", 70_000))
        conn.execute("RELEASE SAVEPOINT s4")
    log = run_worker(source_db, target_db, "--streamed-apply", streamed_apply).stderr
    assert ("applied as they streamed" in log) == (streamed_apply == "early"), log[-3000:]
    assert_same_rows(source_db, target_db, "t")
    batches = target_db.query("SELECT batch, count(*) FROM t GROUP BY batch ORDER BY batch")
    assert batches == [("A", 1500), ("E", 1500), ("F", 1500), ("H", 1500)]


def test_concurrent_streamed_transactions_one_commits_one_aborts(source_db, target_db) -> None:
    _prepare(source_db, target_db)
    one = psycopg.connect(source_db.dsn)
    two = psycopg.connect(source_db.dsn)
    try:
        for round_ in range(4):  # interleave so the server streams segments of both xids
            one.execute(_batch("one", round_ * 1500))
            two.execute(_batch("two", 100_000 + round_ * 1500))
        two.rollback()
        one.commit()
    finally:
        one.close()
        two.close()
    source_db.execute("INSERT INTO t VALUES (-1, 'small', '')")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t")
    assert target_db.query("SELECT batch, count(*) FROM t GROUP BY batch ORDER BY batch") == [
        ("one", 6000), ("small", 1)]


def test_full_abort_of_a_streamed_transaction(source_db, target_db) -> None:
    _prepare(source_db, target_db)
    with source_db.connect() as conn:
        conn.execute("BEGIN")
        conn.execute(_batch("doomed", 0, rows=3000))
        conn.execute("ROLLBACK")
    source_db.execute("INSERT INTO t VALUES (1, 'kept', '')")
    run_worker(source_db, target_db)
    assert target_db.query("SELECT id, batch FROM t") == [(1, "kept")]


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _run_and_measure(source_db, target_db, spill_dir: Path, budget: str, expected_rows: int) -> int:
    proc = start_worker(source_db, target_db, "--memory-budget", budget, "--spill-dir", str(spill_dir))
    try:
        wait_for(lambda: target_db.query("SELECT count(*) FROM t")[0][0] >= expected_rows,
                 timeout=300, interval=0.25, what=f"{expected_rows} rows on the target")
        peak = _peak_rss_kib(proc.pid)
    finally:
        assert stop_worker(proc) == 0
    return peak


@pytest.mark.slow
def test_transaction_ten_times_the_memory_budget_spills_and_stays_bounded(source_db, target_db,
                                                                         tmp_path: Path) -> None:
    """Peak RSS grows by less than budget + 24 MB over a tiny transaction's run, while the
    transaction is 10x the budget (80 MB), and the spill files are gone afterwards."""
    _prepare(source_db, target_db)
    budget_mb = 8
    source_db.execute("INSERT INTO t VALUES (0, 'warm-up', '')")
    spill_dir = tmp_path / "spill"
    baseline = _run_and_measure(source_db, target_db, spill_dir, f"{budget_mb}MB", 1)

    # 20,000 rows of ~4 kB of incompressible text: ~80 MB decoded, streamed by the server.
    source_db.execute("INSERT INTO t SELECT g, 'big', (SELECT string_agg(md5((g * 1000 + i)::text), '') "
                      "FROM generate_series(1, 125) i) FROM generate_series(1, 20000) g")
    peak = _run_and_measure(source_db, target_db, spill_dir, f"{budget_mb}MB", 20_001)

    assert_same_rows(source_db, target_db, "t")
    growth_mb = (peak - baseline) / 1024
    assert growth_mb < budget_mb + 24, f"peak RSS grew {growth_mb:.1f} MB (baseline {baseline} KiB)"
    assert list(spill_dir.iterdir()) == [], "spill files outlived their transaction"


# -- applied as it streams (--streamed-apply early, the default) ---------------------------------

def _early_session(target_db) -> list[tuple]:
    """The worker's second target session: (state, holds a transaction id)."""
    return target_db.query("SELECT state, backend_xid IS NOT NULL FROM pg_stat_activity "
                           "WHERE application_name = 'applier s (streamed)'")


def _wait_for_the_early_session(target_db) -> None:
    """Until the early session holds the open streamed transaction (written, uncommitted)."""
    wait_for(lambda: _early_session(target_db) == [("idle in transaction", True)], timeout=60,
             what="the early session holding the open streamed transaction")


def test_streamed_transaction_is_applied_as_it_streams_and_visible_only_at_commit(
        source_db, target_db, tmp_path: Path) -> None:
    _prepare(source_db, target_db)
    proc = start_worker(source_db, target_db, log_path=tmp_path / "worker.log")
    try:
        with source_db.connect() as conn:
            conn.execute("BEGIN")
            conn.execute(_batch("big", 0, rows=6000))
            # The early session writes while the source transaction is still open; the main
            # session and any reader see nothing of it.
            _wait_for_the_early_session(target_db)
            assert target_db.query("SELECT count(*) FROM t") == [(0,)]
            conn.execute(_batch("big", 10_000, rows=3000))
            conn.execute("COMMIT")
        wait_for(lambda: target_db.query("SELECT count(*) FROM t")[0][0] == 9000, timeout=60,
                 what="the streamed transaction on the target")
    finally:
        assert stop_worker(proc) == 0
    assert_same_rows(source_db, target_db, "t")
    log = (tmp_path / "worker.log").read_text()
    assert "applied at its commit instead" not in log, log[-3000:]
    assert "1 streamed transaction(s) applied as they streamed" in log, log[-3000:]
    # The origin position moved with the early session's commit (it held the origin then).
    end_lsn = target_db.query("SELECT end_lsn FROM applier.progress")[0][0]
    assert target_db.query("SELECT remote_lsn FROM pg_replication_origin_status") == [(end_lsn,)]


def test_plain_transactions_commit_between_the_segments_of_an_early_one(source_db, target_db) -> None:
    """The right to write and the replication origin go back and forth between the sessions;
    commit order holds: the plain transactions update a row the streamed one updates later."""
    _prepare(source_db, target_db)
    source_db.execute("INSERT INTO t VALUES (-1, 'counter', '0')")
    run_worker(source_db, target_db)
    proc = start_worker(source_db, target_db)
    try:
        with source_db.connect() as big:
            big.execute("BEGIN")
            for round_ in range(4):
                big.execute(_batch("big", round_ * 2000, rows=2000))
                with source_db.connect() as small:
                    small.execute(f"INSERT INTO t VALUES ({-100 - round_}, 'small', '')")
                    small.execute("UPDATE t SET pad = (pad::int + 1)::text WHERE id = -1")
                time.sleep(0.3)
            big.execute("SAVEPOINT s1")
            big.execute(_batch("gone", 50_000, rows=2000))
            big.execute("ROLLBACK TO SAVEPOINT s1")
            big.execute("UPDATE t SET pad = '100' WHERE id = -1")
            big.execute("COMMIT")
        source_db.execute("UPDATE t SET pad = (pad::int + 1)::text WHERE id = -1")
        wait_for(lambda: target_db.query("SELECT pad FROM t WHERE id = -1") == [("101",)],
                 timeout=60, what="the last update of the counter row")
    finally:
        assert stop_worker(proc) == 0
    assert_same_rows(source_db, target_db, "t")
    assert target_db.query("SELECT batch, count(*) FROM t GROUP BY batch ORDER BY batch") == [
        ("big", 8000), ("counter", 1), ("small", 4)]


def test_a_target_lock_the_early_transaction_holds_does_not_hang_the_worker(
        source_db, target_db, tmp_path: Path) -> None:
    """A trigger only the target has makes every insert update one row: the main session then
    waits for the open early transaction's row lock. The lock timeout ends the wait, the session
    restarts, and the streamed transaction is applied at its commit; the trigger's effect shows
    that every row was applied exactly once."""
    _prepare(source_db, target_db)
    target_db.execute("CREATE TABLE inserted (n int)")
    target_db.execute("INSERT INTO inserted VALUES (0)")
    target_db.execute("CREATE FUNCTION count_insert() RETURNS trigger LANGUAGE plpgsql AS "
                      "$$BEGIN UPDATE public.inserted SET n = n + 1; RETURN NEW; END$$")
    target_db.execute("CREATE TRIGGER count_insert AFTER INSERT ON t FOR EACH ROW "
                      "EXECUTE FUNCTION count_insert()")
    target_db.execute("ALTER TABLE t ENABLE ALWAYS TRIGGER count_insert")
    proc = start_worker(source_db, target_db, log_path=tmp_path / "worker.log")
    try:
        with source_db.connect() as big:
            big.execute("BEGIN")
            big.execute(_batch("big", 0, rows=3000))
            _wait_for_the_early_session(target_db)
            source_db.execute("INSERT INTO t VALUES (-1, 'small', '')")
            wait_for(lambda: target_db.query("SELECT count(*) FROM t WHERE id = -1") == [(1,)],
                     timeout=90, what="the plain transaction past the lock")
            big.execute("COMMIT")
        wait_for(lambda: target_db.query("SELECT count(*) FROM t")[0][0] == 3001, timeout=90,
                 what="the streamed transaction on the target")
    finally:
        assert stop_worker(proc) == 0
    assert_same_rows(source_db, target_db, "t")
    assert target_db.query("SELECT n FROM inserted") == [(3001,)]
    log = (tmp_path / "worker.log").read_text()
    assert "lock timeout" in log, log[-3000:]


@pytest.mark.parametrize("trouble", ["conflict", "message"])
def test_an_early_transaction_that_meets_what_it_does_not_handle_is_applied_at_its_commit(
        source_db, target_db, tmp_path: Path, trouble: str) -> None:
    """Past its first changes the early session holds the only copy of them: giving up then
    restarts replication, the source sends the transaction again, and it is applied at its
    commit, once: a row the target already has (resolved by the careful path, the source's row
    winning) or a logical message halfway through."""
    _prepare(source_db, target_db)
    if trouble == "conflict":
        target_db.execute("INSERT INTO t VALUES (5000, 'local', 'x')")
    with source_db.connect() as conn, conn.transaction():
        conn.execute(_batch("big", 0, rows=3000))
        if trouble == "message":
            conn.execute("SELECT pg_logical_emit_message(true, 'halfway', 'there')")
        conn.execute(_batch("big", 3000, rows=3000))
    log = run_worker(source_db, target_db, *(["--messages"] if trouble == "message" else [])).stderr
    assert_same_rows(source_db, target_db, "t")
    assert "cannot be applied as it streams" in log and "1 transaction(s): 6000 insert" in log, log[-3000:]
    # Sent twice, no more: at its commit a conflict goes row by row at once, not batched again.
    assert log.count("streaming from") == 2, log[-3000:]
    if trouble == "conflict":
        assert target_db.query("SELECT pad FROM t WHERE id = 5000") != [("x",)]
        assert target_db.query("SELECT count(*) FROM applier.conflicts") == [(1,)]
    else:
        assert target_db.query("SELECT prefix, content FROM applier.messages") == [
            ("halfway", b"there")]


def test_killed_right_after_an_early_commit_resumes_exactly_once(source_db, target_db) -> None:
    """Killed after the early session committed, before the source was told: the restart
    resumes after that transaction (its progress row committed with it), nothing twice."""
    _prepare(source_db, target_db)
    source_db.execute(_batch("big", 0, rows=3000))
    run_worker(source_db, target_db, fault="before_feedback", expect_rc=-9)
    assert target_db.query("SELECT count(*) FROM t") == [(3000,)]
    source_db.execute("INSERT INTO t VALUES (-1, 'after', '')")
    source_db.execute(_batch("big", 10_000, rows=3000))
    log = run_worker(source_db, target_db).stderr
    assert "2 transaction(s): 3001 insert" in log, log[-3000:]
    assert_same_rows(source_db, target_db, "t")


def test_a_spill_that_cannot_be_written_stops_the_worker_for_the_operator(source_db, target_db,
                                                                          tmp_path: Path) -> None:
    """A full spill disk (here a file size limit: the write fails the same way) is the
    operator's to fix (issue 42): one line naming the directory and the bytes it needed, exit 1,
    no traceback, and nothing lost: a start with room applies everything."""
    replicated_table(source_db, target_db)
    source_db.execute("INSERT INTO t SELECT g FROM generate_series(1, 30000) g")
    spill_dir = tmp_path / "spill"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    proc = forked.run(worker_command(source_db, target_db, "--exit-when-caught-up",
                                     "--streamed-apply", "commit", "--memory-budget", "64kB",
                                     "--spill-dir", str(spill_dir)),
                      capture_output=True, text=True, timeout=180, cwd=REPO,
                      env=worker_env(), preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(rf"cannot write the spill file of streamed transaction \d+ in {re.escape(str(spill_dir))}: "
                     r"File too large \(\d+ bytes to write, \d+ bytes free there\)", proc.stderr), proc.stderr[-3000:]
    assert target_db.query("SELECT count(*) FROM t") == [(0,)]
    run_worker(source_db, target_db, "--streamed-apply", "commit", "--memory-budget", "64kB",
               "--spill-dir", str(spill_dir))
    assert_same_rows(source_db, target_db, "t")
