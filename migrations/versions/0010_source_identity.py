"""The source server each slot's progress comes from, so that a failover is followed safely.

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE applier.source_identity (
            slot_name         text        PRIMARY KEY,
            system_identifier text        NOT NULL,
            timeline          integer     NOT NULL,
            recorded_at       timestamptz NOT NULL DEFAULT clock_timestamp()
        )
    """)
    op.execute("COMMENT ON TABLE applier.source_identity IS "
               "'The source server a slot''s progress comes from: its system identifier (a "
               "physical standby shares its primary''s) and timeline. A worker reaching another "
               "server (after a failover) checks the target''s position against that server''s "
               "timeline history before it streams, and records it here once it may go on.'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.source_identity")
