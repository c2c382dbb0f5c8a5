"""``--batch-rows 0`` turns fast apply off: every source transaction goes the careful path, in a
target transaction of its own, and a streamed one is applied at its commit rather than as it
streams (the oracle test's "careful" route)."""

from __future__ import annotations

import pytest
from replication import assert_same_rows, create_slot, run_worker

pytestmark = pytest.mark.server


def _setup(source_db, target_db) -> None:
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    create_slot(source_db)
    for start in range(1, 6):  # five small source transactions, read as one backlog
        source_db.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(%s::int, %s::int) g",
                          (start * 10, start * 10 + 2))
    with source_db.connect() as conn:  # one large enough to be streamed (64kB work_mem)
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t SELECT g, repeat('s', 100) FROM generate_series(1000, 4000) g")
        conn.execute("UPDATE t SET v = 'u' WHERE id = 10")
        conn.execute("COMMIT")


def _target_transactions(target_db) -> int:
    return target_db.query("SELECT count(DISTINCT xmin::text) FROM t")[0][0]


def test_batch_rows_zero_applies_each_transaction_on_its_own(source_db, target_db) -> None:
    _setup(source_db, target_db)
    proc = run_worker(source_db, target_db, "--batch-rows", "0")
    assert_same_rows(source_db, target_db, "t")
    assert _target_transactions(target_db) == 6
    assert "applied as they streamed" not in proc.stderr
    assert "this session applied 6 transaction(s)" in proc.stderr


def test_the_fast_path_shares_target_transactions(source_db, target_db) -> None:
    """The contrast that makes the test above mean something: by default the backlog's small
    transactions share a target transaction, and the streamed one is applied as it streams."""
    _setup(source_db, target_db)
    proc = run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t")
    assert _target_transactions(target_db) < 6
    assert "1 streamed transaction(s) applied as they streamed" in proc.stderr
