"""libpq pipeline mode on the target session: many statements per network round trip.

Statements are sent without waiting for their results; ``sync()`` ends the batch and reads every
result back in order, or ``send_sync()`` ends it and ``finish()`` reads the results later, so the
server works on one batch while the caller prepares the next. Each queued statement may carry
the row count it must affect: the fast apply path knows exactly what each statement should do
(one row per update, n rows per n-row insert), and any difference is reported as
``RowCountMismatch`` after the whole batch was read, so the caller can roll back and redo that
stretch carefully. Must never decide what to send or when to commit: it only moves statements
and results.

Statements are buffered and written to the socket together: at a sync point, every
``FLUSH_EVERY`` statements, and whenever libpq's buffer grows past its own threshold (64 kB), so a
batch of a few statements costs one write, not one per message. Sending and reading interleave
(non-blocking socket, flush, consume input) so a long pipeline never deadlocks on full socket
buffers in both directions.
"""

from __future__ import annotations

import select
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from psycopg import pq

from ...errors import Cause, TargetError, cause_of_sqlstate

__all__ = ["FLUSH_EVERY", "Pipeline", "PipelineError", "Preparable", "RowCountMismatch"]

#: Statements queued before they are written to the socket even without a sync point: the server
#: starts on a long batch while the rest is still being queued.
FLUSH_EVERY = 32

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_SYNC = pq.ExecStatus.PIPELINE_SYNC
_ABORTED = pq.ExecStatus.PIPELINE_ABORTED


class PipelineError(TargetError):
    """A statement of the batch failed; the transaction is aborted on the server."""


class RowCountMismatch(Exception):
    """A statement affected another number of rows than expected (a conflict somewhere)."""


def _abbreviate(sql: str, limit: int = 160) -> str:
    """Statement text for messages: multi-row statements run to many kilobytes."""
    return sql if len(sql) <= limit else f"{sql[:limit]}... ({len(sql)} characters)"


class Preparable(Protocol):
    """A statement prepared under ``name`` the first time a session runs it."""

    @property
    def name(self) -> bytes: ...

    @property
    def sql(self) -> str: ...


@dataclass(slots=True)
class _Queued:
    what: str                # for error messages: the SQL text
    expected_rows: int | None
    on_value: Callable[[bytes | None], None] | None = None  # receives the first value returned
    prepared: bytes | None = None  # a statement prepared: its name, known to the session once done


class Pipeline:
    """Use as a context manager (results all read by ``sync()`` inside), or ``open()`` it, send,
    ``send_sync()`` and leave it in flight: the server works through the batch while the caller
    prepares the next one, and ``finish()`` reads the outcome later (``abandon()`` on failure)."""

    def __init__(self, pgconn: pq.abc.PGconn, prepared: set[bytes] | None = None, *,
                 begin: bool = False) -> None:
        self.pgconn = pgconn
        # The session's prepared statements: one this pipeline prepares joins them only once the
        # server said it is done (a statement after an error in the pipeline is never run).
        self._session_prepared = prepared if prepared is not None else set()
        self._preparing: set[bytes] = set()
        self._begin = begin  # the session's transaction is to begin with this pipeline
        self._unflushed = 0
        self._queued: deque[_Queued | None] = deque()   # None marks a sync point
        self._copy: _Queued | None = None  # a COPY sent whose result is not read yet
        self._error: PipelineError | None = None
        self._mismatch: str | None = None
        self.round_trips = 0

    def open(self) -> Pipeline:
        self.pgconn.enter_pipeline_mode()
        self.pgconn.nonblocking = 1
        if self._begin:
            self._begin = False
            self.send("BEGIN")
        return self

    def __enter__(self) -> Pipeline:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._leave(failing=exc_type is not None)

    def finish(self) -> None:
        """Read every outstanding result, leave pipeline mode, and raise as ``sync`` does."""
        try:
            self._end_copy()
            if self._queued:
                self._read(block=True, until_empty=True)
                self.round_trips += 1
        except BaseException:
            self._leave(failing=True)
            raise
        self._leave(failing=False)
        self._raise_outcome()

    def abandon(self) -> None:
        """Leave pipeline mode after a failure, reading (and dropping) what is outstanding."""
        self._leave(failing=True)

    def _leave(self, *, failing: bool) -> None:
        # Leave pipeline mode whatever happened, so the session can run its ROLLBACK; if that is
        # impossible the connection is unusable, which the next statement reports as transient.
        try:
            if self._copy is not None:
                try:
                    self._end_copy()
                except (PipelineError, RowCountMismatch):
                    if not failing:
                        raise
            if self.pgconn.status == pq.ConnStatus.OK and self.pgconn.pipeline_status != pq.PipelineStatus.OFF:
                if self._queued:
                    if self._queued[-1] is not None:
                        self.pgconn.pipeline_sync()  # results are only sent up to a sync point
                        self._queued.append(None)
                        self._flush()
                    self._read(block=True, until_empty=True)
                self.pgconn.exit_pipeline_mode()
        except Exception:
            if not failing:
                raise
        finally:
            self._queued.clear()
            self._copy = None
            self.pgconn.nonblocking = 0

    # -- sending ----------------------------------------------------------------------------------
    def prepare(self, name: bytes, sql: str) -> None:
        self._end_copy()
        self.pgconn.send_prepare(name, sql.encode())
        self._queue(_Queued(f"preparing {_abbreviate(sql)}", None))

    def send_prepared(self, name: bytes, sql: str, values: Sequence[bytes | None],
                      formats: Sequence[int], expected_rows: int | None = None,
                      on_value: Callable[[bytes | None], None] | None = None) -> None:
        self._end_copy()
        self.pgconn.send_query_prepared(name, values, formats)
        self._queue(_Queued(_abbreviate(sql), expected_rows, on_value))

    def run(self, statement: Preparable, values: Sequence[bytes | None], formats: Sequence[int] | None = None,
            *, expected_rows: int | None = None,
            on_value: Callable[[bytes | None], None] | None = None) -> None:
        """Queue a statement of the session's (``TargetSession.run``), prepared first in this
        pipeline if the session has not prepared it yet."""
        name = statement.name
        if name not in self._session_prepared and name not in self._preparing:
            self._end_copy()
            self.pgconn.send_prepare(name, statement.sql.encode())
            self._queue(_Queued(f"preparing {_abbreviate(statement.sql)}", None, prepared=name))
            self._preparing.add(name)
        self.send_prepared(name, statement.sql, values, formats or [0] * len(values), expected_rows, on_value)

    def send(self, sql: str, values: Sequence[bytes | None] | None = None,
             expected_rows: int | None = None,
             on_value: Callable[[bytes | None], None] | None = None) -> None:
        self._end_copy()
        self.pgconn.send_query_params(sql.encode(), values or None)
        self._queue(_Queued(_abbreviate(sql), expected_rows, on_value))

    def _queue(self, queued: _Queued) -> None:
        self._queued.append(queued)
        self._unflushed += 1
        if self._unflushed >= FLUSH_EVERY:
            self._flush()

    def sql(self, text: str, values: Sequence[bytes | None] | None = None) -> None:
        """Queue a statement whose outcome only matters if it fails (a bookkeeping write)."""
        self.send(text, values)

    def copy(self, sql: str, data: bytes | bytearray, expected_rows: int | None) -> None:
        """``COPY ... FROM STDIN`` with ``data``. libpq runs no COPY in pipeline mode: what is
        queued is synced first (its errors and counts raised as by ``sync``), then the COPY runs
        on its own. Its result is read (and pipeline mode entered again) only when the next
        statement is sent, or at ``sync``/``finish``: until then the server loads the rows while
        the caller goes on."""
        self._end_copy()
        if self._queued:
            self.sync()
        pgconn = self.pgconn
        pgconn.exit_pipeline_mode()
        pgconn.nonblocking = 0
        queued = _Queued(_abbreviate(sql), expected_rows)
        try:
            result = pgconn.exec_(sql.encode())
            if result.status == pq.ExecStatus.COPY_IN:
                if pgconn.put_copy_data(data) == 1 and pgconn.put_copy_end() == 1:
                    self._copy = queued  # in flight
                    return
                self._check_connection()
            self._copy = queued  # the result (an error) is read as the COPY's own
            self._take(result, queued)
            self._end_copy()
        except BaseException:
            self._copy = None
            if pgconn.status == pq.ConnStatus.OK:
                pgconn.nonblocking = 1
                pgconn.enter_pipeline_mode()
            raise

    def _end_copy(self) -> None:
        """Read the result of the COPY in flight, if any, and enter pipeline mode again."""
        queued = self._copy
        if queued is None:
            return
        self._copy = None
        pgconn = self.pgconn
        try:
            result = pgconn.get_result()
            while result is not None:
                self._take(result, queued)
                result = pgconn.get_result()
            self._check_connection()
        finally:
            if pgconn.status == pq.ConnStatus.OK:
                pgconn.nonblocking = 1
                pgconn.enter_pipeline_mode()
        self.round_trips += 1
        self._raise_outcome()

    def sync(self) -> None:
        """End the batch and read every result; raise the first error, else any row-count mismatch."""
        self._end_copy()
        self.pgconn.pipeline_sync()
        self._queued.append(None)
        self._flush()
        self._read(block=True, until_empty=True)
        self.round_trips += 1
        self._raise_outcome()

    def send_sync(self) -> None:
        """End the batch without reading its results (``finish`` reads them). A COPY in flight
        with nothing after it is left as it is: its result is the outstanding one."""
        if self._copy is not None:
            return
        self.pgconn.pipeline_sync()
        self._queued.append(None)
        self._flush()

    def _raise_outcome(self) -> None:
        error, mismatch = self._error, self._mismatch
        self._error = self._mismatch = None
        if error is not None:
            raise error
        if mismatch is not None:
            raise RowCountMismatch(mismatch)

    # -- the socket ---------------------------------------------------------------------------
    def _flush(self) -> None:
        self._unflushed = 0
        pgconn = self.pgconn
        while pgconn.flush() == 1:
            readable, writable, _ = select.select([pgconn.socket], [pgconn.socket], [], 5.0)
            if readable:
                pgconn.consume_input()
                self._read(block=False, until_empty=False)
        self._check_connection()

    def _read(self, *, block: bool, until_empty: bool) -> None:
        pgconn = self.pgconn
        while self._queued:
            if pgconn.is_busy():
                if not block:
                    return
                select.select([pgconn.socket], [], [], 5.0)
                pgconn.consume_input()
                self._check_connection()
                continue
            result = pgconn.get_result()
            if result is None:
                continue  # the end of one statement's results
            queued = self._queued.popleft()
            if queued is None:
                if result.status != _SYNC:
                    raise PipelineError(f"target: pipeline out of step (got {result.status!r} at a "
                                        "sync point)", cause=Cause.LOST_CONNECTION)
                if not until_empty:
                    return
                continue
            self._take(result, queued)

    def _take(self, result: pq.abc.PGresult, queued: _Queued) -> None:
        status = result.status
        if status in _OK:
            if queued.prepared is not None:
                self._session_prepared.add(queued.prepared)
            if queued.on_value is not None and result.ntuples:
                queued.on_value(result.get_value(0, 0))
            if queued.expected_rows is not None and self._mismatch is None:
                affected = int(result.command_tuples or 0)
                if affected != queued.expected_rows:
                    self._mismatch = (f"{queued.what}: {affected} rows affected, "
                                      f"{queued.expected_rows} expected")
            return
        if status == _ABORTED or self._error is not None:
            return  # a consequence of the first error, which is the one reported
        raw_state = result.error_field(pq.DiagnosticField.SQLSTATE)
        sqlstate = raw_state.decode() if raw_state else None
        message = result.error_message.decode(errors="replace").strip()
        cause = cause_of_sqlstate(sqlstate, side="target") if sqlstate else Cause.REFUSED_DATA
        self._error = PipelineError(f"target: {queued.what} failed: {message}", sqlstate=sqlstate,
                                    cause=cause)

    def _check_connection(self) -> None:
        if self.pgconn.status != pq.ConnStatus.OK:
            message = self.pgconn.error_message.decode(errors="replace").strip()
            raise PipelineError(f"target: connection lost: {message}", cause=Cause.LOST_CONNECTION)
