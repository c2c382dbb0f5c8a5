"""The bookkeeping schema: the ``applier`` schema on the target, created and upgraded from the
Alembic migrations in ``migrations/`` (serialised by an advisory lock so concurrent starts are
safe), and the SQLAlchemy engine the off-hot-path code uses. Must never read or write the
bookkeeping rows themselves (``postgres``, ``bookkeeping``).

SQLAlchemy and alembic take about a third of a second to import each, so neither is imported
with this module: ``ensure_schema`` (the worker's start) reads the schema's revision with one
psycopg query and loads them only when the schema must be created or upgraded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from ..connections import connect
from ..errors import ApplierError, Cause, TargetError, cause_of

if TYPE_CHECKING:
    from sqlalchemy import Connection, Engine

__all__ = ["LOCK_NAMESPACE", "MIGRATIONS_DIR", "SCHEMA_HEAD", "SchemaError", "ensure_schema",
           "make_engine", "upgrade_schema"]

#: The newest migration's revision (a unit test holds it to alembic's own head). A schema already
#: there needs neither alembic nor SQLAlchemy (``ensure_schema``).
SCHEMA_HEAD = "0011"

#: Advisory lock namespace (first key) for applier; the second key identifies what is locked.
LOCK_NAMESPACE = 0x4150504C  # 'APPL'
_MIGRATION_LOCK_KEY = 0

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "_migrations"
if not MIGRATIONS_DIR.is_dir():  # source checkout / editable install: the top-level folder
    MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaError(ApplierError):
    """The bookkeeping schema cannot be created or upgraded (a privilege, most often)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause=Cause.NEEDS_OPERATOR)


def make_engine(dsn: str) -> Engine:
    """SQLAlchemy engine over psycopg 3 for a libpq DSN in either URL or key=value form."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    return create_engine("postgresql+psycopg://", creator=lambda: connect(dsn),
                         poolclass=NullPool)


def upgrade_schema(engine: Engine) -> None:
    """Create or upgrade the ``applier`` schema to the newest migration.

    Two workers starting at once serialise on a transaction-level advisory lock; the second
    finds the schema current and does nothing.
    """
    import sqlalchemy.exc
    from sqlalchemy import text

    try:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:ns, :key)"),
                         {"ns": LOCK_NAMESPACE, "key": _MIGRATION_LOCK_KEY})
            if _revision(conn) == SCHEMA_HEAD:
                return
            # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema
            # exists: a least-privilege role that owns an existing applier schema must not need it.
            exists = conn.execute(text("SELECT 1 FROM pg_catalog.pg_namespace "
                                       "WHERE nspname = 'applier'")).first()
            if exists is None:
                conn.execute(text("CREATE SCHEMA applier"))
            from alembic import command  # only when there is something to upgrade (see SCHEMA_HEAD)
            from alembic.config import Config

            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS_DIR))
            config.attributes["connection"] = conn
            command.upgrade(config, "head")
    except sqlalchemy.exc.OperationalError as exc:  # the connection, not the schema
        raise _connection_failed(exc, exc.orig or exc) from exc
    except Exception as exc:  # alembic and SQLAlchemy raise many types; one clear message
        raise SchemaError(f"target: cannot create or upgrade the applier bookkeeping schema: {exc}. "
                          "The target role needs CREATE on the database (or an existing applier "
                          "schema it owns).") from exc


def ensure_schema(dsn: str) -> None:
    """The schema at ``SCHEMA_HEAD``, as ``upgrade_schema`` leaves it; on a target where it is
    already (every start but the first after an install or an upgrade) at the cost of one psycopg
    connection and query, without loading SQLAlchemy or alembic.

    Reading the revision outside the migration lock is safe: a migration and the revision it
    records commit together, so a schema showing ``SCHEMA_HEAD`` is complete. Anything else,
    including a revision that cannot be read (no schema, no privilege), goes through
    ``upgrade_schema``, which reports problems as it always has.
    """
    try:
        with connect(dsn, autocommit=True, application_name="applier schema") as conn:
            revision = conn.execute("SELECT version_num FROM applier.alembic_version").fetchone()
    except psycopg.OperationalError as exc:  # the connection, not the schema
        raise _connection_failed(exc, exc) from exc
    except psycopg.Error:  # no schema yet, or nothing this role may read: upgrade_schema says
        revision = None
    if revision is None or revision[0] != SCHEMA_HEAD:
        upgrade_schema(make_engine(dsn))


def _connection_failed(exc: Exception, orig: BaseException) -> TargetError:
    """The target could not be reached (``orig``: the driver's error behind ``exc``)."""
    cause = cause_of(exc)
    assert cause is not None
    return TargetError(f"target: {str(orig).strip()}", sqlstate=getattr(orig, "sqlstate", None),
                       cause=cause)


def _revision(conn: Connection) -> str | None:
    """The schema's current migration revision; None before the first migration."""
    from sqlalchemy import text

    if conn.execute(text("SELECT pg_catalog.to_regclass('applier.alembic_version')")).scalar() is None:
        return None
    return conn.execute(text("SELECT version_num FROM applier.alembic_version")).scalar()
