"""Alembic environment for applier's bookkeeping schema on the target.

The caller (applier.progress.schema.upgrade) passes an open SQLAlchemy connection, already inside
a transaction that holds the migration advisory lock, in ``config.attributes['connection']``.
"""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, version_table="alembic_version",
                  version_table_schema="applier", transactional_ddl=True)
with context.begin_transaction():
    context.run_migrations()
