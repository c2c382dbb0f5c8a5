"""libpq pipeline mode on the target session: many statements per network round trip.

Statements are sent without waiting for their results; ``sync()`` ends the batch and reads every
result back in order. Each queued statement may carry the row count it must affect: the fast
apply path knows exactly what each statement should do (one row per update, n rows per n-row
insert), and any difference is reported as ``RowCountMismatch`` after the whole batch was read,
so the caller can roll back and redo that stretch carefully. Must never decide what to send or
when to commit: it only moves statements and results.

Sending and reading interleave (non-blocking socket, flush, consume input) so a long pipeline
never deadlocks on full socket buffers in both directions.
"""

from __future__ import annotations

import select
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from psycopg import pq

__all__ = ["Pipeline", "PipelineError", "RowCountMismatch"]

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_SYNC = pq.ExecStatus.PIPELINE_SYNC
_ABORTED = pq.ExecStatus.PIPELINE_ABORTED


class PipelineError(Exception):
    """A statement of the batch failed; the transaction is aborted on the server."""

    def __init__(self, message: str, *, sqlstate: str | None, transient: bool) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.transient = transient


class RowCountMismatch(Exception):
    """A statement affected another number of rows than expected (a conflict somewhere)."""


def _abbreviate(sql: str, limit: int = 160) -> str:
    """Statement text for messages: multi-row statements run to many kilobytes."""
    return sql if len(sql) <= limit else f"{sql[:limit]}... ({len(sql)} characters)"


@dataclass(slots=True)
class _Queued:
    what: str                # for error messages: the SQL text
    expected_rows: int | None
    on_value: Callable[[bytes | None], None] | None = None  # receives the first value returned


class Pipeline:
    def __init__(self, pgconn: pq.abc.PGconn) -> None:
        self.pgconn = pgconn
        self._queued: deque[_Queued | None] = deque()   # None marks a sync point
        self._error: PipelineError | None = None
        self._mismatch: str | None = None
        self.round_trips = 0

    def __enter__(self) -> Pipeline:
        self.pgconn.enter_pipeline_mode()
        self.pgconn.nonblocking = 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Leave pipeline mode whatever happened, so the session can run its ROLLBACK; if that is
        # impossible the connection is unusable, which the next statement reports as transient.
        try:
            if self.pgconn.status == pq.ConnStatus.OK and self.pgconn.pipeline_status != pq.PipelineStatus.OFF:
                if self._queued:
                    if self._queued[-1] is not None:
                        self.pgconn.pipeline_sync()  # results are only sent up to a sync point
                        self._queued.append(None)
                        self._flush()
                    self._read(block=True, until_empty=True)
                self.pgconn.exit_pipeline_mode()
        except Exception:
            if exc_type is None:
                raise
        finally:
            self._queued.clear()
            self.pgconn.nonblocking = 0

    # -- sending ----------------------------------------------------------------------------------
    def prepare(self, name: bytes, sql: str) -> None:
        self.pgconn.send_prepare(name, sql.encode())
        self._queued.append(_Queued(f"preparing {_abbreviate(sql)}", None))
        self._flush()

    def send_prepared(self, name: bytes, sql: str, values: Sequence[bytes | None],
                      formats: Sequence[int], expected_rows: int | None = None) -> None:
        self.pgconn.send_query_prepared(name, values, formats)
        self._queued.append(_Queued(_abbreviate(sql), expected_rows))
        self._flush()

    def send(self, sql: str, values: Sequence[bytes | None] | None = None,
             expected_rows: int | None = None,
             on_value: Callable[[bytes | None], None] | None = None) -> None:
        self.pgconn.send_query_params(sql.encode(), values or None)
        self._queued.append(_Queued(_abbreviate(sql), expected_rows, on_value))
        self._flush()

    def copy(self, sql: str, data: bytes, expected_rows: int | None) -> None:
        """``COPY ... FROM STDIN`` with ``data``. libpq runs no COPY in pipeline mode: what is
        queued is synced first (its errors and counts raised as by ``sync``), then the COPY runs
        on its own and pipeline mode is entered again."""
        if self._queued:
            self.sync()
        pgconn = self.pgconn
        pgconn.exit_pipeline_mode()
        pgconn.nonblocking = 0
        queued = _Queued(_abbreviate(sql), expected_rows)
        try:
            result = pgconn.exec_(sql.encode())
            if result.status == pq.ExecStatus.COPY_IN:
                if pgconn.put_copy_data(data) != 1 or pgconn.put_copy_end() != 1:
                    self._check_connection()
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
        self.pgconn.pipeline_sync()
        self._queued.append(None)
        self._flush()
        self._read(block=True, until_empty=True)
        self.round_trips += 1
        self._raise_outcome()

    def _raise_outcome(self) -> None:
        error, mismatch = self._error, self._mismatch
        self._error = self._mismatch = None
        if error is not None:
            raise error
        if mismatch is not None:
            raise RowCountMismatch(mismatch)

    # -- the socket ---------------------------------------------------------------------------
    def _flush(self) -> None:
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
                                        "sync point)", sqlstate=None, transient=True)
                if not until_empty:
                    return
                continue
            self._take(result, queued)

    def _take(self, result: pq.abc.PGresult, queued: _Queued) -> None:
        status = result.status
        if status in _OK:
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
        self._error = PipelineError(f"target: {queued.what} failed: {message}", sqlstate=sqlstate,
                                    transient=bool(sqlstate) and sqlstate[:2] in ("08", "57"))

    def _check_connection(self) -> None:
        if self.pgconn.status != pq.ConnStatus.OK:
            message = self.pgconn.error_message.decode(errors="replace").strip()
            raise PipelineError(f"target: connection lost: {message}", sqlstate=None, transient=True)
