"""The bookkeeping schema: the ``applier`` schema on the target, created and upgraded from the
Alembic migrations in ``migrations/`` (serialised by an advisory lock so concurrent starts are
safe), and the SQLAlchemy engine the off-hot-path code uses. Must never read or write the
bookkeeping rows themselves (``postgres``, ``bookkeeping``)."""

from __future__ import annotations

from pathlib import Path

import psycopg
import sqlalchemy.exc
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.pool import NullPool

from ..connections import connect
from ..errors import ApplierError, Cause, TargetError, cause_of

__all__ = ["LOCK_NAMESPACE", "MIGRATIONS_DIR", "SCHEMA_HEAD", "SchemaError", "make_engine",
           "upgrade_schema"]

#: The newest migration's revision (a unit test holds it to alembic's own head). A schema already
#: there needs no alembic at all, which saves loading it (a third of a second) at every start.
SCHEMA_HEAD = "0006"

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
    return create_engine("postgresql+psycopg://", creator=lambda: connect(dsn),
                         poolclass=NullPool)


def upgrade_schema(engine: Engine) -> None:
    """Create or upgrade the ``applier`` schema to the newest migration.

    Two workers starting at once serialise on a transaction-level advisory lock; the second
    finds the schema current and does nothing.
    """
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
        orig = exc.orig if isinstance(exc.orig, psycopg.Error) else None
        cause = cause_of(exc)
        assert cause is not None
        raise TargetError(f"target: {str(exc.orig or exc).strip()}",
                          sqlstate=getattr(orig, "sqlstate", None), cause=cause) from exc
    except Exception as exc:  # alembic and SQLAlchemy raise many types; one clear message
        raise SchemaError(f"target: cannot create or upgrade the applier bookkeeping schema: {exc}. "
                          "The target role needs CREATE on the database (or an existing applier "
                          "schema it owns).") from exc


def _revision(conn: Connection) -> str | None:
    """The schema's current migration revision; None before the first migration."""
    if conn.execute(text("SELECT pg_catalog.to_regclass('applier.alembic_version')")).scalar() is None:
        return None
    return conn.execute(text("SELECT version_num FROM applier.alembic_version")).scalar()
