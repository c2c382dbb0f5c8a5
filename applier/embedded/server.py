"""What every scratch-server backend offers, and the database operations they all share.

Owns: the ``PostgresServer`` interface (what tests, ``applier demo`` and benchmarks may use of a
running server, local or in a container), ``Database`` (one database on it with small synchronous
helpers), creating a database, and dropping one together with the replication slots, prepared
transactions and subscriptions that pin it. Must never start or stop a server, or touch a
database it was not asked to.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import psycopg
from psycopg import sql

__all__ = ["ClusterError", "Database", "PostgresServer", "StopMode", "create_database", "drop_database"]

StopMode = Literal["smart", "fast", "immediate"]


class ClusterError(RuntimeError):
    """A local cluster failed to initialise, start or stop (message includes the log tail)."""


@runtime_checkable
class PostgresServer(Protocol):
    """What tests, ``applier demo`` and benchmarks need from a running server."""

    name: str

    @property
    def version(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def pgbench_path(self) -> Path: ...
    @property
    def psql_path(self) -> Path: ...
    @property
    def log_path(self) -> Path | None: ...

    def dsn(self, dbname: str = "postgres") -> str: ...
    def start(self) -> None: ...
    def stop(self, mode: StopMode = "fast") -> None: ...
    def restart(self) -> None: ...
    def cleanup(self) -> None: ...
    def create_database(self, name: str) -> Database: ...
    def drop_database(self, name: str) -> None: ...


@dataclass
class Database:
    """One database on a server, with small synchronous helpers for tests and tools."""

    name: str
    dsn: str
    cluster: PostgresServer
    version: int

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A psycopg 3 connection (autocommit unless ``autocommit=False`` is given)."""
        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.dsn, **kwargs)

    def execute(self, query: str | sql.Composable, params: Sequence[Any] | Mapping[str, Any] | None = None) -> None:
        with self.connect() as conn:
            conn.execute(query, params)  # type: ignore[arg-type]

    def query(self, query: str | sql.Composable,
              params: Sequence[Any] | Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]


def create_database(admin_dsn: str, name: str) -> None:
    """``CREATE DATABASE name`` through the maintenance connection ``admin_dsn``."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(admin_dsn: str, dsn_for: Any, name: str, *, attempts: int = 5) -> None:
    """Drop ``name`` and everything pinning it; a missing database is fine.

    Order: terminate walsenders of the database's replication slots and drop
    those slots, roll back its prepared transactions, drop its subscriptions,
    then ``DROP DATABASE ... WITH (FORCE)`` (which terminates other backends).
    ``dsn_for(dbname)`` builds a DSN for a database on the same server.
    """
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                exists = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
                if not exists:
                    return
                _drop_slots(conn, name)
                gids = [r[0] for r in conn.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,))]
                subs = [r[0] for r in conn.execute(
                    "SELECT s.subname FROM pg_subscription s "
                    "JOIN pg_database d ON d.oid = s.subdbid WHERE d.datname = %s", (name,))]
                if gids or subs:
                    _clear_db_objects(dsn_for(name), gids, subs)
                    _drop_slots(conn, name)  # subscriptions may have created some
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                             .format(sql.Identifier(name)))
                return
        except psycopg.Error as exc:
            last = exc
            time.sleep(0.2 * (attempt + 1))
    raise ClusterError(f"could not drop database {name!r}: {last}") from last


def _drop_slots(conn: psycopg.Connection[Any], dbname: str) -> None:
    rows = conn.execute(
        "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
        (dbname,)).fetchall()
    for slot_name, pid in rows:
        if pid is not None:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        for i in range(50):
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot_name,))
                break
            except psycopg.errors.UndefinedObject:
                break
            except psycopg.errors.ObjectInUse:
                # the walsender is still exiting (or reconnected): terminate again
                active = conn.execute(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                    (slot_name,)).fetchone()
                if active and active[0] is not None:
                    conn.execute("SELECT pg_terminate_backend(%s, 5000)", (active[0],))
                time.sleep(0.05 * min(i + 1, 10))
        else:
            raise ClusterError(f"replication slot {slot_name!r} stays active")


def _clear_db_objects(dsn: str, gids: list[str], subs: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for gid in gids:
            try:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            except psycopg.errors.UndefinedObject:
                pass
        for sub in subs:
            ident = sql.Identifier(sub)
            conn.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(ident))
            conn.execute(sql.SQL("ALTER SUBSCRIPTION {} SET (slot_name = NONE)").format(ident))
            conn.execute(sql.SQL("DROP SUBSCRIPTION {}").format(ident))
