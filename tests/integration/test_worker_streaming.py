"""Streamed (in-progress) transactions: savepoints, interleaving, aborts, memory budget and spill."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from replication import assert_same_rows, create_slot, run_worker, start_worker, stop_worker, wait_for

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


def test_nested_savepoints_rolled_back_at_several_levels(source_db, target_db) -> None:
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
    run_worker(source_db, target_db)
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
