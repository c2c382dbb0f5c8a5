"""Copy transactions: the target transactions in which ``applier sync`` copied table data.

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE applier.copy_transactions (
            slot_name text   NOT NULL,
            xid       bigint NOT NULL,
            PRIMARY KEY (slot_name, xid)
        )
    """)
    op.execute("COMMENT ON TABLE applier.copy_transactions IS "
               "'The 32-bit target xid of every committed initial-copy transaction of a slot. Rows "
               "they wrote carry no replication origin, yet they are the worker''s own data, not "
               "local writes: update_origin_differs detection treats them as the worker''s.'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.copy_transactions")
