"""Progress stage: the bookkeeping schema on the target and everything recorded in it.

Owns the ``applier`` schema (``schema``: created and upgraded from the Alembic migrations), every
read and write of its tables (the interface in ``store``, its PostgreSQL implementations
``postgres`` for the apply session and ``bookkeeping`` for everything off the hot path, and the
in-memory twin ``memory``), the single-worker lock (``lock``) and the rule deciding which source
position may be confirmed (``flush``). Must never apply row changes. Import the modules
themselves: this package imports nothing, so that reading a position does not load SQLAlchemy.
"""
