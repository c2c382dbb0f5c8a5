"""The source relation of each followed table: a rename on the source is not a new table.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL until the worker next reads the publications (it fills it in by name then).
    op.execute("ALTER TABLE applier.publication_tables ADD COLUMN relid oid")
    op.execute("COMMENT ON COLUMN applier.publication_tables.relid IS "
               "'The table''s OID on the source: it keeps it across ALTER TABLE ... RENAME and "
               "SET SCHEMA, and the worker follows the new name instead of copying it again.'")


def downgrade() -> None:
    op.execute("ALTER TABLE applier.publication_tables DROP COLUMN relid")
