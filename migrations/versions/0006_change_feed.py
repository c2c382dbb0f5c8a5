"""The change feed's registry: the change table of each recorded source table, and its partitions.

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE applier.change_tables (
            id             serial      NOT NULL UNIQUE,
            slot_name      text        NOT NULL,
            table_schema   text        NOT NULL,
            table_name     text        NOT NULL,
            change_table   text        NOT NULL UNIQUE,
            created_lsn    pg_lsn      NOT NULL,
            created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
            retained_after pg_lsn      NOT NULL,
            stopped_lsn    pg_lsn,
            PRIMARY KEY (slot_name, table_schema, table_name)
        )
    """)
    op.execute("COMMENT ON TABLE applier.change_tables IS "
               "'The change feed (--change-feed): per slot and source table, its change table in "
               "schema applier_changes. Every change committed after retained_after is there, "
               "up to stopped_lsn when the feed of that table was switched off; history starts "
               "again at created_lsn when it is switched on again or the table copied anew.'")
    op.execute("""
        CREATE TABLE applier.change_partitions (
            change_table   text        NOT NULL,
            partition_name text        NOT NULL UNIQUE,
            from_lsn       pg_lsn      NOT NULL,
            to_lsn         pg_lsn      NOT NULL,
            opened_lsn     pg_lsn      NOT NULL,
            created_at     timestamptz NOT NULL,
            PRIMARY KEY (change_table, from_lsn)
        )
    """)
    op.execute("COMMENT ON TABLE applier.change_partitions IS "
               "'The regular partitions of each change table: commit LSNs [from_lsn, to_lsn), "
               "created at created_at for a change committed at opened_lsn. Retention drops the "
               "oldest once the next one is older than --change-feed-retention.'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.change_partitions")
    op.execute("DROP TABLE applier.change_tables")
