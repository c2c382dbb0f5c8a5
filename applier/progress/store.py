"""Bookkeeping schema upgrades, recorded positions and the per-slot worker lock."""

from __future__ import annotations

import zlib
from pathlib import Path

import psycopg
import sqlalchemy.exc
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.pool import NullPool

from ..apply.session import TargetError
from ..source.stream import is_permanent

__all__ = ["AlreadyRunning", "SchemaError", "WorkerLock", "make_engine", "upgrade_schema",
           "MIGRATIONS_DIR", "SCHEMA_HEAD"]

#: The newest migration's revision (a unit test holds it to alembic's own head). A schema already
#: there needs no alembic at all, which saves loading it (a third of a second) at every start.
SCHEMA_HEAD = "0004"

#: Advisory lock namespace (first key) for applier; the second key identifies what is locked.
_LOCK_NAMESPACE = 0x4150504C  # 'APPL'
_MIGRATION_LOCK_KEY = 0

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "_migrations"
if not MIGRATIONS_DIR.is_dir():  # source checkout / editable install: the top-level folder
    MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaError(RuntimeError):
    pass


class AlreadyRunning(RuntimeError):
    pass


def make_engine(dsn: str) -> Engine:
    """SQLAlchemy engine over psycopg 3 for a libpq DSN in either URL or key=value form."""
    return create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn),
                         poolclass=NullPool)


def upgrade_schema(engine: Engine) -> None:
    """Create or upgrade the ``applier`` schema to the newest migration.

    Two workers starting at once serialise on a transaction-level advisory lock; the second
    finds the schema current and does nothing.
    """
    try:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:ns, :key)"),
                         {"ns": _LOCK_NAMESPACE, "key": _MIGRATION_LOCK_KEY})
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
        raise TargetError(f"target: {str(exc.orig or exc).strip()}",
                          sqlstate=getattr(orig, "sqlstate", None),
                          transient=orig is None or not is_permanent(orig)) from exc
    except Exception as exc:  # alembic and SQLAlchemy raise many types; one clear message
        raise SchemaError(f"target: cannot create or upgrade the applier bookkeeping schema: {exc}. "
                          "The target role needs CREATE on the database (or an existing applier "
                          "schema it owns).") from exc


def _revision(conn: Connection) -> str | None:
    """The schema's current migration revision; None before the first migration."""
    if conn.execute(text("SELECT pg_catalog.to_regclass('applier.alembic_version')")).scalar() is None:
        return None
    return conn.execute(text("SELECT version_num FROM applier.alembic_version")).scalar()


class WorkerLock:
    """A session advisory lock per slot on the target: one worker per slot and target, ever.

    Held on its own connection for the worker's lifetime; PostgreSQL releases it if that
    connection dies, so a crashed worker never blocks its successor.
    """

    def __init__(self, dsn: str, slot: str) -> None:
        self.dsn = dsn
        self.slot = slot
        self._conn: psycopg.Connection | None = None

    def acquire(self) -> None:
        conn = psycopg.connect(self.dsn, autocommit=True, application_name=f"applier lock {self.slot}")
        key = self._key()
        got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (_LOCK_NAMESPACE, key)).fetchone()
        if not got or not got[0]:
            holder = conn.execute(
                "SELECT a.pid, a.application_name, a.client_addr FROM pg_locks l "
                "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
                "AND l.classid = %s::oid AND l.objid = %s::oid AND l.granted",
                (_LOCK_NAMESPACE, key & 0xFFFFFFFF)).fetchone()
            conn.close()
            who = f" (target backend pid {holder[0]}, {holder[1]!r})" if holder else ""
            raise AlreadyRunning(f"another applier worker is already running for slot {self.slot!r} "
                                 f"on this target{who}; stop it first")
        self._conn = conn

    def release(self) -> None:
        if self._conn is not None:
            # Unlocked before closing: the server ends a closed session a moment later, and a
            # worker taking over at once (applier sync hands over to it) would find it still held.
            try:
                self._conn.execute("SELECT pg_advisory_unlock(%s, %s)", (_LOCK_NAMESPACE, self._key()))
            except psycopg.Error:
                pass  # a connection already lost holds no lock
            self._conn.close()
            self._conn = None

    def _key(self) -> int:
        return zlib.crc32(self.slot.encode()) - 2**31  # advisory keys are signed int4
