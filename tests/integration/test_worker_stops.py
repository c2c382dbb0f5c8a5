"""Issue 23, item 1: when the worker stops on a failing source transaction, everything before it
is applied and confirmed, as with PostgreSQL's subscriber, whatever the failure: a missing table
or column, a conflict under policy ``error``, a constraint the target adds, a value the target's
type cannot hold. The good transaction and the failing one are consecutive, small, and arrive
together, so the fast path takes both into one batch."""

from __future__ import annotations

import pytest
from replication import assert_same_rows, create_slot, run_worker

pytestmark = pytest.mark.server

#: failure -> (target-only set-up that makes the second transaction fail, the second
#: transaction, what the error names)
FAILURES = {
    "missing table": ("DROP TABLE other", "INSERT INTO other VALUES (1, 1)",
                      'target table "public"."other" does not exist'),
    "missing column": ("ALTER TABLE other DROP COLUMN v", "INSERT INTO other VALUES (1, 1)",
                       'has no column "v"'),
    "conflict under error": ("", "UPDATE other SET v = 2 WHERE id = 7", "conflict update_missing"),
    "constraint": ("ALTER TABLE other ADD CHECK (v < 100)", "INSERT INTO other VALUES (1, 500)",
                   "violates check constraint"),
    "type": ("ALTER TABLE other ALTER COLUMN v TYPE smallint", "INSERT INTO other VALUES (1, 100000)",
             "out of range"),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_every_transaction_before_a_failing_one_is_applied_and_confirmed(source_db, target_db,
                                                                         failure: str) -> None:
    target_change, failing, named = FAILURES[failure]
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        db.execute("CREATE TABLE other (id int PRIMARY KEY, v int)")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t, other")
    if failure == "conflict under error":
        source_db.execute("INSERT INTO other VALUES (7, 1)")  # on the source only
    create_slot(source_db)
    if target_change:
        target_db.execute(target_change)
    before = source_db.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]
    source_db.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 5) g")  # the good one
    source_db.execute(failing)
    # --schema-changes error: under follow, the worker adds the missing column instead.
    failed = run_worker(source_db, target_db, "--conflict-policy", "error", "--schema-changes",
                        "error", expect_rc=1)
    assert named in failed.stderr, failed.stderr[-3000:]
    assert "applier skip" in failed.stderr  # what to do, with the failing transaction's LSN
    assert target_db.query("SELECT count(*) FROM t") == [(5,)], failed.stderr[-3000:]
    assert_same_rows(source_db, target_db, "t")
    # Recorded and confirmed past the good transaction (the only one applied after ``before``):
    # the slot holds nothing of it.
    recorded = target_db.query("SELECT end_lsn > %s::pg_lsn FROM applier.progress", (before,))
    assert recorded == [(True,)]
    confirmed = source_db.query("SELECT confirmed_flush_lsn > %s::pg_lsn FROM pg_replication_slots "
                                "WHERE slot_name = 's'", (before,))
    assert confirmed == [(True,)], failed.stderr[-3000:]
