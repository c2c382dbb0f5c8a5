"""Table sync: per-table state of the initial copy made by ``applier sync``.

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE applier.table_sync (
            slot_name    text NOT NULL,
            schema_name  text NOT NULL,
            table_name   text NOT NULL,
            state        text NOT NULL CHECK (state IN ('copying', 'done')),
            sync_lsn     pg_lsn,
            rows_copied  bigint,
            bytes_copied bigint,
            started_at   timestamptz NOT NULL DEFAULT now(),
            finished_at  timestamptz,
            PRIMARY KEY (slot_name, schema_name, table_name),
            CHECK (state <> 'done' OR sync_lsn IS NOT NULL)
        )
    """)
    op.execute("COMMENT ON TABLE applier.table_sync IS "
               "'Initial copy per published table and slot: copying (the target table may hold a "
               "partial copy and is truncated before it is redone) or done, with the source LSN "
               "the copy reflects: changes to the table in source transactions committed before "
               "it are already in the copy and are skipped by the apply.'")

