"""Progress stage: the bookkeeping schema on the target and what it records.

Owns the ``applier`` schema (created and upgraded from the Alembic migrations in ``migrations/``,
serialised by an advisory lock so concurrent starts are safe), reading the recorded position of
a slot, and the single-worker lock per slot. Must never apply row changes; the progress row itself
is written by the apply stage inside the data's own transaction.
"""

from .store import (
    AlreadyRunning, SchemaError, WorkerLock, make_engine, read_position, upgrade_schema,
)

__all__ = ["AlreadyRunning", "SchemaError", "WorkerLock", "make_engine", "read_position",
           "upgrade_schema"]
