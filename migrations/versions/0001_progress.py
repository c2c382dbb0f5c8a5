"""Progress: the last source transaction applied per slot.

Revision ID: 0001
Revises:
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE applier.progress (
            slot_name   text PRIMARY KEY,
            commit_lsn  pg_lsn NOT NULL,
            end_lsn     pg_lsn NOT NULL,
            commit_time timestamptz,
            applied_at  timestamptz NOT NULL DEFAULT now()
        )
    """)
    op.execute("COMMENT ON TABLE applier.progress IS "
               "'Last source transaction applied per replication slot; written in the same "
               "target transaction as the data it covers.'")
