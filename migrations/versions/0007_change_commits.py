"""The change feed's source transactions: the end LSN of each one that wrote change rows.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Not a column of every change row: a transaction's end LSN is known only at its Commit,
    # after its change rows may have been written. Not a row per transaction either: one per
    # target transaction (or part of one) that recorded commits, holding them as two arrays in
    # commit order, so that a drain of small transactions writes a few rows, not one each.
    op.execute("""
        CREATE TABLE applier.change_commits (
            slot_name   text     NOT NULL,
            first_lsn   pg_lsn   NOT NULL,
            last_lsn    pg_lsn   NOT NULL,
            commit_lsns pg_lsn[] NOT NULL,
            end_lsns    pg_lsn[] NOT NULL,
            CHECK (cardinality(commit_lsns) = cardinality(end_lsns))
        )
    """)
    op.execute("CREATE INDEX ON applier.change_commits USING brin (first_lsn, last_lsn)")
    op.execute("COMMENT ON TABLE applier.change_commits IS "
               "'The change feed (--change-feed): per slot, the source transactions that wrote "
               "change rows, as commit_lsns[i] ending at end_lsns[i], first_lsn to last_lsn, "
               "written in the target transaction of their change rows, pruned with the oldest "
               "partitions.'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.change_commits")
