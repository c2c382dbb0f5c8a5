"""The oracle's dealings with its two servers: connections that wait out a server's recovery,
what a server logged during an example (a crashed process, the native apply worker's error),
and the replication origins an example's workers leave behind.

PostgreSQL's own subscriber can crash (its apply worker killed by a signal); the postmaster then
restarts every session of the server, so every connection here reconnects once the server
accepts connections again rather than failing the example.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from applier.embedded import PostgresServer

__all__ = ["COMPARE_SETUP", "RECOVERY_SECONDS", "ServerLog", "Sessions", "connect", "drop_origins",
           "execute", "is_subscriber_crash", "sessions"]

#: How long a server may take to accept connections again after a crash.
RECOVERY_SECONDS = 120.0
#: Settings of every comparing session, so that text forms are the same on every database.
COMPARE_SETUP = ("SET TimeZone = 'UTC'", "SET extra_float_digits = 3", "SET DateStyle = 'ISO'",
                 "SET IntervalStyle = 'postgres'")


def connect(dsn: str) -> psycopg.Connection:
    """An autocommit connection, once the server accepts connections (it may be recovering)."""
    deadline = time.monotonic() + RECOVERY_SECONDS
    while True:
        try:
            return psycopg.connect(dsn, autocommit=True)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def execute(dsn: str, *statements: str) -> None:
    with connect(dsn) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


class Sessions:
    """A comparing session per database, each opened again when a server restart ended it."""

    def __init__(self, server: PostgresServer, databases: dict[str, str]) -> None:
        self.server = server
        self.databases = databases
        self._open: dict[str, psycopg.Connection] = {}

    def query(self, name: str, statement: str) -> list[tuple]:
        """The rows of ``statement`` on database ``name`` (none for a command); a server that
        restarts meanwhile (a crash loop restarts it several times) is waited for."""
        deadline = time.monotonic() + RECOVERY_SECONDS
        while True:
            conn = self._open.get(name)
            try:
                if conn is None or conn.closed:
                    conn = self._open[name] = connect(self.server.dsn(self.databases[name]))
                    for setup in COMPARE_SETUP:
                        conn.execute(setup)  # type: ignore[arg-type]
                cursor = conn.execute(statement)  # type: ignore[arg-type]
                return cursor.fetchall() if cursor.description is not None else []
            except psycopg.OperationalError:
                if conn is not None:
                    conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        for conn in self._open.values():
            conn.close()


@contextmanager
def sessions(server: PostgresServer, databases: dict[str, str]) -> Iterator[Sessions]:
    opened = Sessions(server, databases)
    try:
        yield opened
    finally:
        opened.close()


class ServerLog:
    """What a server logged since ``mark``."""

    def __init__(self, server: PostgresServer) -> None:
        self.server = server
        self.start = 0
        self.mark()

    def mark(self) -> None:
        log = self.server.log_path
        self.start = log.stat().st_size if log is not None and log.exists() else 0

    def lines(self) -> list[str]:
        log = self.server.log_path
        if log is None:
            return []
        with open(log, "rb") as file:
            file.seek(self.start)
            return file.read().decode(errors="replace").splitlines()

    def crashes(self) -> list[str]:
        """Each process that crashed since the mark, with what the server logged before it."""
        lines = self.lines()
        return ["\n".join(lines[max(0, i - 20):i + 1]) for i, line in enumerate(lines)
                if "terminated by signal" in line or "PANIC:" in line]

    def apply_error(self) -> str | None:
        """The native apply worker's error since the mark, and what it was applying."""
        lines = self.lines()
        for error, context in zip(lines, lines[1:]):
            if "ERROR:" in error and "processing remote data" in context:
                return (error.partition("ERROR:")[2].strip() + " ("
                        + context.partition("CONTEXT:")[2].strip() + ")")
        return None


    def walsender_error(self, slot: str) -> str | None:
        """The error a walsender streaming ``slot`` ended with since the mark: PostgreSQL's
        decoder refusing the slot's WAL, which no consumer of it gets past."""
        lines = self.lines()
        statement = f'START_REPLICATION SLOT "{slot}"'
        for error, context in zip(lines, lines[1:]):
            if "ERROR:" in error and statement in context:
                return error.partition("ERROR:")[2].strip()
        return None


def is_subscriber_crash(crash: str) -> bool:
    """A crash of PostgreSQL's apply worker (or one of its parallel apply workers)."""
    return 'background worker "logical replication' in crash.splitlines()[-1]


def drop_origins(server: PostgresServer, databases: list[str]) -> None:
    """Drop the replication origins workers made for ``databases`` (applier_<slot>_<db>): they
    are server-wide, and PostgreSQL 18 keeps few."""
    with connect(server.dsn()) as conn:
        for database in databases:
            for (origin,) in conn.execute(
                    "SELECT roname FROM pg_replication_origin WHERE roname LIKE 'applier%%' "
                    "AND right(roname, %s) = %s", (len(database) + 1, "_" + database)).fetchall():
                conn.execute("SELECT pg_replication_origin_drop(%s)", (origin,))
