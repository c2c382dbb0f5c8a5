"""Repairs of a running replica: the position a verify or repair asks the worker to hold at, and
the record of every table copied again (resync) or whose rows were repaired.

Revision ID: 0009
Revises: 0008
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # One request per slot at a time (the command holds an advisory lock while it has one). The
    # command raises ``step`` each time it changes the request; the worker answers a step by
    # setting ``acked_step`` to it once it holds as asked.
    op.execute("""
        CREATE TABLE applier.position_holds (
            slot_name          text        PRIMARY KEY,
            purpose            text        NOT NULL,
            owner_pid          int         NOT NULL,
            step               int         NOT NULL,
            hold_lsn           pg_lsn,
            expires_at         timestamptz NOT NULL,
            acked_step         int,
            frontier_lsn       pg_lsn,
            applied_commit_lsn pg_lsn,
            acked_at           timestamptz,
            requested_at       timestamptz NOT NULL DEFAULT clock_timestamp()
        )
    """)
    op.execute("COMMENT ON TABLE applier.position_holds IS "
               "'A running applier verify or verify --repair asking the slot''s worker to stop "
               "before the first source transaction committing at or after hold_lsn (NULL: at the "
               "next transaction boundary), so that the target holds exactly what the source did "
               "at that position. The worker answers step by setting acked_step; it lets go when "
               "the row is deleted, its owner''s session (owner_pid, holding the hold advisory "
               "lock) is gone, or expires_at has passed.'")
    op.execute("""
        CREATE TABLE applier.repairs (
            id           bigserial   PRIMARY KEY,
            slot_name    text        NOT NULL,
            kind         text        NOT NULL CHECK (kind IN ('repair', 'resync')),
            schema_name  text        NOT NULL,
            table_name   text        NOT NULL,
            state        text        NOT NULL CHECK (state IN ('requested', 'copying', 'done')),
            source_lsn   pg_lsn,
            keys         jsonb,
            inserted     bigint,
            updated      bigint,
            deleted      bigint,
            requested_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            started_at   timestamptz,
            finished_at  timestamptz
        )
    """)
    op.execute("CREATE INDEX repairs_by_slot ON applier.repairs (slot_name, id)")
    op.execute("COMMENT ON TABLE applier.repairs IS "
               "'What applier resync and applier verify --repair did to a target table: resync "
               "(the whole table emptied and copied again from a snapshot whose position is "
               "source_lsn) or repair (the rows of the listed keys, or [low, high] key ranges, "
               "written as the source had them at source_lsn).'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.repairs")
    op.execute("DROP TABLE applier.position_holds")
