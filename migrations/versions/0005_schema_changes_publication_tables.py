"""Schema changes the worker made to follow the source, and the tables each slot publishes.

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE applier.schema_changes (
            id           bigserial   PRIMARY KEY,
            slot_name    text        NOT NULL,
            source_lsn   pg_lsn,
            table_schema text        NOT NULL,
            table_name   text        NOT NULL,
            kind         text        NOT NULL,
            statement    text        NOT NULL,
            applied_at   timestamptz NOT NULL DEFAULT clock_timestamp()
        )
    """)
    op.execute("CREATE INDEX schema_changes_by_slot ON applier.schema_changes (slot_name, id)")
    op.execute("COMMENT ON TABLE applier.schema_changes IS "
               "'Every change the worker made to a target table to follow the source''s schema "
               "(--schema-changes follow): added columns, widened types, dropped NOT NULLs, each "
               "in the target transaction of the first row change that needed it.'")
    op.execute("""
        CREATE TABLE applier.publication_tables (
            slot_name   text        NOT NULL,
            schema_name text        NOT NULL,
            table_name  text        NOT NULL,
            state       text        NOT NULL,
            changed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (slot_name, schema_name, table_name)
        )
    """)
    op.execute("COMMENT ON TABLE applier.publication_tables IS "
               "'The tables a slot''s publications publish, as the worker last saw them: "
               "published, copying (added to a publication, its rows being copied), or removed "
               "(no longer applied; its target rows are kept).'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.publication_tables")
    op.execute("DROP TABLE applier.schema_changes")
