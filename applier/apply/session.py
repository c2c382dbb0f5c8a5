"""The target session: one libpq connection driven at the protocol level for the hot path.

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

from ..source.stream import is_permanent
from .statements import Statement

__all__ = ["TargetSession", "TargetError", "transient_sqlstate"]

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_CONNECTION_SQLSTATE_CLASSES = ("08", "57")  # connection exceptions, operator intervention
#: A lock wait that timed out (lock_timeout, set while a transaction is applied as it streams) or a
#: deadlock: another attempt can succeed.
_LOCK_SQLSTATES = ("55P03", "40P01")


def transient_sqlstate(sqlstate: str | None) -> bool:
    """Whether a statement that failed with ``sqlstate`` may succeed on a new attempt."""
    return bool(sqlstate) and (sqlstate[:2] in _CONNECTION_SQLSTATE_CLASSES  # type: ignore[index]
                               or sqlstate in _LOCK_SQLSTATES)


class TargetError(Exception):
    """A target-side failure; ``transient`` when a reconnect and retry can succeed."""

    def __init__(self, message: str, *, sqlstate: str | None, transient: bool) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.transient = transient


class TargetSession:
    def __init__(self, dsn: str, application_name: str, synchronous_commit: str = "on") -> None:
        try:
            self.conn = psycopg.connect(dsn, autocommit=True, application_name=application_name)
        except psycopg.OperationalError as exc:
            # Authentication and a missing database need an operator; anything else may pass.
            raise TargetError(f"target: cannot connect: {str(exc).strip()}", sqlstate=exc.sqlstate,
                              transient=not is_permanent(exc)) from exc
        self.pgconn = self.conn.pgconn
        self._prepared: set[bytes] = set()
        #: Set while statements sent in a pipeline have results not read yet: called before any
        #: other statement, which could not be sent before those results are read.
        self.pending: Callable[[], None] | None = None
        try:
            self.sql("SET session_replication_role = replica")
        except TargetError as exc:
            if exc.sqlstate != "42501":
                raise
            role = self.conn.info.user
            raise TargetError(f"{exc}. The target role may not act as a replica: run GRANT SET ON "
                              f"PARAMETER session_replication_role TO \"{role}\" as a superuser "
                              "(PostgreSQL 15+)", sqlstate=exc.sqlstate, transient=False) from exc
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
            message = self.pgconn.get_error_message() if hasattr(self.pgconn, "get_error_message") \
                else self.pgconn.error_message.decode(errors="replace")
            raise TargetError(f"target: connection lost during {what}: {message.strip()}",
                              sqlstate=None, transient=True)
        raw_state = result.error_field(pq.DiagnosticField.SQLSTATE)
        sqlstate = raw_state.decode() if raw_state else None
        message = result.error_message.decode(errors="replace").strip()
        transient = transient_sqlstate(sqlstate)
        raise TargetError(f"target: {what} failed: {message}", sqlstate=sqlstate, transient=transient)

    def sql(self, sql: str, values: Sequence[bytes | None] | None = None) -> pq.abc.PGresult:
        """Run one statement with text parameters (bookkeeping, transaction control)."""
        if self.pending is not None:
            self.pending()
        try:
            result = self.pgconn.exec_params(sql.encode(), values or [], result_format=0)
        except psycopg.Error as exc:  # libpq refused to send: the connection is not usable
            raise TargetError(f"target: {exc}", sqlstate=None, transient=True) from exc
        return self._check(result, sql.split(None, 1)[0])

    def execute(self, sql: str, values: Sequence[bytes | None] = (),
                formats: Sequence[int] | None = None, binary_result: bool = False) -> pq.abc.PGresult:
        """Run one unnamed statement with per-parameter formats (bookkeeping with bytea values)."""
        if self.pending is not None:
            self.pending()
        result = self.pgconn.exec_params(sql.encode(), list(values), None, formats,
                                         1 if binary_result else 0)
        return self._check(result, sql.split(None, 1)[0])

    def run(self, statement: Statement, values: Sequence[bytes | None],
            formats: Sequence[int]) -> pq.abc.PGresult:
        """Execute a cached statement, preparing it on first use in this session."""
        if self.pending is not None:
            self.pending()
        try:
            if statement.name not in self._prepared:
                self._check(self.pgconn.prepare(statement.name, statement.sql.encode()),
                            f"preparing {statement.sql}")
                self._prepared.add(statement.name)
            result = self.pgconn.exec_prepared(statement.name, values, formats)
        except psycopg.Error as exc:
            raise TargetError(f"target: {exc}", sqlstate=None, transient=True) from exc
        return self._check(result, statement.sql)

    def flush_wal(self, slot: str) -> bool:
        """Make every commit that has returned durable now, rather than when the WAL writer gets
        to it (synchronous_commit = off): the slot's progress row is written again, unchanged,
        in a transaction committed with synchronous_commit on, so COMMIT returns once the WAL up
        to its commit record, and so everything before it, is on disk. (A transaction that
        writes no WAL commits without a flush.) False, and nothing flushed, without that row."""
        self.sql("BEGIN")
        self.sql("SET LOCAL synchronous_commit = on")
        written = self.sql("UPDATE applier.progress SET applied_at = applied_at WHERE slot_name = $1",
                           [slot.encode()]).command_tuples
        self.sql("COMMIT")
        return written == 1

    def flushed_wal_lsn(self) -> str:
        """The target's WAL position known durable on disk (for synchronous_commit = off)."""
        return self.sql("SELECT pg_catalog.pg_current_wal_flush_lsn()").get_value(0, 0).decode()

    @property
    def in_transaction(self) -> bool:
        return self.pgconn.transaction_status != pq.TransactionStatus.IDLE
