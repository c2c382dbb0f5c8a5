"""The target session: one libpq connection driven at the protocol level for the hot path.

Owns the connection and its settings, running statements (prepared once per session, values as
bytes), turning every failure into a ``TargetError`` keyed by its SQLSTATE, and opening pipelines
on it. A transaction begun is only sent as BEGIN with the first statement after it, in the same
pipeline when that statement goes in one, so a fast-path batch costs no round trip of its own to
begin. Must never decide what to run, or when a transaction begins or ends.

Values arrive as bytes and leave as bytes: statements are prepared once and executed with the
raw parameter values and their formats (text 0 / binary 1), so psycopg's Python-level adaptation
never touches a row. The session runs like PostgreSQL's own apply worker: replica role (replica
triggers fire, FK checks are skipped) and an empty search_path, so no user function or operator
can hijack a statement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import psycopg
from psycopg import pq

from ..connections import connect
from ..errors import Cause, TargetError, cause_of, cause_of_sqlstate
from ..protocol.lsn import LSN
from .fast.pipeline import Pipeline, Preparable

__all__ = ["Preparable", "TargetSession"]

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


def _lost(what: str, message: str) -> TargetError:
    return TargetError(f"target: connection lost during {what}: {message.strip()}",
                       cause=Cause.LOST_CONNECTION)


class TargetSession:
    def __init__(self, dsn: str, application_name: str, synchronous_commit: str = "on") -> None:
        try:
            self.conn = connect(dsn, autocommit=True, application_name=application_name)
        except psycopg.OperationalError as exc:
            # Authentication and a missing database need an operator; anything else may pass.
            raise TargetError(f"target: cannot connect: {str(exc).strip()}", sqlstate=exc.sqlstate,
                              cause=cause_of(exc) or Cause.LOST_CONNECTION) from exc
        self.pgconn = self.conn.pgconn
        self._prepared: set[bytes] = set()
        #: Set while statements sent in a pipeline have results not read yet: called before any
        #: other statement, which could not be sent before those results are read.
        self.pending: Callable[[], None] | None = None
        # A transaction begun (``begin``) whose BEGIN is not sent yet: it goes with the next statement.
        self._begin_owed = False
        try:
            self.sql("SET session_replication_role = replica")
        except TargetError as exc:
            if exc.sqlstate != "42501":
                raise
            role = self.conn.info.user
            raise TargetError(f"{exc}. The target role may not act as a replica: run GRANT SET ON "
                              f"PARAMETER session_replication_role TO \"{role}\" as a superuser "
                              "(PostgreSQL 15+)", sqlstate=exc.sqlstate,
                              cause=Cause.NEEDS_OPERATOR) from exc
        for setting in ("SELECT pg_catalog.set_config('search_path', '', false)",
                        "SET datestyle = ISO", "SET intervalstyle = postgres",
                        f"SET synchronous_commit = {'off' if synchronous_commit == 'off' else 'on'}"):
            self.sql(setting)
        self.server_encoding = self.conn.info.parameter_status("server_encoding") or "UTF8"
        self.backend_pid = self.pgconn.backend_pid

    def close(self) -> None:
        self.conn.close()

    def _check(self, result: pq.abc.PGresult | None, what: str) -> pq.abc.PGresult:
        if result is not None and result.status in _OK:
            return result
        if result is None or self.pgconn.status != pq.ConnStatus.OK:
            raise _lost(what, self.pgconn.get_error_message())
        raw_state = result.error_field(pq.DiagnosticField.SQLSTATE)
        sqlstate = raw_state.decode() if raw_state else None
        message = result.error_message.decode(errors="replace").strip()
        cause = cause_of_sqlstate(sqlstate, side="target") if sqlstate else Cause.REFUSED_DATA
        raise TargetError(f"target: {what} failed: {message}", sqlstate=sqlstate, cause=cause)

    def begin(self) -> None:
        """Open a transaction: BEGIN goes with the next statement (or pipeline). What a pipeline
        left in flight is read first, as before any statement: ``pending`` may be another
        session's hand-over (early streaming apply), which must happen when this session's
        transaction begins, not only when it first sends something, or the other session could
        commit a later source transaction before this one."""
        if self.pending is not None:
            self.pending()
        assert not self.in_transaction, "BEGIN inside a transaction"
        self._begin_owed = True

    def rollback(self) -> None:
        """Roll back the open transaction, if any (one begun and not sent yet is just forgotten)."""
        if self._begin_owed:
            self._begin_owed = False
        elif self.in_transaction:
            self.sql("ROLLBACK")

    def _ready(self) -> None:
        """Before a statement of its own: read what a pipeline left in flight, send an owed BEGIN."""
        if self.pending is not None:
            self.pending()
        if self._begin_owed:
            self._begin_owed = False
            self._check(self.pgconn.exec_(b"BEGIN"), "BEGIN")

    def sql(self, sql: str, values: Sequence[bytes | None] | None = None) -> pq.abc.PGresult:
        """Run one statement with text parameters (bookkeeping, transaction control)."""
        self._ready()
        try:
            result = self.pgconn.exec_params(sql.encode(), values or [], result_format=0)
        except psycopg.Error as exc:  # libpq refused to send: the connection is not usable
            raise _lost(sql.split(None, 1)[0], str(exc)) from exc
        return self._check(result, sql.split(None, 1)[0])

    def execute(self, sql: str, values: Sequence[bytes | None] = (),
                formats: Sequence[int] | None = None, binary_result: bool = False) -> pq.abc.PGresult:
        """Run one unnamed statement with per-parameter formats (bookkeeping with bytea values)."""
        self._ready()
        try:
            result = self.pgconn.exec_params(sql.encode(), list(values), None, formats,
                                             1 if binary_result else 0)
        except psycopg.Error as exc:
            raise _lost(sql.split(None, 1)[0], str(exc)) from exc
        return self._check(result, sql.split(None, 1)[0])

    def run(self, statement: Preparable, values: Sequence[bytes | None],
            formats: Sequence[int]) -> pq.abc.PGresult:
        """Execute a cached statement, preparing it on first use in this session."""
        self._ready()
        try:
            if statement.name not in self._prepared:
                self._check(self.pgconn.prepare(statement.name, statement.sql.encode()),
                            f"preparing {statement.sql}")
                self._prepared.add(statement.name)
            # libpq takes NULL for a NULL value; psycopg's stubs leave None out of the type.
            result = self.pgconn.exec_prepared(statement.name, values, formats)  # type: ignore[arg-type]
        except psycopg.Error as exc:
            raise _lost(statement.sql.split(None, 1)[0], str(exc)) from exc
        return self._check(result, statement.sql)

    def _lsn(self, function: str) -> LSN:
        value = self.sql(f"SELECT pg_catalog.{function}()").get_value(0, 0)
        assert value is not None
        return LSN.parse(value.decode())

    def flushed_wal_lsn(self) -> LSN:
        """The target's WAL position known durable on disk (for synchronous_commit = off)."""
        return self._lsn("pg_current_wal_flush_lsn")

    def current_wal_insert_lsn(self) -> LSN:
        """Where the target's WAL ends now: a commit just made is durable once it is flushed here."""
        return self._lsn("pg_current_wal_insert_lsn")

    def pipeline(self) -> Pipeline:
        """A pipeline on this connection (not yet entered); it sends an owed BEGIN first, and
        prepares the statements it ``run``s that this session has not prepared yet."""
        if self.pending is not None:
            self.pending()
        begin, self._begin_owed = self._begin_owed, False
        return Pipeline(self.pgconn, self._prepared, begin=begin)

    @property
    def closed(self) -> bool:
        return self.conn.closed or self.conn.broken

    @property
    def in_transaction(self) -> bool:
        return self._begin_owed or self.pgconn.transaction_status != pq.TransactionStatus.IDLE
