"""The source's column types as the worker last saw them, per slot and table.

Revision ID: 0011
Revises: 0010
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A Relation message describes a table's columns as of that point of the stream, and a
    # target column may differ from the source's on purpose; only a type that changed on the
    # source since the worker last saw it tells a type change from such a difference. Kept
    # here rather than in memory, so that a change made while the worker is stopped is seen.
    op.execute("""
        CREATE TABLE applier.source_columns (
            slot_name     text NOT NULL,
            table_schema  text NOT NULL,
            table_name    text NOT NULL,
            column_name   text NOT NULL,
            type_oid      oid  NOT NULL,
            type_modifier int4 NOT NULL,
            PRIMARY KEY (slot_name, table_schema, table_name, column_name)
        )
    """)
    op.execute("COMMENT ON TABLE applier.source_columns IS "
               "'--schema-changes follow: each replicated column''s source type (OID and "
               "modifier, as the Relation message gave them) when the worker last aligned the "
               "target table, written in that target transaction. A type seen to change since, "
               "that the target column cannot hold, stops the worker.'")


def downgrade() -> None:
    op.execute("DROP TABLE applier.source_columns")
