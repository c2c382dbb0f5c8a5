"""Progress stage: the bookkeeping schema on the target and what it records.

Owns the ``applier`` schema (created and upgraded from the Alembic migrations in ``migrations/``,
serialised by an advisory lock so concurrent starts are safe: ``store``), reading the recorded
position of a slot (``position``, with psycopg alone), and the single-worker lock per slot
(``store``). Must never apply row changes; the progress row itself is written by the apply stage
inside the data's own transaction. Import the modules themselves: this package imports nothing,
so that reading a position does not load SQLAlchemy.
"""
